/*
 * Attention explorer: turns every `div.attention-explorer` written by
 * attention_ref.viz.explorer_html into an interactive view.
 *
 * Clicking a token (or moving to it with the keyboard) selects it. A toggle
 * picks the direction: the token "attends to" (its row of weights: it is the
 * query) or "is attended by" (its column: it is the key). The tokens are
 * shaded by weight, and a table gives, for every other token, the steps that
 * made the weight: q.k, the scaled score, the causal mask (when the model has
 * one), exp(score - max) and the softmax, with the sum each exp is divided
 * by (a last row for the chosen query; a column when each row is another
 * query's), so that weight = exp / sum can be checked by hand. On a phone a
 * tap on a token brings the table into view. Menus switch the model, the
 * sentence, the layer and the head; an overview of every layer x head (one small heatmap per head,
 * drawn here as inline SVG, each shaded to its own largest weight) opens a
 * head when clicked and outlines the chosen token's row or column.
 *
 * Every number comes from the JSON in the container's `data-attention`
 * attribute, computed by attention_ref when the site was built; this script
 * only decodes and displays it. For display it forms the scaled score (q.k
 * times the model's scale), exp(score - max) and their sum from the embedded
 * scores; the weights shown are the embedded ones (the two agree to about 5e-4,
 * the scores travelling in steps of 0.01):
 *
 *   {"model": 0, "start": {"sentence", "layer", "head"},
 *    "models": [{"name", "caption", "layers": [names], "heads": [names], "causal",
 *                "weightUnit", "scale", "scoreUnit", "sqrtD",
 *                "sentences": [{"text", "tokens", "weights", "scores", "initial"}]}]}
 *
 * `weights` (uint16, counts of weightUnit) and `scores` (int16, q.k before
 * the scale, counts of scoreUnit) are base64 little-endian arrays
 * (layers, H, L, L) flattened. `caption` (optional) is shown above the menus
 * while its model is chosen.
 *
 * (Not a `<script type="application/json">`: Material's instant navigation
 * re-runs the scripts of a new page as JavaScript.)
 *
 * Plain JavaScript, no framework, no network. With Material's instant
 * navigation the page content is replaced without a reload, so the set-up
 * runs on every `document$` emission; a container is bound once only
 * (`data-explorer-ready`).
 */
