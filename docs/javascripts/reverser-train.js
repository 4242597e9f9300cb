// Train the digit reverser of tutorial page 6b in the browser.
//
// The page holds a <div class="reverser-train">; this script fills it with a trainer of the page's
// `Reverser`: digit embedding (V = 10) plus a learned vector per position (L = 8, optional), a
// pre-norm Transformer block (LayerNorm, multi-head self-attention of width d = 32 with H heads of
// D = d / H, residual; LayerNorm, MLP 32 -> 128 -> 32 with ReLU, residual), a last LayerNorm and a
// linear unembedding to 10 scores. Attention is attention_ref.MultiHeadAttention's: q, k, v and
// out projections with biases, scores scaled by 1 / sqrt(D), weights averaged over heads for the
// maps. Everything is in Float64Array, forward and backward by hand (every parameter), the loss
// is the cross-entropy averaged over the B x L predictions, and the optimiser is torch's Adam
// (betas 0.9 and 0.999, eps 1e-8, no weight decay, bias correction).
//
// Random numbers come from mulberry32 (a 32-bit counter, hashed; Tommy Ettinger's public-domain
// generator), so a run is the same on every browser for the same seed:
// - the initial weights from mulberry32(seed), drawn parameter by parameter in torch's order
//   (`names`): an embedding from N(0, 1) (Box-Muller, one normal from two uniforms u1, u2:
//   sqrt(-2 ln(1 - u1)) cos(2 pi u2)), a Linear's weight row by row and then its bias from
//   U(-k, k) with k = 1 / sqrt(fan_in) ((2u - 1) k), LayerNorm weights 1 and biases 0 (no draw).
//   These are torch's default distributions, not torch's numbers;
// - the batches from mulberry32(seed ^ 0x9e3779b9): 64 sequences of 8 digits, each digit
//   floor(10 u), drawn sequence by sequence; the target is the sequence reversed.
// tests/site/test_reverser_train.py holds the gradients to torch's and repeats a seeded run with
// torch's Adam, with the same generator written in Python.
//
// Shapes as in the package: B batch, L positions (queries), S keys (= L here), d width, H heads.
(function () {
  "use strict";

  const V = 10, L = 8, d = 32, F = 128, EPS = 1e-5, BATCH = 64;
  const PROBE = [3, 1, 4, 1, 5, 9, 2, 6];
  const HEADS = [1, 2, 4];
  const RATES = [3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1];
  const DEFAULTS = { lr: 3e-3, heads: 1, positions: true, steps: 150, seed: 0 };

  // ---- random numbers ------------------------------------------------------------------------

  // mulberry32: uniform numbers in [0, 1), multiples of 2^-32.
  function mulberry32(seed) {
    let a = seed >>> 0;
    return function () {
      a = (a + 0x6d2b79f5) >>> 0;
      let t = a;
      t = Math.imul(t ^ (t >>> 15), t | 1);
      t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
      return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    };
  }

  function normal(rand) {
    const u1 = rand(), u2 = rand();
    return Math.sqrt(-2 * Math.log(1 - u1)) * Math.cos(2 * Math.PI * u2);
  }

  // `size` sequences of L digits and their reversals, each a flat Int32Array (size * L).
  function reversalBatch(rand, size) {
    const x = new Int32Array(size * L), y = new Int32Array(size * L);
    for (let b = 0; b < size; b++) {
      for (let l = 0; l < L; l++) x[b * L + l] = Math.floor(rand() * V);
      for (let l = 0; l < L; l++) y[b * L + l] = x[b * L + L - 1 - l];
    }
    return { x, y };
  }

  // ---- the model -----------------------------------------------------------------------------

  // The parameters in torch's order (Reverser.parameters()), with their shapes.
  function shapes(positions) {
    const linear = (name, out, inp) => [[`${name}.weight`, [out, inp]], [`${name}.bias`, [out]]];
    const norm = (name) => [[`${name}.weight`, [d]], [`${name}.bias`, [d]]];
    return [
      ["embed.weight", [V, d]], ...(positions ? [["pos.weight", [L, d]]] : []),
      ...norm("norm1"),
      ...linear("attn.q_proj", d, d), ...linear("attn.k_proj", d, d), ...linear("attn.v_proj", d, d),
      ...linear("attn.out_proj", d, d),
      ...norm("norm2"), ...linear("mlp.0", F, d), ...linear("mlp.2", d, F), ...norm("norm3"),
      ...linear("unembed", V, d),
    ];
  }

  const size = (shape) => shape.reduce((a, b) => a * b, 1);

  // y = x W^T + b for x (N, nin), W (nout, nin) as torch.nn.Linear stores it -> (N, nout)
  function linear(x, N, nin, W, b, nout) {
    const out = new Float64Array(N * nout);
    for (let n = 0; n < N; n++) {
      const row = n * nin;
      for (let o = 0; o < nout; o++) {
        let s = b[o];
        const wo = o * nin;
        for (let i = 0; i < nin; i++) s += x[row + i] * W[wo + i];
        out[n * nout + o] = s;
      }
    }
    return out;
  }

  // The backward of `linear`: adds to dW and db, returns dx (N, nin).
  function linearBack(dout, x, N, nin, W, nout, dW, db) {
    const dx = new Float64Array(N * nin);
    for (let n = 0; n < N; n++) {
      const row = n * nin;
      for (let o = 0; o < nout; o++) {
        const g = dout[n * nout + o];
        if (g === 0) continue;
        db[o] += g;
        const wo = o * nin;
        for (let i = 0; i < nin; i++) {
          dW[wo + i] += g * x[row + i];
          dx[row + i] += g * W[wo + i];
        }
      }
    }
    return dx;
  }

  // LayerNorm over the last axis of x (N, d); returns y and what the backward needs.
  function layerNorm(x, N, g, b) {
    const y = new Float64Array(N * d), xhat = new Float64Array(N * d), rstd = new Float64Array(N);
    for (let n = 0; n < N; n++) {
      const row = n * d;
      let mean = 0, variance = 0;
      for (let i = 0; i < d; i++) mean += x[row + i];
      mean /= d;
      for (let i = 0; i < d; i++) variance += (x[row + i] - mean) ** 2;
      const r = 1 / Math.sqrt(variance / d + EPS);
      rstd[n] = r;
      for (let i = 0; i < d; i++) {
        const h = (x[row + i] - mean) * r;
        xhat[row + i] = h;
        y[row + i] = h * g[i] + b[i];
      }
    }
    return { y, xhat, rstd };
  }

  // dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), with dxhat = dy g; adds to dg, db.
  function layerNormBack(dy, cache, N, g, dg, db) {
    const { xhat, rstd } = cache;
    const dx = new Float64Array(N * d), dh = new Float64Array(d);
    for (let n = 0; n < N; n++) {
      const row = n * d;
      let m1 = 0, m2 = 0;
      for (let i = 0; i < d; i++) {
        const gy = dy[row + i];
        dg[i] += gy * xhat[row + i];
        db[i] += gy;
        dh[i] = gy * g[i];
        m1 += dh[i];
        m2 += dh[i] * xhat[row + i];
      }
      m1 /= d;
      m2 /= d;
      for (let i = 0; i < d; i++) dx[row + i] = rstd[n] * (dh[i] - m1 - xhat[row + i] * m2);
    }
    return dx;
  }

  class Model {
    // `config`: {heads, positions}; `params`: {name: Float64Array} in the layout of `shapes`.
    constructor(config, params) {
      const heads = Number(config.heads);
      if (!HEADS.includes(heads)) throw new RangeError(`heads must be one of ${HEADS.join(", ")}, got ${config.heads}`);
      this.H = heads;
      this.D = d / heads;
      this.positions = Boolean(config.positions);
      this.shapes = shapes(this.positions);
      this.names = this.shapes.map(([name]) => name);
      this.p = {};
      for (const [name, shape] of this.shapes) {
        const given = params[name];
        if (!given) throw new Error(`missing parameter ${name}`);
        const flat = Float64Array.from(given.flat ? given.flat(Infinity) : given);
        if (flat.length !== size(shape)) {
          throw new RangeError(`${name}: expected ${size(shape)} numbers (${shape.join(" x ")}), got ${flat.length}`);
        }
        this.p[name] = flat;
      }
    }

    // New weights drawn from mulberry32(seed), as the module header says.
    static init(config, seed) {
      const rand = mulberry32(seed);
      const params = {};
      let fanIn = 0;
      for (const [name, shape] of shapes(Boolean(config.positions))) {
        const w = new Float64Array(size(shape));
        if (name === "embed.weight" || name === "pos.weight") {
          for (let i = 0; i < w.length; i++) w[i] = normal(rand);
        } else if (name.startsWith("norm")) {
          if (name.endsWith(".weight")) w.fill(1);
        } else {
          // a Linear's fan-in: its weight's second size (its bias comes right after it)
          if (name.endsWith(".weight")) fanIn = shape[1];
          const k = 1 / Math.sqrt(fanIn);
          for (let i = 0; i < w.length; i++) w[i] = (2 * rand() - 1) * k;
        }
        params[name] = w;
      }
      return new Model(config, params);
    }

    // The forward pass of `tokens` (B sequences of n <= L digits, flat). Returns the logits
    // (B*n, V), the attention weights per head (B, H, n, n) and what the backward needs.
    forward(tokens, B, n) {
      const p = this.p, H = this.H, D = this.D, N = B * n;
      if (n < 1 || n > L) throw new RangeError(`sequences of 1 to ${L} digits, got ${n}`);
      // embedding plus position: (N, d)
      const x0 = new Float64Array(N * d);
      for (let r = 0; r < N; r++) {
        const t = tokens[r], l = r % n;
        for (let i = 0; i < d; i++) x0[r * d + i] = p["embed.weight"][t * d + i] + (this.positions ? p["pos.weight"][l * d + i] : 0);
      }
      const n1 = layerNorm(x0, N, p["norm1.weight"], p["norm1.bias"]);
      const q = linear(n1.y, N, d, p["attn.q_proj.weight"], p["attn.q_proj.bias"], d);
      const k = linear(n1.y, N, d, p["attn.k_proj.weight"], p["attn.k_proj.bias"], d);
      const v = linear(n1.y, N, d, p["attn.v_proj.weight"], p["attn.v_proj.bias"], d);
      // weights A (B, H, n, n): softmax over keys of q.k / sqrt(D); heads joined o (N, d)
      const A = new Float64Array(B * H * n * n), o = new Float64Array(N * d);
      const scale = 1 / Math.sqrt(D), s = new Float64Array(n);
      for (let b = 0; b < B; b++) {
        for (let h = 0; h < H; h++) {
          const off = h * D;
          for (let i = 0; i < n; i++) {
            const qi = (b * n + i) * d + off;
            let max = -Infinity;
            for (let j = 0; j < n; j++) {
              const kj = (b * n + j) * d + off;
              let dot = 0;
              for (let e = 0; e < D; e++) dot += q[qi + e] * k[kj + e];
              s[j] = dot * scale;
              if (s[j] > max) max = s[j];
            }
            let sum = 0;
            for (let j = 0; j < n; j++) { s[j] = Math.exp(s[j] - max); sum += s[j]; }
            const a = ((b * H + h) * n + i) * n;
            for (let j = 0; j < n; j++) {
              const w = s[j] / sum;
              A[a + j] = w;
              const vj = (b * n + j) * d + off;
              for (let e = 0; e < D; e++) o[qi + e] += w * v[vj + e];
            }
          }
        }
      }
      const att = linear(o, N, d, p["attn.out_proj.weight"], p["attn.out_proj.bias"], d);
      const x1 = new Float64Array(N * d);
      for (let i = 0; i < N * d; i++) x1[i] = x0[i] + att[i];
      const n2 = layerNorm(x1, N, p["norm2.weight"], p["norm2.bias"]);
      const z = linear(n2.y, N, d, p["mlp.0.weight"], p["mlp.0.bias"], F);
      const relu = z.map((x) => (x > 0 ? x : 0));
      const m = linear(relu, N, F, p["mlp.2.weight"], p["mlp.2.bias"], d);
      const x2 = new Float64Array(N * d);
      for (let i = 0; i < N * d; i++) x2[i] = x1[i] + m[i];
      const n3 = layerNorm(x2, N, p["norm3.weight"], p["norm3.bias"]);
      const logits = linear(n3.y, N, d, p["unembed.weight"], p["unembed.bias"], V);
      return { B, n, N, tokens, logits, A, cache: { n1, q, k, v, o, n2, z, relu, n3 } };
    }

    // The (n, n) map of sequence `b`, averaged over heads, as rows of weights.
    map(run, b = 0) {
      const { n } = run, H = this.H, out = [];
      for (let i = 0; i < n; i++) {
        const row = new Array(n).fill(0);
        for (let h = 0; h < H; h++) for (let j = 0; j < n; j++) row[j] += run.A[((b * H + h) * n + i) * n + j] / H;
        out.push(row);
      }
      return out;
    }

    // The mean cross-entropy of the predictions for targets y (B*n, flat), and the gradient of
    // every parameter: {loss, grads: {name: Float64Array}}.
    lossAndGrads(x, y, B, n = L) {
      const run = this.forward(x, B, n);
      const { N, logits, A } = run, { n1, q, k, v, o, n2, z, relu, n3 } = run.cache;
      const p = this.p, H = this.H, D = this.D;
      const g = {};
      for (const name of this.names) g[name] = new Float64Array(p[name].length);
      // cross-entropy: loss = mean -log softmax(logits)[y]; dlogits = (softmax - onehot) / N
      let loss = 0;
      const dlogits = new Float64Array(N * V);
      for (let r = 0; r < N; r++) {
        let max = -Infinity;
        for (let c = 0; c < V; c++) max = Math.max(max, logits[r * V + c]);
        let sum = 0;
        for (let c = 0; c < V; c++) sum += Math.exp(logits[r * V + c] - max);
        loss += Math.log(sum) + max - logits[r * V + y[r]];
        for (let c = 0; c < V; c++) dlogits[r * V + c] = Math.exp(logits[r * V + c] - max) / sum / N;
        dlogits[r * V + y[r]] -= 1 / N;
      }
      loss /= N;
      const dn3 = linearBack(dlogits, n3.y, N, d, p["unembed.weight"], V, g["unembed.weight"], g["unembed.bias"]);
      const dx2 = layerNormBack(dn3, n3, N, p["norm3.weight"], g["norm3.weight"], g["norm3.bias"]);
      // x2 = x1 + mlp(norm2(x1)): the residual passes dx2 on, the MLP adds its part
      const drelu = linearBack(dx2, relu, N, F, p["mlp.2.weight"], d, g["mlp.2.weight"], g["mlp.2.bias"]);
      for (let i = 0; i < drelu.length; i++) if (z[i] <= 0) drelu[i] = 0;
      const dn2 = linearBack(drelu, n2.y, N, d, p["mlp.0.weight"], F, g["mlp.0.weight"], g["mlp.0.bias"]);
      const dx1 = layerNormBack(dn2, n2, N, p["norm2.weight"], g["norm2.weight"], g["norm2.bias"]);
      for (let i = 0; i < dx1.length; i++) dx1[i] += dx2[i];
      // x1 = x0 + attention(norm1(x0))
      const dO = linearBack(dx1, o, N, d, p["attn.out_proj.weight"], d, g["attn.out_proj.weight"], g["attn.out_proj.bias"]);
      const dq = new Float64Array(N * d), dk = new Float64Array(N * d), dv = new Float64Array(N * d);
      const scale = 1 / Math.sqrt(D), dA = new Float64Array(n);
      for (let b = 0; b < B; b++) {
        for (let h = 0; h < H; h++) {
          const off = h * D;
          for (let i = 0; i < n; i++) {
            const qi = (b * n + i) * d + off, a = ((b * H + h) * n + i) * n;
            // dA_j = dO_i . v_j; dv_j += A_ij dO_i; dS_ij = A_ij (dA_j - sum_j' A_ij' dA_j')
            let dot = 0;
            for (let j = 0; j < n; j++) {
              const vj = (b * n + j) * d + off;
              let s = 0;
              for (let e = 0; e < D; e++) {
                s += dO[qi + e] * v[vj + e];
                dv[vj + e] += A[a + j] * dO[qi + e];
              }
              dA[j] = s;
              dot += A[a + j] * s;
            }
            for (let j = 0; j < n; j++) {
              const dS = A[a + j] * (dA[j] - dot) * scale;
              const kj = (b * n + j) * d + off;
              for (let e = 0; e < D; e++) {
                dq[qi + e] += dS * k[kj + e];
                dk[kj + e] += dS * q[qi + e];
              }
            }
          }
        }
      }
      const dn1 = linearBack(dq, n1.y, N, d, p["attn.q_proj.weight"], d, g["attn.q_proj.weight"], g["attn.q_proj.bias"]);
      const dn1k = linearBack(dk, n1.y, N, d, p["attn.k_proj.weight"], d, g["attn.k_proj.weight"], g["attn.k_proj.bias"]);
      const dn1v = linearBack(dv, n1.y, N, d, p["attn.v_proj.weight"], d, g["attn.v_proj.weight"], g["attn.v_proj.bias"]);
      for (let i = 0; i < dn1.length; i++) dn1[i] += dn1k[i] + dn1v[i];
      const dx0 = layerNormBack(dn1, n1, N, p["norm1.weight"], g["norm1.weight"], g["norm1.bias"]);
      for (let i = 0; i < dx0.length; i++) dx0[i] += dx1[i];
      // x0 = embed[token] + pos[l]
      for (let r = 0; r < N; r++) {
        const t = x[r], l = r % n;
        for (let i = 0; i < d; i++) {
          g["embed.weight"][t * d + i] += dx0[r * d + i];
          if (this.positions) g["pos.weight"][l * d + i] += dx0[r * d + i];
        }
      }
      return { loss, grads: g, run };
    }
  }

  // torch.optim.Adam with its defaults: betas (0.9, 0.999), eps 1e-8, no weight decay.
  class Adam {
    constructor(model) {
      this.model = model;
      this.t = 0;
      this.m = {};
      this.v = {};
      for (const name of model.names) {
        this.m[name] = new Float64Array(model.p[name].length);
        this.v[name] = new Float64Array(model.p[name].length);
      }
    }

    step(grads, lr) {
      const b1 = 0.9, b2 = 0.999, eps = 1e-8;
      this.t += 1;
      const c1 = 1 - b1 ** this.t, c2 = Math.sqrt(1 - b2 ** this.t);
      for (const name of this.model.names) {
        const p = this.model.p[name], g = grads[name], m = this.m[name], v = this.v[name];
        for (let i = 0; i < p.length; i++) {
          m[i] += (1 - b1) * (g[i] - m[i]);
          v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
          p[i] -= (lr / c1) * m[i] / (Math.sqrt(v[i]) / c2 + eps);
        }
      }
    }
  }

  // A model, its optimiser and its stream of batches: `step(lr)` trains on one batch.
  class Trainer {
    constructor({ seed = DEFAULTS.seed, heads = DEFAULTS.heads, positions = DEFAULTS.positions } = {}) {
      this.config = { seed: Number(seed) >>> 0, heads: Number(heads), positions: Boolean(positions) };
      this.model = Model.init(this.config, this.config.seed);
      this.adam = new Adam(this.model);
      this.batches = mulberry32((this.config.seed ^ 0x9e3779b9) >>> 0);
      this.losses = [];
    }

    step(lr) {
      const { x, y } = reversalBatch(this.batches, BATCH);
      const { loss, grads } = this.model.lossAndGrads(x, y, BATCH);
      this.adam.step(grads, lr);
      this.losses.push(loss);
      return loss;
    }

    // The model's run on `digits` (1 to L of them): its output digits and its map.
    read(digits) {
      const run = this.model.forward(Int32Array.from(digits), 1, digits.length);
      const out = [];
      for (let i = 0; i < digits.length; i++) {
        let best = 0;
        for (let c = 1; c < V; c++) if (run.logits[i * V + c] > run.logits[i * V + best]) best = c;
        out.push(best);
      }
      return { output: out, map: this.model.map(run) };
    }
  }

  // ---- for the tests: plain arrays in, plain arrays out ---------------------------------------

  const plain = (params) => Object.fromEntries(Object.entries(params).map(([k, w]) => [k, Array.from(w)]));

  // The loss and every gradient for `weights` ({name: numbers, flat or nested}) on `batch`
  // ({x, y}: B lists of n digits each), with `config` {heads, positions}.
  function lossAndGrads(weights, batch, config) {
    const model = new Model(config, weights);
    const B = batch.x.length, n = batch.x[0].length;
    const { loss, grads } = model.lossAndGrads(Int32Array.from(batch.x.flat()), Int32Array.from(batch.y.flat()), B, n);
    return { loss, grads: plain(grads) };
  }

  // A seeded run of `steps` steps: its initial weights, first batch and every loss.
  function run({ seed = 0, heads = 1, positions = true, lr = DEFAULTS.lr, steps = 5 } = {}) {
    const trainer = new Trainer({ seed, heads, positions });
    const initial = plain(trainer.model.p);
    const first = reversalBatch(mulberry32((Number(seed) ^ 0x9e3779b9) >>> 0), BATCH);
    for (let s = 0; s < steps; s++) trainer.step(lr);
    return { initial, firstBatch: Array.from(first.x), losses: trainer.losses.slice() };
  }

  // ---- the widget ----------------------------------------------------------------------------

  const SVG = "http://www.w3.org/2000/svg";

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // viridis, the ramp of the page's other maps (attention_ref.viz._RAMP), interpolated in RGB
  const RAMP = ["#440154", "#48186a", "#472d7b", "#424086", "#3b528b", "#33638d", "#2c728e", "#26828e", "#21918c",
    "#1fa088", "#28ae80", "#3fbc73", "#5ec962", "#84d44b", "#addc30", "#d8e219", "#fde725"]
    .map((c) => [1, 3, 5].map((k) => parseInt(c.slice(k, k + 2), 16)));

  function colour(weight) {
    const t = Math.min(Math.max(weight, 0), 1) * (RAMP.length - 1);
    const i = Math.min(Math.floor(t), RAMP.length - 2), f = t - i;
    return "#" + RAMP[i].map((a, k) => Math.floor(a + (RAMP[i + 1][k] - a) * f + 0.5).toString(16).padStart(2, "0")).join("");
  }

  // An 8 x 8 (at most) map: rows are queries, columns keys, both labelled by digit.
  // Returns {node, draw(map, digits)}.
  function mapFigure(name, idBase) {
    const cell = 22, left = 44, top = 18, size = L * cell;
    const width = left + size + 8, height = top + size + 60;
    const root = svg("svg", { class: "revtrain-map", viewBox: `0 0 ${width} ${height}`, role: "img",
      "aria-label": name, "font-size": "12", fill: "currentColor" });
    const grad = svg("linearGradient", { id: `${idBase}-ramp` });
    RAMP.forEach((c, k) => grad.append(svg("stop", { offset: String(k / (RAMP.length - 1)), "stop-color": colour(k / (RAMP.length - 1)) })));
    const defs = svg("defs");
    defs.append(grad);
    root.append(defs, svg("text", { x: String(left - 6), y: String(top - 6), "text-anchor": "end", class: "revtrain-axis" }, "query"));
    const cells = svg("g"), rows = svg("g"), cols = svg("g");
    root.append(cells, rows, cols,
      svg("text", { x: String(left + size / 2), y: String(top + size + 32), "text-anchor": "middle", class: "revtrain-axis" }, "key"),
      svg("rect", { x: String(left), y: String(top + size + 40), width: String(size), height: "8", fill: `url(#${idBase}-ramp)` }),
      svg("text", { x: String(left), y: String(top + size + 58) }, "0"),
      svg("text", { x: String(left + size / 2), y: String(top + size + 58), "text-anchor": "middle" }, "weight"),
      svg("text", { x: String(left + size), y: String(top + size + 58), "text-anchor": "end" }, "1"));

    function draw(map, digits) {
      // fewer digits, larger cells: the grid keeps its size
      const n = digits.length, c = size / Math.max(n, 1);
      cells.replaceChildren();
      rows.replaceChildren();
      cols.replaceChildren();
      for (let i = 0; i < n; i++) {
        rows.append(svg("text", { x: String(left - 6), y: String(top + (i + 0.5) * c + 4), "text-anchor": "end" }, `${i}·${digits[i]}`));
        cols.append(svg("text", { x: String(left + (i + 0.5) * c), y: String(top + size + 15), "text-anchor": "middle" }, String(digits[i])));
        for (let j = 0; j < n; j++) {
          const w = map[i][j];
          const rect = svg("rect", { x: String(left + j * c), y: String(top + i * c), width: String(c), height: String(c),
            fill: colour(w), "data-weight": w.toFixed(4), class: "revtrain-cell" });
          rect.append(svg("title", {}, `query ${i} (${digits[i]}) → key ${j} (${digits[j]}): ${w.toFixed(3)}`));
          cells.append(rect);
        }
      }
    }
    return { node: root, draw };
  }

  // The loss curve, log scale: {node, draw(losses, total)}.
  function lossFigure() {
    const W = 340, Hh = 190, left = 42, right = 10, top = 10, bottom = 34;
    const root = svg("svg", { class: "revtrain-loss", viewBox: `0 0 ${W} ${Hh}`, role: "img",
      "aria-label": "The loss at each step (log scale)", "font-size": "12", fill: "currentColor" });
    const axes = svg("g"), guide = svg("g"), line = svg("polyline", { class: "revtrain-curve", fill: "none", "stroke-width": "1.6" });
    root.append(axes, guide, line);

    function draw(losses, total) {
      const low = Math.min(0.01, ...losses.map((x) => 10 ** Math.floor(Math.log10(Math.max(x, 1e-6)))));
      const high = 4;
      const steps = Math.max(total, losses.length, 1);
      const X = (s) => left + (s / steps) * (W - left - right);
      const Y = (v) => top + (Math.log(high) - Math.log(Math.max(v, low))) / (Math.log(high) - Math.log(low)) * (Hh - top - bottom);
      axes.replaceChildren();
      guide.replaceChildren();
      for (let e = Math.round(Math.log10(low)); e <= 0; e++) {
        const y = Y(10 ** e);
        axes.append(svg("line", { x1: String(left), x2: String(W - right), y1: String(y), y2: String(y), class: "revtrain-grid" }),
          svg("text", { x: String(left - 4), y: String(y + 4), "text-anchor": "end" }, e >= -2 ? String(10 ** e) : `1e${e}`));
      }
      const tick = steps <= 10 ? 1 : 10 ** Math.floor(Math.log10(steps / 2)) * (steps / 10 ** Math.floor(Math.log10(steps / 2)) >= 10 ? 5 : 1);
      for (let s = 0; s <= steps; s += tick) {
        if (X(s) > W - right - 14 && s !== steps && s !== 0) continue;
        axes.append(svg("text", { x: String(X(s)), y: String(Hh - bottom + 15), "text-anchor": "middle" }, String(s)));
      }
      axes.append(svg("line", { x1: String(left), x2: String(W - right), y1: String(Hh - bottom), y2: String(Hh - bottom), class: "revtrain-axis-line" }),
        svg("line", { x1: String(left), x2: String(left), y1: String(top), y2: String(Hh - bottom), class: "revtrain-axis-line" }),
        svg("text", { x: String(left + (W - left - right) / 2), y: String(Hh - 4), "text-anchor": "middle" }, "step"));
      // a uniform guess over the 10 digits: ln 10
      const yg = Y(Math.log(V));
      guide.append(svg("line", { x1: String(left), x2: String(W - right), y1: String(yg), y2: String(yg), class: "revtrain-guess" }),
        svg("text", { x: String(W - right - 2), y: String(yg - 4), "text-anchor": "end" }, "uniform guess, ln 10"));
      line.setAttribute("points", losses.map((v, s) => `${X(s + 1).toFixed(1)},${Y(v).toFixed(1)}`).join(" "));
    }
    return { node: root, draw };
  }

  let widgets = 0;

  function setup(root) {
    if (root.dataset.ready) return;
    root.dataset.ready = "1";
    const id = `revtrain-${widgets++}`;
    root.querySelectorAll(".revtrain-fallback").forEach((n) => n.remove());
    const ui = {};
    const settings = el("div", { class: "revtrain-settings" });
    const label = (text, control) => {
      const l = el("label", {});
      l.append(el("span", {}, text), control);
      return l;
    };
    ui.lr = el("select", { "aria-label": "Learning rate" });
    for (const r of RATES) ui.lr.append(el("option", Object.assign({ value: String(r) }, r === DEFAULTS.lr ? { selected: "" } : {}), String(r)));
    ui.heads = el("select", { "aria-label": "Heads" });
    for (const h of HEADS) ui.heads.append(el("option", Object.assign({ value: String(h) }, h === DEFAULTS.heads ? { selected: "" } : {}), String(h)));
    ui.positions = el("input", { type: "checkbox", "aria-label": "Learned positions" });
    ui.positions.checked = DEFAULTS.positions;
    ui.steps = el("input", { type: "number", min: "1", max: "5000", step: "1", value: String(DEFAULTS.steps), "aria-label": "Steps" });
    ui.seed = el("input", { type: "number", min: "0", step: "1", value: String(DEFAULTS.seed), "aria-label": "Seed" });
    const pos = el("label", { class: "revtrain-check" });
    pos.append(ui.positions, el("span", {}, "positions"));
    settings.append(label("learning rate", ui.lr), label("heads", ui.heads), pos, label("steps", ui.steps), label("seed", ui.seed));
    const buttons = el("div", { class: "revtrain-buttons" });
    ui.train = el("button", { type: "button", class: "md-button md-button--primary" }, "Train");
    ui.stop = el("button", { type: "button", class: "md-button", disabled: "" }, "Stop");
    ui.reset = el("button", { type: "button", class: "md-button" }, "Reset");
    ui.progress = el("progress", { max: "150", value: "0", "aria-label": "Training progress" });
    ui.count = el("span", { class: "revtrain-count" }, "");
    const meter = el("span", { class: "revtrain-meter" });
    meter.append(ui.progress, ui.count);
    buttons.append(ui.train, ui.stop, ui.reset, meter);
    ui.loss = el("p", { class: "revtrain-lossline" }, "");
    ui.status = el("p", { class: "revtrain-status", role: "status", "aria-live": "polite" }, "");
    const curve = lossFigure(), probe = mapFigure("The probe's attention map, averaged over heads", `${id}-probe`);
    const panels = el("div", { class: "revtrain-panels" });
    const fig = (title, node, extra) => {
      const f = el("div", { class: `revtrain-panel ${extra || ""}`.trim() });
      f.append(el("p", { class: "revtrain-heading" }, title), node);
      return f;
    };
    panels.append(fig("Loss", curve.node, "revtrain-wide"), fig("Probe 3 1 4 1 5 9 2 6: attention", probe.node));
    // the reader's own digits
    const yours = el("div", { class: "revtrain-yours" });
    ui.input = el("input", { type: "text", inputmode: "numeric", maxlength: "8", value: "12345678", spellcheck: "false",
      autocomplete: "off", "aria-label": "Up to 8 digits for the model to reverse", class: "revtrain-input" });
    ui.table = el("table", { class: "revtrain-table" });
    ui.verdict = el("p", { class: "revtrain-verdict", role: "status", "aria-live": "polite" }, "");
    const mine = mapFigure("The attention map of your digits, averaged over heads", `${id}-yours`);
    const left = el("div", { class: "revtrain-panel revtrain-wide" });
    left.append(el("p", { class: "revtrain-heading" }, "Your digits"), label("", ui.input), ui.table, ui.verdict);
    yours.append(left, fig("Your digits: attention", mine.node));
    root.append(settings, buttons, ui.loss, ui.status, panels, yours);

    const state = { trainer: null, goal: 0, timer: null };

    const setting = () => ({ lr: Number(ui.lr.value), heads: Number(ui.heads.value), positions: ui.positions.checked,
      seed: Math.max(0, Math.floor(Number(ui.seed.value) || 0)) });
    function steps() {
      const n = Math.floor(Number(ui.steps.value));
      return Number.isFinite(n) && n >= 1 ? Math.min(n, 5000) : DEFAULTS.steps;
    }

    function drawProgress() {
      const t = state.trainer, k = t.losses.length;
      ui.progress.max = Math.max(state.goal, 1);
      ui.progress.value = k;
      ui.count.textContent = `step ${k} / ${state.goal}`;
      const last = t.losses[k - 1];
      ui.loss.textContent = k ? `loss ${last.toFixed(3)} at step ${k} (a uniform guess: ln 10 = ${Math.log(V).toFixed(3)})`
        : "Not trained yet: press Train.";
      root.dataset.step = String(k);
      root.dataset.loss = k ? String(last) : "";
    }

    function drawYours() {
      const typed = ui.input.value;
      const digits = Array.from(typed).filter((c) => c >= "0" && c <= "9").map(Number).slice(0, L);
      const dropped = typed.length - digits.length;
      ui.table.replaceChildren();
      if (!digits.length) {
        ui.verdict.textContent = "Type 1 to 8 digits.";
        mine.draw([], []);
        return;
      }
      const { output, map } = state.trainer.read(digits);
      const want = digits.slice().reverse();
      const row = (name, values, marks) => {
        const tr = el("tr", {});
        tr.append(el("th", { scope: "row" }, name));
        values.forEach((v, i) => {
          const wrong = marks && v !== want[i];
          tr.append(el("td", wrong ? { class: "revtrain-wrong", title: `should be ${want[i]}` } : {}, String(v)));
        });
        return tr;
      };
      ui.table.append(row("input", digits), row("reversed", want), row("model", output, true));
      const right = output.filter((v, i) => v === want[i]).length;
      const notes = [`The model gets ${right} of ${digits.length} right.`];
      if (right < digits.length) notes.push("Wrong digits are underlined.");
      if (digits.length < L) notes.push(`It was trained on ${L} digits only: ${digits.length} is new to it.`);
      if (dropped > 0) notes.push("Only the first 8 digits are read; other characters are left out.");
      ui.verdict.textContent = notes.join(" ");
      root.dataset.output = output.join("");
      mine.draw(map, digits);
    }

    function drawAll() {
      drawProgress();
      curve.draw(state.trainer.losses, state.goal);
      probe.draw(state.trainer.read(PROBE).map, PROBE);
      drawYours();
    }

    function reset(message) {
      stop();
      const s = setting();
      state.trainer = new Trainer({ seed: s.seed, heads: s.heads, positions: s.positions });
      state.goal = steps();
      drawAll();
      ui.status.textContent = message || `New model: ${s.heads} head${s.heads > 1 ? "s" : ""}, positions ${s.positions ? "on" : "off"}, seed ${s.seed}.`;
    }

    function stop() {
      if (state.timer !== null) clearTimeout(state.timer);
      state.timer = null;
      ui.stop.disabled = true;
      ui.train.disabled = false;
      root.dataset.training = "0";
    }

    // Train in slices of about 40 ms, each followed by a redraw, so the page stays responsive.
    function tick() {
      state.timer = null;
      if (!root.isConnected) return;
      const t = state.trainer, start = performance.now();
      while (t.losses.length < state.goal && performance.now() - start < 40) t.step(Number(ui.lr.value));
      drawAll();
      if (t.losses.length >= state.goal) {
        stop();
        ui.status.textContent = `Trained ${t.losses.length} steps: loss ${t.losses[t.losses.length - 1].toFixed(3)}.`;
        return;
      }
      state.timer = setTimeout(tick, 0);
    }

    ui.train.addEventListener("click", () => {
      if (state.timer !== null) return;
      const t = state.trainer;
      // after a finished run, Train goes on for `steps` more
      state.goal = t.losses.length >= steps() ? t.losses.length + steps() : steps();
      ui.train.disabled = true;
      ui.stop.disabled = false;
      root.dataset.training = "1";
      ui.status.textContent = `Training to step ${state.goal}…`;
      state.timer = setTimeout(tick, 0);
    });
    ui.stop.addEventListener("click", () => {
      stop();
      ui.status.textContent = `Stopped at step ${state.trainer.losses.length}.`;
      ui.train.focus();
    });
    ui.reset.addEventListener("click", () => reset());
    // a new architecture or seed is a new model; the learning rate and steps apply from now on
    for (const control of [ui.heads, ui.positions, ui.seed]) control.addEventListener("change", () => reset());
    ui.steps.addEventListener("change", () => {
      if (state.timer === null && state.trainer.losses.length < steps()) state.goal = steps();
      drawAll();
    });
    ui.input.addEventListener("input", drawYours);
    reset("Press Train: the model learns to reverse 8 digits, here in your browser.");
    root.dataset.loaded = "1";
  }

  const api = { Model, Adam, Trainer, mulberry32, normal, reversalBatch, shapes, lossAndGrads, run, PROBE, DEFAULTS };
  if (typeof window === "undefined") {
    if (typeof module !== "undefined") module.exports = api;
    return;
  }
  window.attentionRefReverser = api;
  window.attentionRefWidgets.onEveryPage(".reverser-train", setup); // widgets.js
})();
