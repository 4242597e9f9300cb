/*
 * Attention explorer: turns every `div.attention-explorer` written by
 * attention_ref.viz.explorer_html into an interactive view.
 *
 * Clicking a token (or moving to it with the keyboard) shows its attention
 * weights over all tokens: the tokens are shaded by weight and a list of bars
 * gives each value with 3 decimals. Menus switch the sentence, the layer and
 * the head; a row of thumbnails (one small heatmap per head of the chosen
 * layer, drawn here as inline SVG) opens a head when clicked, and outlines
 * the row of the chosen token. The data is the JSON in the container's
 * `data-attention` attribute, computed by attention_ref when the site was
 * built:
 *
 *   {"layers": [names], "heads": [names],
 *    "sentences": [{"text", "tokens", "weights": [layer][head][query][key], "initial"}]}
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

  /* One thumbnail: a button holding an L x L heatmap of one head and its name. */
  function thumbnail(matrix, name, head) {
    var L = matrix.length;
    var button = document.createElement("button");
    button.type = "button";
    button.className = "attention-explorer-thumb";
    button.dataset.head = String(head);
    button.title = name + ": open this head";
    var svg = svgElement("svg", {
      viewBox: "0 0 " + L + " " + L,
      class: "attention-explorer-thumb-map",
      "aria-hidden": "true",
      focusable: "false",
      "shape-rendering": "crispEdges",
    });
    svg.appendChild(svgElement("rect", { class: "attention-explorer-thumb-bg", width: L, height: L }));
    matrix.forEach(function (row, i) {
      row.forEach(function (w, j) {
        svg.appendChild(svgElement("rect", {
          class: "attention-explorer-cell", x: j, y: i, width: 1, height: 1, "fill-opacity": w,
        }));
      });
    });
    svg.appendChild(svgElement("rect", {
      class: "attention-explorer-thumb-row", x: 0, y: 0, width: L, height: 1,
      "vector-effect": "non-scaling-stroke", visibility: "hidden",
    }));
    var label = document.createElement("span");
    label.className = "attention-explorer-thumb-label";
    label.textContent = name;
    button.appendChild(svg);
    button.appendChild(label);
    return button;
  }

  function tokenButton(token, i) {
    var button = document.createElement("button");
    button.type = "button";
    button.className = "attention-explorer-token";
    button.dataset.index = String(i);
    button.setAttribute("aria-pressed", "false");
    button.textContent = token;
    return button;
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
    var layerSelect = root.querySelector("select.attention-explorer-layer");
    var sentenceSelect = root.querySelector("select.attention-explorer-sentence");
    var tokensBox = root.querySelector(".attention-explorer-tokens");
    var thumbsBox = root.querySelector(".attention-explorer-thumbs");
    var status = root.querySelector(".attention-explorer-status");
    var bars = root.querySelector(".attention-explorer-bars");
    var hint = status.textContent;
    var state = {
      sentence: sentenceSelect ? Number(sentenceSelect.value) : 0,
      layer: layerSelect ? Number(layerSelect.value) : 0,
      head: Number(headSelect.value) || 0,
      // the token chosen in each sentence, kept when the reader switches back
      queries: data.sentences.map(function (s) { return s.initial === undefined ? null : s.initial; }),
      drawnTokens: null, // the sentence whose token buttons are in the page
      drawnThumbs: null, // "sentence/layer" of the thumbnails in the page
    };

    function current() {
      return data.sentences[state.sentence];
    }

    function tokenButtons() {
      return Array.prototype.slice.call(tokensBox.querySelectorAll("button.attention-explorer-token"));
    }

    function thumbButtons() {
      return thumbsBox
        ? Array.prototype.slice.call(thumbsBox.querySelectorAll("button.attention-explorer-thumb"))
        : [];
    }

    function drawTokens() {
      var sentence = current();
      var existing = tokenButtons().map(function (b) { return b.textContent; });
      if (state.drawnTokens === null && existing.join("\u0000") === sentence.tokens.join("\u0000")) {
        state.drawnTokens = state.sentence; // the buttons written at build time
        return;
      }
      if (state.drawnTokens === state.sentence) return;
      tokensBox.textContent = "";
      sentence.tokens.forEach(function (token, i) {
        tokensBox.appendChild(tokenButton(token, i));
      });
      state.drawnTokens = state.sentence;
    }

    function drawThumbs() {
      if (!thumbsBox) return;
      var key = state.sentence + "/" + state.layer;
      if (state.drawnThumbs === key) return;
      thumbsBox.textContent = "";
      current().weights[state.layer].forEach(function (matrix, h) {
        thumbsBox.appendChild(thumbnail(matrix, data.heads[h], h));
      });
      state.drawnThumbs = key;
    }

    function render() {
      drawTokens();
      drawThumbs();
      var sentence = current();
      var query = state.queries[state.sentence];
      var heads = sentence.weights[state.layer];
      thumbButtons().forEach(function (thumb, h) {
        var selected = h === state.head;
        thumb.setAttribute("aria-pressed", selected ? "true" : "false");
        thumb.tabIndex = selected ? 0 : -1; // one tab stop; arrows move between heads
        var row = thumb.querySelector(".attention-explorer-thumb-row");
        row.setAttribute("visibility", query === null ? "hidden" : "visible");
        row.setAttribute("y", String(query === null ? 0 : query));
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
        var w = heads[state.head][query][i];
        button.style.setProperty("--attention-weight", String(w));
        button.classList.toggle("is-strong", w >= 0.5);
        button.title = "weight " + w.toFixed(3);
      });
      bars.textContent = "";
      if (query === null) {
        status.textContent = hint;
        return;
      }
      var where = data.heads[state.head];
      if (data.layers.length > 1) where = data.layers[state.layer] + ", " + where;
      status.textContent =
        where + ": where \u201c" + sentence.tokens[query] + "\u201d (token " + query +
        ") attends. Each weight is a share of its attention; they sum to 1.";
      heads[state.head][query].forEach(function (w, j) {
        var item = document.createElement("li");
        item.className = "attention-explorer-row";
        item.dataset.key = String(j);
        item.dataset.weight = String(w);
        var label = document.createElement("span");
        label.className = "attention-explorer-label";
        label.textContent = sentence.tokens[j];
        var track = document.createElement("span");
        track.className = "attention-explorer-track";
        var bar = document.createElement("span");
        bar.className = "attention-explorer-bar";
        bar.style.width = (100 * w).toFixed(1) + "%";
        track.appendChild(bar);
        var value = document.createElement("span");
        value.className = "attention-explorer-value";
        value.textContent = w.toFixed(3);
        item.appendChild(label);
        item.appendChild(track);
        item.appendChild(value);
        bars.appendChild(item);
      });
    }

    function chooseToken(i) {
      state.queries[state.sentence] = i;
      render();
    }

    function chooseHead(h) {
      state.head = h;
      headSelect.value = String(h);
      render();
    }

    function tokenIndex(target) {
      var button = target.closest ? target.closest("button.attention-explorer-token") : null;
      return button && tokensBox.contains(button) ? Number(button.dataset.index) : null;
    }

    tokensBox.addEventListener("click", function (event) {
      var i = tokenIndex(event.target);
      if (i !== null) chooseToken(i);
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
    if (thumbsBox) {
      thumbsBox.addEventListener("click", function (event) {
        var thumb = event.target.closest ? event.target.closest("button.attention-explorer-thumb") : null;
        if (thumb) chooseHead(Number(thumb.dataset.head));
      });
      thumbsBox.addEventListener("keydown", function (event) {
        var thumb = event.target.closest ? event.target.closest("button.attention-explorer-thumb") : null;
        if (!thumb) return;
        var thumbs = thumbButtons();
        var next = moved(event, Number(thumb.dataset.head), thumbs.length);
        if (next === null) return;
        event.preventDefault();
        chooseHead(next);
        thumbs[next].focus();
      });
    }
    headSelect.addEventListener("change", function () {
      state.head = Number(headSelect.value);
      render();
    });
    if (layerSelect) {
      layerSelect.addEventListener("change", function () {
        state.layer = Number(layerSelect.value);
        render();
      });
    }
    if (sentenceSelect) {
      sentenceSelect.addEventListener("change", function () {
        state.sentence = Number(sentenceSelect.value);
        render();
      });
    }
    root.dataset.explorerReady = "true";
    render();
  }

  function setupAll() {
    var roots = document.querySelectorAll("div.attention-explorer");
    Array.prototype.forEach.call(roots, setup);
  }

  if (typeof window.document$ !== "undefined" && typeof window.document$.subscribe === "function") {
    window.document$.subscribe(setupAll); // Material: on first load and after every instant navigation
  } else if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", setupAll);
  } else {
    setupAll();
  }
})();
