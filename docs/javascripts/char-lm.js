// The character-level language model of tutorial page 11, run in the browser.
//
// The page holds a <div class="charlm" data-src="..."> (attention_ref.lm.widget_html); this
// script loads the model's manifest (JSON) and float16 weights (exported at build by
// docs/hooks/char_lm.py from attention_ref.lm.browser_export) and computes the same forward
// pass as attention_ref.lm.CharLM, in float64: embedding, pre-norm blocks (LayerNorm, causal
// attention with rotary positions, LayerNorm, MLP with tanh-GELU), a last LayerNorm and the
// tied embedding as the output layer. tests/site/test_char_lm.py checks its logits against
// torch's on 20 prompts. `trace` returns every stage of that pass at one position, for one
// layer and head (the widget's "step through" panel shows them); the same test file checks it
// against attention_ref.lm.forward_trace.
//
// Shapes as in the package: L tokens, d width, H heads, D = d / H, V vocabulary.
(function () {
  "use strict";

  // ---- the model ---------------------------------------------------------------------------

  function halfToFloat(bits) {
    const sign = bits & 0x8000 ? -1 : 1;
    const exponent = (bits >> 10) & 0x1f;
    const fraction = bits & 0x3ff;
    if (exponent === 0) return sign * fraction * Math.pow(2, -24); // subnormal
    if (exponent === 31) return fraction ? NaN : sign * Infinity;
    return sign * (1 + fraction / 1024) * Math.pow(2, exponent - 15);
  }

  class CharModel {
    constructor(manifest, buffer) {
      const c = manifest.config;
      if (c.sinks || c.positions === "learned") {
        throw new Error("this script runs models with rotary positions and no sinks only");
      }
      this.chars = manifest.chars;
      this.V = c.vocab_size;
      this.d = c.width;
      this.H = c.heads;
      this.D = c.width / c.heads;
      this.layers = c.layers;
      this.context = c.context;
      this.rope = c.positions === "rope";
      this.mlp = c.mlp;
      this.eps = manifest.layer_norm_eps;
      this.ids = new Map(Array.from(this.chars).map((ch, i) => [ch, i]));
      const halves = new Uint16Array(buffer);
      if (halves.length !== manifest.numbers) {
        throw new Error(`weights: expected ${manifest.numbers} float16 numbers, got ${halves.length}`);
      }
      this.w = {};
      for (const t of manifest.tensors) {
        const n = t.shape.reduce((a, b) => a * b, 1);
        const out = new Float64Array(n);
        for (let i = 0; i < n; i++) out[i] = halfToFloat(halves[t.offset + i]);
        this.w[t.name] = out;
      }
      // theta_j = base^(-2j/D) for the D/2 feature pairs (j, j + D/2), as positional.rope
      this.theta = new Float64Array(this.D / 2);
      for (let j = 0; j < this.D / 2; j++) this.theta[j] = Math.pow(manifest.rope_base, (-2 * j) / this.D);
    }

    // The ids of the characters of `text` in the vocabulary, and the ones that are not.
    encode(text) {
      const ids = [];
      const unknown = [];
      Array.from(text).forEach((ch, i) => {
        const id = this.ids.get(ch);
        if (id === undefined) unknown.push([i, ch]);
        else ids.push(id);
      });
      return { ids, unknown };
    }

    layerNorm(x, L, prefix) {
      const d = this.d, g = this.w[prefix + ".weight"], b = this.w[prefix + ".bias"];
      const out = new Float64Array(L * d);
      for (let l = 0; l < L; l++) {
        let mean = 0, varSum = 0;
        for (let i = 0; i < d; i++) mean += x[l * d + i];
        mean /= d;
        for (let i = 0; i < d; i++) varSum += (x[l * d + i] - mean) ** 2;
        const inv = 1 / Math.sqrt(varSum / d + this.eps);
        for (let i = 0; i < d; i++) out[l * d + i] = (x[l * d + i] - mean) * inv * g[i] + b[i];
      }
      return out;
    }

    // y = x W^T + b for x (L, n), W (m, n) as torch.nn.Linear stores it -> (L, m)
    linear(x, L, n, prefix) {
      const W = this.w[prefix + ".weight"], b = this.w[prefix + ".bias"];
      const m = b.length;
      const out = new Float64Array(L * m);
      for (let l = 0; l < L; l++) {
        const row = l * n;
        for (let o = 0; o < m; o++) {
          let s = b[o];
          const wo = o * n;
          for (let i = 0; i < n; i++) s += x[row + i] * W[wo + i];
          out[l * m + o] = s;
        }
      }
      return out;
    }

    // Rotate the D features of one head at `offset` of `v` by position `pos` (half-split pairs).
    rotate(v, offset, pos) {
      const half = this.D / 2;
      for (let j = 0; j < half; j++) {
        const angle = pos * this.theta[j], cos = Math.cos(angle), sin = Math.sin(angle);
        const a = v[offset + j], b = v[offset + j + half];
        v[offset + j] = a * cos - b * sin;
        v[offset + j + half] = b * cos + a * sin;
      }
    }

    // A run of the model over `ids` (at most `context` of them). `previous`, a run whose ids
    // are a prefix of these, lends its keys, values, weights and logits (a KV cache): only
    // the new positions are computed. Returns {ids, logits (L*V), weights[layer][head]
    // (L*L, row i = query i), keys, values}. `probe`, an object, is filled with what each
    // stage gives (see `trace`, which reads it): probe.layers[layer] = {input, norm1, qkv,
    // queries, keys (rotated), values, dots[h] and scaled[h] (the last query's scores before
    // and after 1/sqrt(D)), attended, projected, residual, norm2, up, gelu, down, output} and
    // probe.finalNorm, each (positions computed) x (its width), but keys and values (L, d).
    // `off`, a list of [layer, head] pairs, switches those heads off: their weights are still
    // computed and returned, but they add nothing to the layer's output (attention_ref.lm's
    // `ablate`). A previous run lends its cache only if it had the same heads off.
    run(ids, previous, probe, off) {
      const L = ids.length, d = this.d, H = this.H, D = this.D, V = this.V;
      if (L > this.context) throw new Error(`at most ${this.context} characters, got ${L}`);
      for (const pair of off || []) { // a head that does not exist is named, never ignored
        const [layer, head] = Array.isArray(pair) ? pair : [];
        if (!Number.isInteger(layer) || !Number.isInteger(head) || layer < 0 || layer >= this.layers ||
            head < 0 || head >= H) {
          throw new RangeError(`off: no head ${JSON.stringify(pair)} in ${this.layers} layers x ${H} heads`);
        }
      }
      const silent = new Set((off || []).map(([layer, head]) => layer * H + head));
      const offKey = Array.from(silent).sort((a, b) => a - b).join(",");
      let p = 0;
      if (previous && previous.ids.length <= L && previous.off === offKey) {
        while (p < previous.ids.length && previous.ids[p] === ids[p]) p++;
        if (p < previous.ids.length) p = 0; // not a prefix: start again
      }
      if (p === L && L > 0) p = L - 1 >= 0 ? L - 1 : 0; // recompute the last position at least
      const fresh = L - p; // positions p .. L - 1 are computed
      const keys = [], values = [], weights = [];
      let x = new Float64Array(fresh * d);
      const E = this.w["embed.weight"];
      for (let l = 0; l < fresh; l++) x.set(E.subarray(ids[p + l] * d, (ids[p + l] + 1) * d), l * d);
      if (probe) probe.layers = [];
      for (let layer = 0; layer < this.layers; layer++) {
        const pre = `blocks.${layer}.`;
        const rec = probe ? { input: x.slice(), dots: [], scaled: [] } : null;
        const normed = this.layerNorm(x, fresh, pre + "norm1");
        const qkv = this.linear(normed, fresh, d, pre + "qkv"); // (fresh, 3d)
        const K = new Float64Array(L * d), Vv = new Float64Array(L * d);
        if (p > 0) {
          K.set(previous.keys[layer].subarray(0, p * d));
          Vv.set(previous.values[layer].subarray(0, p * d));
        }
        const Q = new Float64Array(fresh * d);
        for (let l = 0; l < fresh; l++) {
          Q.set(qkv.subarray(l * 3 * d, l * 3 * d + d), l * d);
          K.set(qkv.subarray(l * 3 * d + d, l * 3 * d + 2 * d), (p + l) * d);
          Vv.set(qkv.subarray(l * 3 * d + 2 * d, l * 3 * d + 3 * d), (p + l) * d);
          if (this.rope) {
            for (let h = 0; h < H; h++) {
              this.rotate(Q, l * d + h * D, p + l);
              this.rotate(K, (p + l) * d + h * D, p + l);
            }
          }
        }
        const attended = new Float64Array(fresh * d);
        const layerWeights = [];
        const scale = 1 / Math.sqrt(D);
        for (let h = 0; h < H; h++) {
          const Wm = new Float64Array(L * L);
          if (p > 0) {
            const old = previous.weights[layer][h], oldL = previous.ids.length;
            for (let i = 0; i < p; i++) Wm.set(old.subarray(i * oldL, i * oldL + i + 1), i * L);
          }
          for (let l = 0; l < fresh; l++) {
            const i = p + l; // the query's position: keys 0 .. i take part (causal)
            let max = -Infinity;
            const s = new Float64Array(i + 1);
            const dots = rec && l === fresh - 1 ? (rec.dots[h] = new Float64Array(i + 1)) : null;
            for (let j = 0; j <= i; j++) {
              let dot = 0;
              for (let e = 0; e < D; e++) dot += Q[l * d + h * D + e] * K[j * d + h * D + e];
              if (dots) dots[j] = dot;
              s[j] = dot * scale;
              if (s[j] > max) max = s[j];
            }
            if (dots) rec.scaled[h] = s.slice();
            let sum = 0;
            for (let j = 0; j <= i; j++) { s[j] = Math.exp(s[j] - max); sum += s[j]; }
            const adds = !silent.has(layer * H + h); // a head switched off adds nothing
            for (let j = 0; j <= i; j++) {
              const wgt = s[j] / sum;
              Wm[i * L + j] = wgt;
              if (adds) for (let e = 0; e < D; e++) attended[l * d + h * D + e] += wgt * Vv[j * d + h * D + e];
            }
          }
          layerWeights.push(Wm);
        }
        const projected = this.linear(attended, fresh, d, pre + "out");
        for (let i = 0; i < x.length; i++) x[i] += projected[i];
        if (rec) Object.assign(rec, { norm1: normed, qkv, queries: Q, keys: K, values: Vv, attended, projected,
          residual: x.slice() });
        if (this.mlp) {
          const normed2 = this.layerNorm(x, fresh, pre + "norm2");
          const up = this.linear(normed2, fresh, d, pre + "up");
          if (rec) Object.assign(rec, { norm2: normed2, up: up.slice() });
          const c = Math.sqrt(2 / Math.PI);
          for (let i = 0; i < up.length; i++) {
            const u = up[i];
            up[i] = 0.5 * u * (1 + Math.tanh(c * (u + 0.044715 * u * u * u)));
          }
          const down = this.linear(up, fresh, 4 * d, pre + "down");
          for (let i = 0; i < x.length; i++) x[i] += down[i];
          if (rec) Object.assign(rec, { gelu: up, down });
        }
        if (rec) { rec.output = x.slice(); probe.layers.push(rec); }
        keys.push(K);
        values.push(Vv);
        weights.push(layerWeights);
      }
      const h = this.layerNorm(x, fresh, "norm");
      if (probe) probe.finalNorm = h;
      const logits = new Float64Array(L * V);
      if (p > 0) logits.set(previous.logits.subarray(0, p * V));
      for (let l = 0; l < fresh; l++) {
        for (let v = 0; v < V; v++) {
          let s = 0;
          for (let i = 0; i < d; i++) s += h[l * d + i] * E[v * d + i];
          logits[(p + l) * V + v] = s;
        }
      }
      return { ids: ids.slice(), logits, weights, keys, values, computed: fresh, off: offKey };
    }

    // Mean cross-entropy (nats per character) of a run's predictions of its own next characters:
    // row i of the logits predicts ids[i + 1]. NaN for fewer than two characters.
    loss(run) {
      const V = this.V, L = run.ids.length;
      let total = 0;
      for (let i = 0; i + 1 < L; i++) {
        const row = run.logits.subarray(i * V, (i + 1) * V);
        let max = -Infinity;
        for (const v of row) if (v > max) max = v;
        let sum = 0;
        for (const v of row) sum += Math.exp(v - max);
        total += Math.log(sum) + max - row[run.ids[i + 1]];
      }
      return L > 1 ? total / (L - 1) : NaN;
    }

    // Every stage of the forward pass at `position` of `ids`, for one layer and head: `run` on
    // the prefix ids[0 .. position] with a probe, read at the last row. The same names and
    // numbers as attention_ref.lm.forward_trace (tests/site/test_char_lm.py holds them
    // together): id, embedding, block_input, norm1, q, k, v (the head's, before rotation),
    // q_rotated, k_rotated, scores / scaled / weights over keys 0 .. position, head_output,
    // heads (every head's output joined), out, residual, norm2, up, gelu, down (with an MLP),
    // block_output, final_norm, logits, probabilities. Each is a Float64Array but `id`.
    trace(ids, position, layer, head, off) {
      const check = (name, value, stop) => {
        if (!Number.isInteger(value) || value < 0 || value >= stop) {
          throw new RangeError(`${name} must be an integer in [0, ${stop}), got ${value}`);
        }
      };
      check("position", position, Math.min(ids.length, this.context));
      check("layer", layer, this.layers);
      check("head", head, this.H);
      const d = this.d, D = this.D, V = this.V, i = position, probe = {};
      const run = this.run(ids.slice(0, i + 1), null, probe, off); // heads switched off add nothing
      const r = probe.layers[layer];
      const row = (a, n) => a.slice(i * n, (i + 1) * n); // position i's row of an (L, n) array
      const ofHead = (a, n, start) => a.slice(i * n + start + head * D, i * n + start + (head + 1) * D);
      const logits = row(run.logits, V);
      const max = Math.max(...logits);
      const exp = logits.map((z) => Math.exp(z - max)), sum = exp.reduce((a, b) => a + b, 0);
      const t = {
        id: ids[i], embedding: this.w["embed.weight"].slice(ids[i] * d, (ids[i] + 1) * d),
        block_input: row(r.input, d), norm1: row(r.norm1, d),
        q: ofHead(r.qkv, 3 * d, 0), k: ofHead(r.qkv, 3 * d, d), v: ofHead(r.qkv, 3 * d, 2 * d),
        q_rotated: ofHead(r.queries, d, 0), k_rotated: ofHead(r.keys, d, 0),
        scores: r.dots[head], scaled: r.scaled[head],
        weights: run.weights[layer][head].slice(i * (i + 1), (i + 1) * (i + 1)),
        head_output: ofHead(r.attended, d, 0), heads: row(r.attended, d), out: row(r.projected, d),
        residual: row(r.residual, d),
      };
      if (this.mlp) Object.assign(t, { norm2: row(r.norm2, d), up: row(r.up, 4 * d), gelu: row(r.gelu, 4 * d),
        down: row(r.down, d) });
      return Object.assign(t, { block_output: row(r.output, d), final_norm: row(probe.finalNorm, d), logits,
        probabilities: exp.map((e) => e / sum) });
    }
  }

  // Probabilities of the next character from the last row of logits: softmax(logits / T) over
  // the top_k largest (T = 0: all on the largest), as attention_ref.lm.generate samples.
  // Where the widget starts reading a text of `length` characters (attention_ref.lm.widget_window_start):
  // 0 while it fits the context; past it, the window jumps ahead `hop` characters at a time (half the
  // context), so it reads between context - hop + 1 and context characters, and between jumps one
  // character more reuses the keys and values of the others. A window sliding by one could not: a
  // deeper layer's key depends on every character before it in the window.
  function windowStart(length, context, hop = Math.floor(context / 2)) {
    return length <= context ? 0 : Math.ceil((length - context) / hop) * hop;
  }

  function nextProbabilities(logits, V, temperature, topK) {
    const last = Array.from(logits.subarray(logits.length - V));
    const order = last.map((_, i) => i).sort((a, b) => last[b] - last[a]);
    const probs = new Float64Array(V);
    if (temperature === 0) { probs[order[0]] = 1; return probs; }
    const keep = order.slice(0, Math.max(1, Math.min(topK, V)));
    const max = last[order[0]] / temperature;
    let sum = 0;
    for (const i of keep) { probs[i] = Math.exp(last[i] / temperature - max); sum += probs[i]; }
    for (const i of keep) probs[i] /= sum;
    return probs;
  }

  const loaded = new Map(); // manifest URL -> Promise<CharModel>
  function load(manifestUrl) {
    const url = new URL(manifestUrl, document.baseURI).href;
    if (!loaded.has(url)) {
      const promise = fetch(url).then((r) => {
        if (!r.ok) throw new Error(`${r.status} ${url}`);
        return r.json();
      }).then((manifest) => {
        const weightsUrl = new URL(manifest.weights, url).href;
        return fetch(weightsUrl).then((r) => {
          if (!r.ok) throw new Error(`${r.status} ${weightsUrl}`);
          return r.arrayBuffer();
        }).then((buffer) => new CharModel(manifest, buffer));
      });
      promise.catch(() => loaded.delete(url)); // a failed load may be retried
      loaded.set(url, promise);
    }
    return loaded.get(url);
  }

  // ---- the widget --------------------------------------------------------------------------

  function showChar(ch) {
    if (ch === "\n") return "⏎";
    if (ch === " ") return "␣";
    return ch;
  }

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function heatColor(weight) {
    // weights shown with a square root, so that a spread-out row still shows
    return `rgba(30, 136, 229, ${Math.sqrt(Math.max(0, Math.min(1, weight))).toFixed(3)})`;
  }

  // A value's colour in a strip: orange above 0, blue below, stronger the larger |value| / `scale`.
  function signedColor(value, scale) {
    const a = Math.sqrt(Math.min(1, Math.abs(value) / (scale || 1))).toFixed(3);
    return value >= 0 ? `rgba(239, 108, 0, ${a})` : `rgba(30, 136, 229, ${a})`;
  }

  const fmt = (x) => (Math.abs(x) < 5e-4 ? 0 : x).toFixed(3);
  const norm = (v) => Math.sqrt(v.reduce((a, x) => a + x * x, 0));

  let stepPanels = 0; // a distinct id per panel on the page

  // The "step through" panel: one position of the text, one layer and head, every stage of the
  // forward pass with its numbers (CharModel.trace). `state` is the widget's (model, run, layer,
  // head); `chooseHead(layer, head)` makes the widget show that head everywhere.
  function stepper(state, chooseHead) {
    const id = `charlm-step-${++stepPanels}`;
    const ui = {};
    ui.toggle = el("button", { type: "button", class: "md-button charlm-step-toggle", "aria-expanded": "false",
      "aria-controls": id }, "Step through the forward pass");
    ui.panel = el("section", { class: "charlm-step", id, hidden: "", "aria-label": "The forward pass, step by step" });
    const controls = el("div", { class: "charlm-step-controls" });
    const posLabel = el("label", {});
    ui.position = el("input", { type: "range", min: "0", max: "0", step: "1", value: "0",
      "aria-label": "Position of the character traced" });
    ui.posValue = el("output", { class: "charlm-step-pos" }, "");
    posLabel.append(el("span", {}, "character "), ui.position, ui.posValue);
    const select = (label, name) => {
      const wrap = el("label", {});
      const box = el("select", { "aria-label": label });
      wrap.append(el("span", {}, name + " "), box);
      controls.append(wrap);
      return box;
    };
    controls.append(posLabel);
    ui.layer = select("Layer traced", "layer");
    ui.head = select("Head traced", "head");
    ui.where = el("p", { class: "charlm-step-where" }, "");
    ui.stages = el("ol", { class: "charlm-stages" });
    ui.panel.append(controls, ui.where, ui.stages);
    let follow = true; // trace the last character while the text grows, until another is picked
    let pending = null;

    function options() {
      const m = state.model;
      if (ui.layer.options.length !== m.layers) {
        ui.layer.replaceChildren(...Array.from({ length: m.layers }, (_, l) => el("option", { value: String(l) }, String(l))));
        ui.head.replaceChildren(...Array.from({ length: m.H }, (_, h) => el("option", { value: String(h) }, String(h))));
      }
      ui.layer.value = String(state.layer);
      ui.head.value = String(state.head);
    }

    // A vector: a strip of coloured cells (its value on hover or tap), its first entries and its norm.
    function vector(name, values, label) {
      const box = el("div", { class: "charlm-vec", "data-name": name, "data-norm": norm(values).toPrecision(12) });
      const scale = values.reduce((a, x) => Math.max(a, Math.abs(x)), 0);
      const strip = el("canvas", { class: "charlm-strip", width: String(values.length), height: "1", role: "img",
        "aria-label": `${label}: ${values.length} numbers, norm ${fmt(norm(values))}` });
      const ctx = strip.getContext("2d");
      values.forEach((x, k) => { ctx.fillStyle = signedColor(x, scale); ctx.fillRect(k, 0, 1, 1); });
      const first = Array.from(values.slice(0, 5), fmt).join(", ");
      const summary = `${label}: ${values.length} numbers, norm ${fmt(norm(values))}`;
      const entries = `[${first}${values.length > 5 ? ", …" : ""}]`;
      const line = el("code", { class: "charlm-vec-text" }, summary);
      const list = el("code", { class: "charlm-vec-text" }, entries);
      // the entry under the pointer (or a tap) replaces the summary until the pointer leaves
      const point = (event) => {
        const r = strip.getBoundingClientRect();
        const k = Math.max(0, Math.min(values.length - 1, Math.floor(((event.clientX - r.left) / r.width) * values.length)));
        line.textContent = `${label}[${k}] = ${values[k].toFixed(4)}`;
      };
      strip.addEventListener("pointermove", point);
      strip.addEventListener("pointerdown", point);
      strip.addEventListener("pointerleave", () => { line.textContent = summary; });
      box.append(strip, line, list);
      return box;
    }

    function stage(name, title, note, ...parts) {
      const li = el("li", { class: "charlm-stage", "data-stage": name });
      li.append(el("p", { class: "charlm-stage-title" }, title));
      if (note) li.append(el("p", { class: "charlm-stage-note" }, note));
      li.append(...parts);
      ui.stages.append(li);
    }

    function draw() {
      pending = null;
      const m = state.model, run = state.run;
      ui.stages.replaceChildren();
      if (ui.panel.hidden || !m) return;
      options();
      if (!run) { ui.where.textContent = "Type some text above to trace it."; ui.posValue.textContent = ""; return; }
      const ids = run.ids, L = ids.length;
      ui.position.max = String(L - 1);
      if (follow || Number(ui.position.value) > L - 1) ui.position.value = String(L - 1);
      const i = Number(ui.position.value), layer = state.layer, head = state.head;
      const t = m.trace(ids, i, layer, head, state.off);
      const ch = (k) => showChar(m.chars[ids[k]]);
      const D = m.D, d = m.d, last = m.layers - 1;
      ui.posValue.textContent = `${i}: “${ch(i)}”`;
      const next = i + 1 < L ? ` The text has “${ch(i + 1)}” next.` : " It is the last one: what comes next is unknown.";
      ui.where.textContent = `Position ${i} (counting from 0), “${ch(i)}”: the model reads the ${i + 1} ` +
        `character${i ? "s" : ""} up to it and predicts the one after it.${next}`;
      ui.panel.dataset.position = String(i);

      stage("embedding", "1. Character → id → embedding",
        `“${ch(i)}” has id ${t.id}: its vector is row ${t.id} of the embedding table.`, vector("embedding", t.embedding, "e"));
      let n = 2;
      if (layer > 0) {
        stage("block_input", `${n++}. Into layer ${layer}`,
          `The embedding plus what ${layer > 1 ? `layers 0 to ${layer - 1}` : "layer 0"} added at this position ` +
          "(the residual stream x).",
          vector("block_input", t.block_input, "x"));
      }
      const x = t.block_input, mean = x.reduce((a, b) => a + b, 0) / d;
      const std = Math.sqrt(x.reduce((a, b) => a + (b - mean) ** 2, 0) / d);
      stage("norm1", `${n++}. Layer norm`, `x minus its mean (${fmt(mean)}), divided by its standard deviation ` +
        `(${fmt(std)}), times a learned gain, plus a learned bias.`, vector("norm1", t.norm1, "n"));
      stage("qkv", `${n++}. Query, key, value of head ${head}`, `n times the qkv weights: ${3 * d} numbers, of ` +
        `which head ${head} takes ${D} each.`, vector("q", t.q, "q"), vector("k", t.k, "k"), vector("v", t.v, "v"));
      stage("rope", `${n++}. Rotation (RoPE)`, `q and k turned by position ${i}: feature pair (j, j + ${D / 2}) by the ` +
        `angle ${i}·θ_j. Lengths stay; only the angle between a query and a key changes with their distance.`,
        vector("q_rotated", t.q_rotated, "q rotated"), vector("k_rotated", t.k_rotated, "k rotated"));
      stage("scores", `${n++}. Scores, scaled`, `q · k of each of the ${i + 1} characters up to this one (the later ` +
        `ones are masked: causal), times 1/√${D} = ${(1 / Math.sqrt(D)).toFixed(3)}.`,
        vector("scores", t.scores, "q·k"), vector("scaled", t.scaled, "q·k/√D"));
      const shaded = el("p", { class: "charlm-step-text", "aria-label": "Each character shaded by its weight" });
      for (let j = 0; j <= i; j++) {
        const span = el("span", { class: "charlm-step-token", title: `${(100 * t.weights[j]).toFixed(1)}%` }, ch(j));
        span.style.backgroundColor = heatColor(t.weights[j]);
        shaded.append(span);
      }
      const top = Array.from(t.weights.keys()).sort((a, b) => t.weights[b] - t.weights[a]).slice(0, 4);
      const table = el("table", { class: "charlm-step-table" });
      const headRow = el("tr", {});
      for (const h of ["key", "q·k", "÷√D", "weight"]) headRow.append(el("th", {}, h));
      table.append(headRow);
      for (const j of top) {
        const tr = el("tr", {});
        tr.append(el("td", {}, `“${ch(j)}” ${j}`), el("td", {}, fmt(t.scores[j])), el("td", {}, fmt(t.scaled[j])),
          el("td", {}, `${(100 * t.weights[j]).toFixed(1)}%`));
        table.append(tr);
      }
      stage("weights", `${n++}. Softmax`, "exp of each scaled score, divided by their sum: weights that sum to 1 " +
        "(the heaviest below).", shaded, el("div", { class: "charlm-table-wrap" }, undefined), vector("weights", t.weights, "w"));
      ui.stages.lastChild.querySelector(".charlm-table-wrap").append(table);
      stage("head_output", `${n++}. Weighted sum of the values`, `Σ w_j v_j over the ${i + 1} positions: what ` +
        `head ${head} brings back.`, vector("head_output", t.head_output, "a"));
      stage("out", `${n++}. Heads joined, projected`, `The ${m.H} heads' outputs side by side (${d} numbers), ` +
        "times the out weights.", vector("heads", t.heads, "heads"), vector("out", t.out, "out"));
      stage("residual", `${n++}. Residual`, "Added to what came in: x + out.", vector("residual", t.residual, "x"));
      if (m.mlp) {
        stage("mlp", `${n++}. MLP`, `Layer norm again, up to ${4 * d} numbers, GELU (tanh form), down to ${d}, ` +
          "added to x.", vector("norm2", t.norm2, "n2"), vector("up", t.up, "up"), vector("gelu", t.gelu, "gelu"),
          vector("down", t.down, "down"), vector("block_output", t.block_output, "x"));
      }
      const rest = layer === last ? "A " : layer + 1 === last ? `Layer ${last} runs the same way; after it, a ` :
        `Layers ${layer + 1} to ${last} run the same way; after the last, a `;
      stage("final_norm", `${n++}. Final layer norm`, rest + "last layer norm.", vector("final_norm", t.final_norm, "h"));
      const order = Array.from(t.probabilities.keys()).sort((a, b) => t.probabilities[b] - t.probabilities[a]);
      const list = el("ol", { class: "charlm-step-probs", "aria-label": "Most likely next characters here" });
      const actual = i + 1 < L ? ids[i + 1] : -1;
      for (const v of order.slice(0, 5)) {
        const li = el("li", actual === v ? { class: "charlm-actual" } : {});
        li.append(el("code", { class: "charlm-char" }, showChar(m.chars[v])));
        const bar = el("span", { class: "charlm-bar" });
        bar.style.width = `${(100 * t.probabilities[v]).toFixed(1)}%`;
        const track = el("span", { class: "charlm-track" });
        track.append(bar);
        li.append(track, el("span", { class: "charlm-p" }, `${(100 * t.probabilities[v]).toFixed(1)}%`));
        list.append(li);
      }
      const said = actual >= 0 ? ` The text's next character, “${showChar(m.chars[actual])}”, gets ` +
        `${(100 * t.probabilities[actual]).toFixed(1)}% (rank ${order.indexOf(actual) + 1}).` : "";
      stage("probabilities", `${n++}. Logits → next character`, `h times the embedding table (the same one as ` +
        `in step 1): ${m.V} logits; their softmax gives the probabilities (the likeliest five).${said}`,
        vector("logits", t.logits, "logits"), list);
    }

    // redraw soon (not on every keystroke or generated character)
    function schedule() {
      if (ui.panel.hidden) return;
      clearTimeout(pending);
      pending = setTimeout(draw, state.timer ? 400 : 60);
    }

    ui.toggle.addEventListener("click", () => {
      const open = ui.panel.hidden;
      ui.panel.hidden = !open;
      ui.toggle.setAttribute("aria-expanded", String(open));
      ui.toggle.textContent = open ? "Hide the forward pass" : "Step through the forward pass";
      if (open) draw(); else ui.stages.replaceChildren();
    });
    ui.position.addEventListener("input", () => {
      follow = Number(ui.position.value) === Number(ui.position.max);
      schedule(); // a held arrow key redraws once it is let go, not at every repeat
    });
    const pick = () => chooseHead(Number(ui.layer.value), Number(ui.head.value));
    ui.layer.addEventListener("change", pick);
    ui.head.addEventListener("change", pick);
    return { toggle: ui.toggle, panel: ui.panel, schedule, draw };
  }

  function setup(root) {
    if (root.dataset.ready) return;
    root.dataset.ready = "1";
    root.querySelectorAll(".charlm-fallback").forEach((n) => n.remove());
    const ui = {};
    ui.input = el("textarea", { class: "charlm-input", rows: "4", spellcheck: "false",
      "aria-label": "Text for the model to continue",
      placeholder: "Type here: the model predicts the next character" });
    ui.input.value = root.dataset.prompt || "";
    ui.status = el("p", { class: "charlm-status", role: "status", "aria-live": "polite" }, "Loading the model…");
    const controls = el("div", { class: "charlm-controls" });
    const tLabel = el("label", { class: "charlm-temperature" });
    tLabel.append(el("span", {}, "temperature "));
    ui.temperature = el("input", { type: "range", min: "0", max: "2", step: "0.05", value: root.dataset.temperature || "0.8",
      "aria-label": "Sampling temperature" });
    ui.tValue = el("output", {}, "");
    tLabel.append(ui.temperature, ui.tValue);
    const kLabel = el("label", { class: "charlm-topk" });
    kLabel.append(el("span", {}, "top-k "));
    ui.topK = el("input", { type: "number", min: "1", step: "1", value: root.dataset.topK || "10",
      "aria-label": "Sample among the k most likely characters" });
    kLabel.append(ui.topK);
    ui.next = el("button", { type: "button", class: "md-button" }, "Next character");
    ui.generate = el("button", { type: "button", class: "md-button md-button--primary" }, "Generate 60");
    ui.stop = el("button", { type: "button", class: "md-button", disabled: "" }, "Stop");
    controls.append(tLabel, kLabel, ui.next, ui.generate, ui.stop);
    ui.probs = el("ol", { class: "charlm-probs", "aria-label": "Most likely next characters" });
    ui.focusTitle = el("p", { class: "charlm-focus-title" }, "");
    ui.focus = el("div", { class: "charlm-focus", "aria-label": "Where the last character looks, in the chosen head" });
    ui.grid = el("div", { class: "charlm-grid" });
    const left = el("div", { class: "charlm-col" });
    left.append(el("p", { class: "charlm-heading" }, "Next character"), ui.probs);
    // the chosen head's map, large enough to read at any length: a cell's weight on hover or tap
    ui.zoomTitle = el("p", { class: "charlm-heading" }, "");
    ui.zoom = el("canvas", { class: "charlm-zoom", width: "1", height: "1",
      "aria-label": "The chosen head's attention map: point at a cell for its weight" });
    ui.zoomValue = el("output", { class: "charlm-zoom-value", "aria-live": "polite" },
      "Point at (or tap) a cell of the map for its weight.");
    // heads to switch off: each still attends, but adds nothing to its layer's output (lm's `ablate`)
    ui.switches = el("div", { class: "charlm-grid charlm-switches", role: "group",
      "aria-label": "Switch heads off" });
    ui.allOn = el("button", { type: "button", class: "md-button charlm-all-on" }, "All heads on");
    ui.loss = el("p", { class: "charlm-loss", role: "status", "aria-live": "polite" }, "");
    const right = el("div", { class: "charlm-col" });
    right.append(el("p", { class: "charlm-heading" }, "Attention: every layer × head (click one)"), ui.grid,
      ui.zoomTitle, ui.zoom, ui.zoomValue,
      el("p", { class: "charlm-heading" }, "Switch heads off: a head switched off still attends, but adds nothing"),
      ui.switches, ui.allOn, ui.loss);
    const panels = el("div", { class: "charlm-panels" });
    panels.append(left, right);
    root.append(ui.input, ui.status, controls, ui.focusTitle, ui.focus, panels);
    ui.temperature.addEventListener("input", () => { ui.tValue.textContent = Number(ui.temperature.value).toFixed(2); refresh(); });
    ui.tValue.textContent = Number(ui.temperature.value).toFixed(2);

    const state = { model: null, run: null, layer: Number(root.dataset.layer || 0), head: Number(root.dataset.head || 0),
      timer: null, generating: 0, window: 0, off: [], base: null };
    const walk = stepper(state, (layer, head) => {
      state.layer = layer; state.head = head; drawGrid(); drawFocus(); walk.draw();
    });
    controls.append(walk.toggle);
    ui.focus.after(walk.panel);

    // The temperature and top-k the bars and the sampling use. An empty top-k box means no top-k (every
    // character, as top_k=None in attention_ref.lm.generate); a value that is not a whole number >= 1
    // is not guessed at either: it also means every character, and `note` says so beside the box.
    function settings() {
      const t = Number(ui.temperature.value);
      const text = ui.topK.value.trim();
      const k = Number(text);
      const V = state.model ? state.model.V : Infinity;
      if (text === "") return { temperature: t, topK: V, note: "top-k is empty: sampling among all characters." };
      if (!Number.isInteger(k) || k < 1) {
        return { temperature: t, topK: V, invalid: true,
          note: `top-k must be a whole number of at least 1 (got “${text}”): sampling among all characters.` };
      }
      return { temperature: t, topK: k, note: "" };
    }

    // Run the model on the text (the characters that are in the vocabulary), from `windowStart`: a run
    // whose ids are a prefix of these lends its keys and values (`run` checks), so after a jump of the
    // window everything is computed again, and between jumps only the new characters are.
    function compute() {
      const m = state.model;
      const { ids, unknown } = m.encode(ui.input.value);
      state.window = windowStart(ids.length, m.context);
      const kept = ids.slice(state.window);
      root.dataset.windowStart = String(state.window);
      state.run = kept.length ? m.run(kept, state.run, null, state.off) : null;
      // with heads off, the same text with every head on, for comparison
      state.base = kept.length && state.off.length ? m.run(kept, state.base) : state.run;
      const notes = [];
      if (unknown.length) {
        const shown = unknown.slice(0, 5).map(([i, ch]) => `“${ch}” (at ${i})`).join(", ");
        notes.push(`${unknown.length} character${unknown.length > 1 ? "s are" : " is"} not in the model's ` +
          `vocabulary and left out: ${shown}${unknown.length > 5 ? " …" : ""}.`);
      }
      if (!kept.length) notes.push("Type some text above: the model predicts the character that comes next.");
      else if (state.window > 0) {
        notes.push(`The model reads the last ${kept.length} characters: it was trained on windows of ` +
          `${m.context}, and past ${m.context} its window jumps ahead ${Math.floor(m.context / 2)} characters at a time, ` +
          `so that what it computed for the characters it keeps stays valid.`);
      }
      const { note, invalid } = settings();
      if (note) notes.push(note);
      ui.status.textContent = notes.join(" ") || `${kept.length} characters read.`;
      ui.status.classList.toggle("charlm-warning", unknown.length > 0 || Boolean(invalid));
      ui.topK.setAttribute("aria-invalid", String(Boolean(invalid)));
      root.dataset.unknown = String(unknown.length);
      // nothing to continue from: nothing to predict, so neither button may act
      if (!state.timer) ui.next.disabled = ui.generate.disabled = !kept.length;
    }

    function drawProbs() {
      ui.probs.replaceChildren();
      if (!state.run) return;
      const m = state.model, { temperature, topK } = settings();
      const probs = nextProbabilities(state.run.logits, m.V, temperature, topK);
      const order = Array.from(probs.keys()).sort((a, b) => probs[b] - probs[a]).slice(0, 10);
      for (const i of order) {
        if (probs[i] <= 0) break;
        const li = el("li", {});
        li.append(el("code", { class: "charlm-char" }, showChar(m.chars[i])));
        const bar = el("span", { class: "charlm-bar" });
        bar.style.width = `${(100 * probs[i]).toFixed(1)}%`;
        const track = el("span", { class: "charlm-track" });
        track.append(bar);
        li.append(track, el("span", { class: "charlm-p" }, `${(100 * probs[i]).toFixed(1)}%`));
        ui.probs.append(li);
      }
    }

    // A layer x head grid in `box`, its axes labelled; `cell(layer, head)` makes each cell.
    function headGrid(box, cell) {
      const m = state.model;
      box.replaceChildren();
      box.style.gridTemplateColumns = `auto repeat(${m.H}, 1fr)`;
      box.append(el("span", {}, ""));
      for (let h = 0; h < m.H; h++) box.append(el("span", { class: "charlm-axis" }, `head ${h}`));
      for (let layer = 0; layer < m.layers; layer++) {
        box.append(el("span", { class: "charlm-axis" }, `layer ${layer}`));
        for (let h = 0; h < m.H; h++) box.append(cell(layer, h));
      }
    }

    function drawGrid() {
      const run = state.run;
      headGrid(ui.grid, (layer, h) => {
          const button = el("button", { type: "button", class: "charlm-map",
            "aria-label": `layer ${layer}, head ${h}`, "aria-pressed": String(layer === state.layer && h === state.head) });
          const canvas = el("canvas", { width: "1", height: "1" });
          button.append(canvas);
          button.addEventListener("click", () => {
            state.layer = layer; state.head = h; drawGrid(); drawFocus(); walk.schedule();
            // on a phone the shaded text sits above the maps, off screen: bring it into view
            const box = ui.focus.getBoundingClientRect();
            if (box.top < 0 || box.bottom > window.innerHeight) ui.focusTitle.scrollIntoView({ block: "start" });
          });
          if (!run) return button;
          const L = run.ids.length, W = run.weights[layer][h];
          canvas.width = L;
          canvas.height = L;
          const ctx = canvas.getContext("2d");
          for (let i = 0; i < L; i++) {
            for (let j = 0; j <= i; j++) {
              ctx.fillStyle = heatColor(W[i * L + j]);
              ctx.fillRect(j, i, 1, 1);
            }
          }
          return button;
      });
    }

    // The on/off switch of every head, and the loss on the text with the heads as they are.
    function drawSwitches() {
      const m = state.model;
      headGrid(ui.switches, (layer, h) => {
          const isOff = state.off.some(([a, b]) => a === layer && b === h);
          const button = el("button", { type: "button", class: "charlm-switch", "aria-pressed": String(isOff),
            "aria-label": `switch head ${h} of layer ${layer} off` }, isOff ? "off" : "on");
          button.addEventListener("click", () => {
            state.off = isOff ? state.off.filter(([a, b]) => a !== layer || b !== h) : [...state.off, [layer, h]];
            refresh();
            ui.switches.querySelector(`[aria-label="switch head ${h} of layer ${layer} off"]`)?.focus();
          });
          return button;
      });
      ui.allOn.disabled = !state.off.length;
      const run = state.run;
      if (!run || run.ids.length < 2) {
        ui.loss.textContent = "Type two characters or more to see the loss on your text.";
        delete root.dataset.loss;
        return;
      }
      const loss = m.loss(run), base = m.loss(state.base);
      root.dataset.loss = loss.toFixed(6);
      root.dataset.off = JSON.stringify(state.off);
      ui.loss.textContent = `Loss on your text: ${loss.toFixed(3)} nats per character` + (state.off.length
        ? ` with ${state.off.length} head${state.off.length > 1 ? "s" : ""} off (every head on: ${base.toFixed(3)})`
        : ` (every head on; ln ${m.V} = ${Math.log(m.V).toFixed(2)} is a uniform guess)`);
    }
    ui.allOn.addEventListener("click", () => { state.off = []; refresh(); });

    function drawZoom() {
      const run = state.run;
      ui.zoom.hidden = !run;
      if (!run) { ui.zoomTitle.textContent = ""; return; }
      const L = run.ids.length, W = run.weights[state.layer][state.head];
      ui.zoomTitle.textContent = `Layer ${state.layer}, head ${state.head}, larger: row = the character ` +
        "reading (query), column = the character read (key)";
      ui.zoom.width = L;
      ui.zoom.height = L;
      const ctx = ui.zoom.getContext("2d");
      for (let i = 0; i < L; i++) {
        for (let j = 0; j <= i; j++) {
          ctx.fillStyle = heatColor(W[i * L + j]);
          ctx.fillRect(j, i, 1, 1);
        }
      }
    }

    // The cell under a pointer (or a tap) on the large map, and its weight in words.
    function pointAt(event) {
      const run = state.run;
      if (!run) return;
      const m = state.model, L = run.ids.length, box = ui.zoom.getBoundingClientRect();
      const i = Math.min(L - 1, Math.floor(((event.clientY - box.top) / box.height) * L));
      const j = Math.min(L - 1, Math.floor(((event.clientX - box.left) / box.width) * L));
      if (i < 0 || j < 0) return;
      const w = j <= i ? run.weights[state.layer][state.head][i * L + j] : 0;
      ui.zoomValue.textContent = `“${showChar(m.chars[run.ids[i]])}” (position ${i}) → ` +
        `“${showChar(m.chars[run.ids[j]])}” (position ${j}): ` +
        (j <= i ? `${(100 * w).toFixed(1)}%` : "0% (a later character: causal)");
      ui.zoomValue.dataset.cell = `${i},${j}`;
      ui.zoomValue.dataset.weight = w.toFixed(4);
    }
    ui.zoom.addEventListener("pointermove", pointAt);
    ui.zoom.addEventListener("pointerdown", pointAt);

    function drawFocus() {
      ui.focus.replaceChildren();
      drawZoom();
      const m = state.model, run = state.run;
      if (!run) { ui.focusTitle.textContent = ""; return; }
      const L = run.ids.length, W = run.weights[state.layer][state.head];
      ui.focusTitle.textContent = `Layer ${state.layer}, head ${state.head}: how much the last character ` +
        `(the one predicting the next) attends to each character it reads`;
      for (let j = 0; j < L; j++) {
        const w = W[(L - 1) * L + j];
        const span = el("span", { class: "charlm-token", title: `${(100 * w).toFixed(1)}%` }, showChar(m.chars[run.ids[j]]));
        span.style.backgroundColor = heatColor(w);
        span.dataset.weight = w.toFixed(4);
        ui.focus.append(span);
        if (m.chars[run.ids[j]] === "\n") ui.focus.append(el("br"));
      }
    }

    function refresh() {
      if (!state.model) return;
      compute();
      drawProbs();
      drawSwitches();
      drawGrid();
      drawFocus();
      walk.schedule();
    }

    // One step of generation: sample from what the bars show and append it to the text.
    function step() {
      if (!state.model || !state.run) return false;
      const m = state.model, { temperature, topK } = settings();
      const probs = nextProbabilities(state.run.logits, m.V, temperature, topK);
      let r = Math.random(), pick = 0;
      for (let i = 0; i < m.V; i++) { r -= probs[i]; pick = i; if (r < 0 && probs[i] > 0) break; }
      if (temperature === 0) pick = probs.indexOf(1);
      ui.input.value += m.chars[pick];
      ui.input.scrollTop = ui.input.scrollHeight; // the box follows the text it grows
      refresh();
      return true;
    }

    function stop() {
      clearInterval(state.timer);
      state.timer = null;
      ui.stop.disabled = true;
      ui.generate.disabled = ui.next.disabled = !state.run;
      root.dataset.generating = "0";
    }

    ui.next.addEventListener("click", () => step());
    ui.generate.addEventListener("click", () => {
      if (state.timer) return;
      state.generating = 60;
      ui.stop.disabled = false;
      ui.generate.disabled = true;
      ui.next.disabled = true;
      root.dataset.generating = "1";
      state.timer = setInterval(() => {
        if (state.generating-- <= 0 || !step()) stop();
      }, 60);
    });
    ui.stop.addEventListener("click", stop);
    let pending = null;
    ui.input.addEventListener("input", () => {
      clearTimeout(pending);
      pending = setTimeout(refresh, 80);
    });
    ui.topK.addEventListener("input", refresh);

    load(root.dataset.src).then((model) => {
      state.model = model;
      ui.topK.max = String(model.V);
      refresh();
      root.dataset.loaded = "1";
    }).catch((error) => {
      ui.status.textContent = `The model could not be loaded (${error.message}).`;
      ui.status.classList.add("charlm-warning");
    });
  }

  window.attentionRefCharLM = { load, nextProbabilities, CharModel, windowStart };
  window.attentionRefWidgets.onEveryPage(".charlm[data-src]", setup); // widgets.js
})();
