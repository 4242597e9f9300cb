/*
 * Attention explorer: turns every `div.attention-explorer` written by
 * attention_ref.viz.explorer_html into an interactive view.
 *
 * Clicking a token (or moving to it with the keyboard) shows its attention
 * weights over all tokens: the tokens are shaded by weight and a list of bars
 * gives each value with 3 decimals. The menu switches heads. The data is the
 * JSON in the container's `data-attention` attribute, computed by
 * attention_ref when the site was built. (Not a `<script type="application/json">`:
 * Material's instant navigation re-runs the scripts of a new page as JavaScript.)
 *
 * Plain JavaScript, no framework, no network. With Material's instant
 * navigation the page content is replaced without a reload, so the set-up
 * runs on every `document$` emission; a container is bound once only
 * (`data-explorer-ready`).
 */
(function () {
  "use strict";

  function render(root, state) {
    var data = state.data;
    var head = state.head;
    var query = state.query;
    var buttons = state.buttons;
    var bars = root.querySelector(".attention-explorer-bars");
    var status = root.querySelector(".attention-explorer-status");
    buttons.forEach(function (button, i) {
      var selected = i === query;
      button.setAttribute("aria-pressed", selected ? "true" : "false");
      button.classList.toggle("is-query", selected);
      if (query === null) {
        button.style.removeProperty("--attention-weight");
        button.classList.remove("is-strong");
        button.removeAttribute("title");
        return;
      }
      var w = data.weights[head][query][i];
      button.style.setProperty("--attention-weight", String(w));
      button.classList.toggle("is-strong", w >= 0.5);
      button.title = "weight " + w.toFixed(3);
    });
    bars.textContent = "";
    if (query === null) {
      return;
    }
    status.textContent =
      data.heads[head] + ": where \u201c" + data.tokens[query] + "\u201d (token " + query +
      ") attends. Each weight is a share of its attention; they sum to 1.";
    var row = data.weights[head][query];
    row.forEach(function (w, j) {
      var item = document.createElement("li");
      item.className = "attention-explorer-row";
      item.dataset.key = String(j);
      item.dataset.weight = String(w);
      var label = document.createElement("span");
      label.className = "attention-explorer-label";
      label.textContent = data.tokens[j];
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

  function setup(root) {
    if (root.dataset.explorerReady === "true") {
      return; // already bound: instant navigation kept this element
    }
    var select = root.querySelector("select.attention-explorer-head");
    if (!root.dataset.attention || !select) {
      return;
    }
    var data;
    try {
      data = JSON.parse(root.dataset.attention);
    } catch (error) {
      root.dataset.explorerReady = "error";
      return;
    }
    root.dataset.explorerReady = "true";
    var buttons = Array.prototype.slice.call(root.querySelectorAll("button.attention-explorer-token"));
    var initial = root.dataset.initialToken;
    var state = {
      data: data,
      buttons: buttons,
      head: Number(select.value) || 0,
      query: initial === undefined ? null : Number(initial),
    };

    function choose(index) {
      state.query = index;
      render(root, state);
    }

    buttons.forEach(function (button, i) {
      button.addEventListener("click", function () {
        choose(i);
      });
      button.addEventListener("focus", function () {
        choose(i);
      });
      button.addEventListener("keydown", function (event) {
        var step = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1 }[event.key];
        if (step === undefined) {
          if (event.key === "Home") step = -i;
          else if (event.key === "End") step = buttons.length - 1 - i;
          else return;
        }
        var next = Math.min(buttons.length - 1, Math.max(0, i + step));
        event.preventDefault();
        buttons[next].focus();
      });
    });
    select.addEventListener("change", function () {
      state.head = Number(select.value);
      render(root, state);
    });
    render(root, state);
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