(function () {
  "use strict";

  var SVG = "http://www.w3.org/2000/svg";
  var STEPS = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1 };
  var MINUS_INFINITY = "\u2212\u221e";
  // Material's phone and tablet-portrait widths (its 45em breakpoint)
  var NARROW = "(max-width: 44.984375em)";

  /* The index a key press moves to from `i` among `n` items, or null for other keys. */
  function moved(event, i, n) {
    var step = STEPS[event.key];
    if (event.key === "Home") return 0;
    if (event.key === "End") return n - 1;
    if (step === undefined) return null;
    return Math.min(n - 1, Math.max(0, i + step));
  }

  function svgElement(name, attributes) {
    var element = document.createElementNS(SVG, name);
    Object.keys(attributes).forEach(function (key) {
      element.setAttribute(key, String(attributes[key]));
    });
    return element;
  }

  function element(name, className, text) {
    var node = document.createElement(name);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  /* A base64 array of little-endian 16-bit integers, times `unit`. */
  function unpack(text, unit, signed) {
    var bytes = atob(text);
    var view = new DataView(new ArrayBuffer(bytes.length));
    for (var b = 0; b < bytes.length; b++) view.setUint8(b, bytes.charCodeAt(b));
    var values = new Array(bytes.length / 2);
    for (var i = 0; i < values.length; i++) {
      values[i] = (signed ? view.getInt16(2 * i, true) : view.getUint16(2 * i, true)) * unit;
    }
    return values;
  }

  /* A readable minus sign, and no "-0.00". */
  function fixed(x, digits) {
    var text = x.toFixed(digits);
    if (Number(text) === 0) text = (0).toFixed(digits);
    return text.replace("-", "\u2212");
  }

  /* One sentence of one model, decoded once: w(l, h, i, j) and s(l, h, i, j) (q.k). */
  function decoded(model, sentence) {
    if (sentence.cache) return sentence.cache;
    var L = sentence.tokens.length;
    var H = model.heads.length;
    var weights = unpack(sentence.weights, model.weightUnit, false);
    var scores = sentence.scores ? unpack(sentence.scores, model.scoreUnit, true) : null;
    function at(l, h, i, j) { return ((l * H + h) * L + i) * L + j; }
    sentence.cache = {
      L: L,
      w: function (l, h, i, j) { return weights[at(l, h, i, j)]; },
      s: scores ? function (l, h, i, j) { return scores[at(l, h, i, j)]; } : null,
      // each head's largest weight: the thumbnails' own contrast
      max: function (l, h) {
        var top = 0;
        for (var k = at(l, h, 0, 0); k < at(l, h, 0, 0) + L * L; k++) top = Math.max(top, weights[k]);
        return top;
      },
    };
    return sentence.cache;
  }

  /*
   * The softmax of query i's row, step by step, from the embedded q.k: for
   * every key j, exp(s - max) where s is q.k times the scale (-infinity for a
   * key after the query under a causal mask, whose exp is 0) and max is the
   * row's largest s; and the sum of the row's exps, which each exp is divided by.
   */
  function softmaxSteps(model, d, l, h, i) {
    var s = [];
    var top = -Infinity;
    for (var j = 0; j < d.L; j++) {
      s.push(model.causal && j > i ? -Infinity : d.s(l, h, i, j) * model.scale);
      top = Math.max(top, s[j]);
    }
    var exp = s.map(function (x) { return Math.exp(x - top); });
    var sum = exp.reduce(function (a, b) { return a + b; }, 0);
    return { exp: exp, sum: sum };
  }

  function tokenButton(token, i) {
    var button = element("button", "attention-explorer-token", token);
    button.type = "button";
    button.dataset.index = String(i);
    button.setAttribute("aria-pressed", "false");
    return button;
  }

  function setOptions(select, names, selected) {
    select.textContent = "";
    names.forEach(function (name, i) {
      var option = element("option", "", name);
      option.value = String(i);
      option.selected = i === selected;
      select.appendChild(option);
    });
    select.disabled = names.length < 2;
  }

  function setup(root) {
    if (root.dataset.explorerReady === "true") {
      return; // already bound: instant navigation kept this element
    }
    var headSelect = root.querySelector("select.attention-explorer-head");
    if (!root.dataset.attention || !headSelect) {
      return;
    }
    var data;
    try {
      data = JSON.parse(root.dataset.attention);
    } catch (error) {
      root.dataset.explorerReady = "error";
      return;
    }
    var modelSelect = root.querySelector("select.attention-explorer-model");
    var layerSelect = root.querySelector("select.attention-explorer-layer");
    var sentenceSelect = root.querySelector("select.attention-explorer-sentence");
    var tokensBox = root.querySelector(".attention-explorer-tokens");
    var thumbsBox = root.querySelector(".attention-explorer-thumbs");
    var status = root.querySelector(".attention-explorer-status");
    var steps = root.querySelector(".attention-explorer-steps");
    var caption = root.querySelector(".attention-explorer-caption");
    var directionButtons = Array.prototype.slice.call(
      root.querySelectorAll("button.attention-explorer-direction-button"));
    var hint = status.textContent;
    // what the reader chose in each model, kept when they switch back
    var views = data.models.map(function (model, m) {
      var start = m === data.model ? data.start : { sentence: 0, layer: 0, head: 0 };
      return {
        sentence: start.sentence, layer: start.layer, head: start.head,
        // the token chosen in each sentence
        queries: model.sentences.map(function (s) { return s.initial === undefined ? null : s.initial; }),
      };
    });
    var state = {
      model: data.model, direction: "to", drawnTokens: null, drawnThumbs: null, shownThumb: null,
    };

    function model() { return data.models[state.model]; }
    function view() { return views[state.model]; }
    function sentence() { return model().sentences[view().sentence]; }

    function tokenButtons() {
      return Array.prototype.slice.call(tokensBox.querySelectorAll("button.attention-explorer-token"));
    }

    function thumbButtons() {
      return Array.prototype.slice.call(thumbsBox.querySelectorAll("button.attention-explorer-thumb"));
    }

    function drawTokens() {
      var key = state.model + "/" + view().sentence;
      var tokens = sentence().tokens;
      var existing = tokenButtons().map(function (b) { return b.textContent; });
      if (state.drawnTokens === null && existing.join("\u0000") === tokens.join("\u0000")) {
        state.drawnTokens = key; // the buttons written at build time
        return;
      }
      if (state.drawnTokens === key) return;
      tokensBox.textContent = "";
      tokens.forEach(function (token, i) { tokensBox.appendChild(tokenButton(token, i)); });
      state.drawnTokens = key;
    }

    /* The menus of the chosen model: rebuilt when the model changes. */
    function drawMenus() {
      var m = model();
      var v = view();
      if (sentenceSelect) setOptions(sentenceSelect, m.sentences.map(function (s) { return s.text; }), v.sentence);
      if (layerSelect) setOptions(layerSelect, m.layers, v.layer);
      setOptions(headSelect, m.heads, v.head);
    }

    /* The overview: a row per layer, a column per head, one small heatmap each. */
    function drawThumbs() {
      var key = state.model + "/" + view().sentence;
      if (state.drawnThumbs === key) return;
      var m = model();
      var d = decoded(m, sentence());
      var L = d.L;
      thumbsBox.textContent = "";
      thumbsBox.style.setProperty("--explorer-heads", String(m.heads.length));
      thumbsBox.appendChild(element("span", "attention-explorer-corner", ""));
      m.heads.forEach(function (name, h) {
        var label = element("span", "attention-explorer-axis attention-explorer-axis-head", String(h));
        label.title = name;
        thumbsBox.appendChild(label);
      });
      m.layers.forEach(function (layerName, l) {
        var label = element("span", "attention-explorer-axis attention-explorer-axis-layer", String(l));
        label.title = layerName;
        thumbsBox.appendChild(label);
        m.heads.forEach(function (headName, h) {
          var button = element("button", "attention-explorer-thumb");
          button.type = "button";
          button.dataset.layer = String(l);
          button.dataset.head = String(h);
          var name = (m.layers.length > 1 ? layerName + ", " : "") + headName;
          button.title = name + ": open this head";
          button.setAttribute("aria-label", name);
          var top = d.max(l, h) || 1;
          button.dataset.max = String(top);
          var svg = svgElement("svg", {
            viewBox: "0 0 " + L + " " + L, class: "attention-explorer-thumb-map",
            "aria-hidden": "true", focusable: "false", "shape-rendering": "crispEdges",
          });
          svg.appendChild(svgElement("rect", { class: "attention-explorer-thumb-bg", width: L, height: L }));
          for (var i = 0; i < L; i++) {
            for (var j = 0; j < L; j++) {
              var w = d.w(l, h, i, j);
              if (w <= 0) continue;
              svg.appendChild(svgElement("rect", {
                class: "attention-explorer-cell", x: j, y: i, width: 1, height: 1,
                "fill-opacity": (w / top).toFixed(3),
              }));
            }
          }
          svg.appendChild(svgElement("rect", {
            class: "attention-explorer-thumb-row", x: 0, y: 0, width: L, height: 1,
            "vector-effect": "non-scaling-stroke", visibility: "hidden",
          }));
          button.appendChild(svg);
          thumbsBox.appendChild(button);
        });
      });
      state.drawnThumbs = key;
      markOverview();
    }

    /* When the heads do not all fit (a phone), the overview says so under it: the heads past the
       edge are otherwise out of sight with nothing to tell they are there. */
    var overview = root.querySelector(".attention-explorer-overview");
    function markOverview() {
      if (overview) overview.classList.toggle("ar-wide", thumbsBox.scrollWidth > thumbsBox.clientWidth + 1);
    }
    if (window.ResizeObserver) new ResizeObserver(markOverview).observe(thumbsBox);

    /* A cell of the weight column: the number, and under it a bar as long as the weight. */
    function weightCell(w) {
      var cell = element("td", "attention-explorer-value");
      cell.style.setProperty("--attention-weight", String(w));
      cell.appendChild(element("span", "attention-explorer-number", w.toFixed(3)));
      var bar = element("span", "attention-explorer-bar");
      bar.setAttribute("aria-hidden", "true");
      cell.appendChild(bar);
      return cell;
    }

    /*
     * The table of steps for the chosen token, in the chosen direction. With
     * scores: q.k, the scaled score, the mask (causal models), exp(s - max),
     * and the softmax = exp / sum. As the query ("to") every row shares one
     * sum, shown in a last row; as the key ("by") each row is another query's
     * row of weights, with its own sum, shown in a column.
     */
    function drawSteps(d, query) {
      var m = model();
      var v = view();
      var tokens = sentence().tokens;
      var to = state.direction === "to";
      steps.textContent = "";
      var table = element("table", "attention-explorer-table");
      var head = element("tr");
      var columns = [[to ? "key" : "query", "attention-explorer-label"]];
      if (d.s) {
        columns.push(["q\u00b7k", "attention-explorer-score"]);
        columns.push(["\u00f7" + m.sqrtD, "attention-explorer-scaled"]);
        if (m.causal) columns.push(["mask", "attention-explorer-masked"]);
        columns.push(["exp(s \u2212 max)", "attention-explorer-exp"]);
        if (!to) columns.push(["row sum", "attention-explorer-sum"]);
      }
      columns.push([d.s ? "softmax" : "weight", "attention-explorer-value"]);
      columns.forEach(function (c) {
        var th = element("th", c[1], c[0]);
        var bracket = c[0].indexOf("(");
        if (bracket > 0) { // "exp(s - max)": the bracket may go to a line of its own, whole
          th.textContent = c[0].slice(0, bracket);
          th.appendChild(element("span", "attention-explorer-nowrap", c[0].slice(bracket)));
        }
        th.scope = "col";
        head.appendChild(th);
      });
      var thead = element("thead");
      thead.appendChild(head);
      table.appendChild(thead);
      var body = element("tbody");
      var row0 = d.s && to ? softmaxSteps(m, d, v.layer, v.head, query) : null;
      var total = 0;
      for (var other = 0; other < d.L; other++) {
        var i = to ? query : other; // the query of this cell
        var j = to ? other : query; // its key
        var w = d.w(v.layer, v.head, i, j);
        total += w;
        var row = element("tr", "attention-explorer-row");
        row.dataset.token = String(other);
        row.dataset.weight = String(w);
        var label = element("th", "attention-explorer-label", tokens[other]);
        label.scope = "row";
        row.appendChild(label);
        if (d.s) {
          var s = d.s(v.layer, v.head, i, j);
          var masked = m.causal && j > i;
          var softmax = row0 || softmaxSteps(m, d, v.layer, v.head, i);
          row.dataset.score = String(s);
          row.appendChild(element("td", "attention-explorer-score", fixed(s, 2)));
          row.appendChild(element("td", "attention-explorer-scaled", fixed(s * m.scale, 2)));
          if (m.causal) {
            var cell = element("td", "attention-explorer-masked", masked ? MINUS_INFINITY : fixed(s * m.scale, 2));
            if (masked) row.classList.add("is-masked");
            row.appendChild(cell);
          }
          row.appendChild(element("td", "attention-explorer-exp", softmax.exp[j].toFixed(3)));
          if (!to) row.appendChild(element("td", "attention-explorer-sum", softmax.sum.toFixed(3)));
        }
        row.appendChild(weightCell(w));
        body.appendChild(row);
      }
      table.appendChild(body);
      if (row0) {
        // the sum every exp of the row is divided by; the weights sum to 1
        var foot = element("tfoot");
        var sums = element("tr", "attention-explorer-total");
        var name = element("th", "attention-explorer-label", "sum");
        name.scope = "row";
        sums.appendChild(name);
        columns.slice(1, -2).forEach(function (c) { sums.appendChild(element("td", c[1], "")); });
        sums.appendChild(element("td", "attention-explorer-exp", row0.sum.toFixed(3)));
        sums.appendChild(element("td", "attention-explorer-value", total.toFixed(3)));
        foot.appendChild(sums);
        table.appendChild(foot);
      }
      steps.appendChild(table);
    }

    function statusText(query) {
      var m = model();
      var v = view();
      var tokens = sentence().tokens;
      var where = m.heads[v.head];
      if (m.layers.length > 1) where = m.layers[v.layer] + ", " + where;
      var word = "\u201c" + tokens[query] + "\u201d (token " + query + ")";
      var how = sentence().scores
        ? " Each score s is q\u00b7k divided by " + m.sqrtD +
          (m.causal ? ", or " + MINUS_INFINITY + " where the key comes after the query (the causal mask)" : "") +
          ". The softmax takes exp(s \u2212 max), with max the largest score of the query's row, and divides " +
          "it by the sum of the row" +
          (state.direction === "to" ? " (the last line)" : " (each query has its own: the row sum column)") +
          ": that is the weight."
        : "";
      if (state.direction === "to") {
        return where + ": where " + word + " attends, as the query; its weights sum to 1." + how;
      }
      return where + ": how much each query attends to " + word + ", as the key. Each weight is a share " +
        "of that query's own row, so this column need not sum to 1." + how;
    }

    /* The chosen model's caption; none hides the paragraph. */
    function drawCaption() {
      if (!caption) return;
      var text = model().caption || "";
      if (caption.textContent !== text) caption.textContent = text;
      caption.hidden = !text;
    }

    /*
     * On a narrow screen the overview scrolls sideways in its own box: scroll
     * that box (never the page) so that the chosen head shows beside the
     * column of layer numbers, when it opens or when the chosen head changes.
     */
    function showChosenThumb(thumb) {
      var key = state.drawnThumbs + "/" + thumb.dataset.layer + "/" + thumb.dataset.head;
      if (state.shownThumb === key) return;
      state.shownThumb = key;
      if (thumbsBox.scrollWidth <= thumbsBox.clientWidth) return;
      var axis = thumbsBox.querySelector(".attention-explorer-axis-layer");
      var start = thumb.offsetLeft - (axis ? axis.offsetLeft + axis.offsetWidth : 0) - 4;
      var end = thumb.offsetLeft + thumb.offsetWidth + 4;
      if (start < thumbsBox.scrollLeft) thumbsBox.scrollLeft = start;
      else if (end > thumbsBox.scrollLeft + thumbsBox.clientWidth) thumbsBox.scrollLeft = end - thumbsBox.clientWidth;
    }

    /* After a tap on a phone: bring the steps table into view, scrolling as little as needed. */
    function revealSteps() {
      var table = steps.querySelector("table");
      if (!table || !window.matchMedia || !window.matchMedia(NARROW).matches) return;
      var still = window.matchMedia("(prefers-reduced-motion: reduce)").matches;
      table.scrollIntoView({ block: "nearest", behavior: still ? "auto" : "smooth" });
    }

    function render() {
      drawCaption();
      drawTokens();
      drawThumbs();
      var m = model();
      var v = view();
      var d = decoded(m, sentence());
      var query = v.queries[v.sentence];
      var to = state.direction === "to";
      directionButtons.forEach(function (b) {
        b.setAttribute("aria-pressed", b.dataset.direction === state.direction ? "true" : "false");
      });
      thumbButtons().forEach(function (thumb) {
        var l = Number(thumb.dataset.layer);
        var h = Number(thumb.dataset.head);
        var selected = l === v.layer && h === v.head;
        thumb.setAttribute("aria-pressed", selected ? "true" : "false");
        thumb.tabIndex = selected ? 0 : -1; // one tab stop; arrows move between heads and layers
        if (selected) showChosenThumb(thumb);
        var line = thumb.querySelector(".attention-explorer-thumb-row");
        line.setAttribute("visibility", query === null ? "hidden" : "visible");
        var at = query === null ? 0 : query;
        // the chosen token's row (as the query) or column (as the key)
        line.setAttribute("x", to ? "0" : String(at));
        line.setAttribute("y", to ? String(at) : "0");
        line.setAttribute("width", to ? String(d.L) : "1");
        line.setAttribute("height", to ? "1" : String(d.L));
      });
      tokenButtons().forEach(function (button, i) {
        var selected = i === query;
        button.setAttribute("aria-pressed", selected ? "true" : "false");
        button.classList.toggle("is-query", selected);
        if (query === null) {
          button.style.removeProperty("--attention-weight");
          button.classList.remove("is-strong");
          button.removeAttribute("title");
          return;
        }
        var w = to ? d.w(v.layer, v.head, query, i) : d.w(v.layer, v.head, i, query);
        button.style.setProperty("--attention-weight", String(w));
        button.classList.toggle("is-strong", w >= 0.5);
        button.title = "weight " + w.toFixed(3);
      });
      if (query === null) {
        status.textContent = hint;
        steps.textContent = "";
        return;
      }
      status.textContent = statusText(query);
      drawSteps(d, query);
    }

    function chooseToken(i) {
      var v = view();
      v.queries[v.sentence] = i;
      render();
    }

    function chooseHead(l, h) {
      var v = view();
      v.layer = l;
      v.head = h;
      headSelect.value = String(h);
      if (layerSelect) layerSelect.value = String(l);
      render();
    }

    function tokenIndex(target) {
      var button = target.closest ? target.closest("button.attention-explorer-token") : null;
      return button && tokensBox.contains(button) ? Number(button.dataset.index) : null;
    }

    tokensBox.addEventListener("click", function (event) {
      var i = tokenIndex(event.target);
      if (i === null) return;
      chooseToken(i);
      if (event.detail > 0) revealSteps(); // a tap or a click, not Enter or Space on a focused token
    });
    tokensBox.addEventListener("focusin", function (event) {
      var i = tokenIndex(event.target);
      if (i !== null) chooseToken(i);
    });
    tokensBox.addEventListener("keydown", function (event) {
      var i = tokenIndex(event.target);
      if (i === null) return;
      var buttons = tokenButtons();
      var next = moved(event, i, buttons.length);
      if (next === null) return;
      event.preventDefault();
      buttons[next].focus(); // focusing a token selects it
    });
    directionButtons.forEach(function (button) {
      button.addEventListener("click", function () {
        state.direction = button.dataset.direction;
        render();
      });
    });
    thumbsBox.addEventListener("click", function (event) {
      var thumb = event.target.closest ? event.target.closest("button.attention-explorer-thumb") : null;
      if (thumb) chooseHead(Number(thumb.dataset.layer), Number(thumb.dataset.head));
    });
    thumbsBox.addEventListener("keydown", function (event) {
      var thumb = event.target.closest ? event.target.closest("button.attention-explorer-thumb") : null;
      if (!thumb) return;
      var l = Number(thumb.dataset.layer);
      var h = Number(thumb.dataset.head);
      var vertical = event.key === "ArrowUp" || event.key === "ArrowDown";
      var next = vertical ? moved(event, l, model().layers.length) : moved(event, h, model().heads.length);
      if (next === null) return;
      event.preventDefault();
      if (vertical) l = next; else h = next;
      chooseHead(l, h);
      thumbsBox.querySelector('button[data-layer="' + l + '"][data-head="' + h + '"]').focus();
    });
    headSelect.addEventListener("change", function () {
      view().head = Number(headSelect.value);
      render();
    });
    if (layerSelect) {
      layerSelect.addEventListener("change", function () {
        view().layer = Number(layerSelect.value);
        render();
      });
    }
    if (sentenceSelect) {
      sentenceSelect.addEventListener("change", function () {
        view().sentence = Number(sentenceSelect.value);
        render();
      });
    }
    if (modelSelect) {
      modelSelect.addEventListener("change", function () {
        state.model = Number(modelSelect.value);
        drawMenus();
        render();
      });
    }
    root.dataset.explorerReady = "true";
    render();
  }

  window.attentionRefWidgets.onEveryPage("div.attention-explorer", setup); // widgets.js
})();
