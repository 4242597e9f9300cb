/*
 * Map slider: turns every `figure.ar-map-slider` written by
 * attention_ref.viz.map_slider_html into a widget that steps through the
 * attention maps it holds, one per frame (a training step, a layer, ...).
 *
 * The figure arrives with the last frame drawn as SVG, so a reader without
 * JavaScript sees a still heatmap; its controls are `hidden`. This script
 * shows the controls and, whenever the frame changes, recolours the SVG's
 * cells and rewrites the frame's name and value:
 *
 *   - the range input (drag it, or focus it and press the arrow keys, Home
 *     or End) picks a frame, and pauses a running animation;
 *   - Play steps through the frames at FPS frames a second and stops at the
 *     last one (from the last frame it starts again at frame 0); Pause stops.
 *
 * Every number comes from the JSON in the figure's `data-map-slider`
 * attribute, computed by attention_ref when the site was built:
 *
 *   {"frames": F, "L", "S", "unit", "weights", "names": [F names],
 *    "values": [F formatted values] or null, "valueName",
 *    "rows": [L labels], "cols": [S labels], "ramp": [colour stops]}
 *
 * `weights` is a base64 array of little-endian uint16 counts of `unit`,
 * (F, L, S) flattened. A cell's colour is its weight on `ramp`, interpolated
 * linearly in RGB exactly as viz._ramp_colour does, so the frame drawn here
 * and the one written at build time are the same colours.
 *
 * Plain JavaScript, no library, no network. With Material's instant
 * navigation the page content is replaced without a reload, so the set-up
 * runs on every `document$` emission; a figure is bound once only
 * (`data-map-slider-ready`), and an animation stops when its figure has left
 * the page.
 */
(function () {
  "use strict";

  var FPS = 15;

  /* A base64 array of little-endian uint16 counts, times `unit`. */
  function unpack(text, unit) {
    var bytes = atob(text);
    var view = new DataView(new ArrayBuffer(bytes.length));
    for (var b = 0; b < bytes.length; b++) view.setUint8(b, bytes.charCodeAt(b));
    var values = new Array(bytes.length / 2);
    for (var i = 0; i < values.length; i++) values[i] = view.getUint16(2 * i, true) * unit;
    return values;
  }

  function rgb(hex) {
    return [1, 3, 5].map(function (k) { return parseInt(hex.slice(k, k + 2), 16); });
  }

  function hex2(x) {
    var text = x.toString(16);
    return text.length < 2 ? "0" + text : text;
  }

  /* The colour of weight `w` on the stops `ramp` ([r, g, b] each): viz._ramp_colour. */
  function colour(ramp, w) {
    var t = Math.min(Math.max(w, 0), 1) * (ramp.length - 1);
    var i = Math.min(Math.floor(t), ramp.length - 2);
    var f = t - i;
    var out = "#";
    for (var c = 0; c < 3; c++) {
      out += hex2(Math.floor(ramp[i][c] + (ramp[i + 1][c] - ramp[i][c]) * f + 0.5));
    }
    return out;
  }

  function setup(root) {
    if (root.dataset.mapSliderReady === "true") return;
    var data = JSON.parse(root.dataset.mapSlider);
    var weights = unpack(data.weights, data.unit);
    var ramp = data.ramp.map(rgb);
    var size = data.L * data.S;
    var last = data.frames - 1;
    var controls = root.querySelector(".ar-map-slider-controls");
    var range = root.querySelector("input.ar-map-slider-range");
    var play = root.querySelector("button.ar-map-slider-play");
    var frameText = root.querySelector(".ar-map-slider-frame");
    var valueText = root.querySelector(".ar-map-slider-value");
    var map = root.querySelector("svg.ar-map-slider-map");
    var cells = root.querySelectorAll("rect.ar-map-slider-cell");
    var timer = null;
    var frame = last;

    function draw(f) {
      frame = f;
      for (var k = 0; k < cells.length; k++) {
        var cell = cells[k];
        var i = Number(cell.dataset.i);
        var j = Number(cell.dataset.j);
        var w = weights[f * size + i * data.S + j];
        cell.setAttribute("fill", colour(ramp, w));
        cell.dataset.weight = w.toFixed(4);
        var title = cell.querySelector("title");
        if (title) title.textContent = data.rows[i] + " \u2192 " + data.cols[j] + ": " + w.toFixed(3);
      }
      var name = data.names[f];
      var value = data.values ? data.valueName + ": " + data.values[f] : "";
      frameText.textContent = name;
      if (valueText) valueText.textContent = value;
      range.value = String(f);
      range.setAttribute("aria-valuetext", value ? name + ", " + value : name);
      map.setAttribute("aria-label", "attention map, " + name);
    }

    function showPlaying(playing) {
      play.textContent = playing ? "Pause" : "Play";
      play.setAttribute("aria-label", playing ? "Pause" : "Play the frames");
    }

    function stop() {
      if (timer !== null) window.clearInterval(timer);
      timer = null;
      showPlaying(false);
    }

    function tick() {
      if (!root.isConnected) { stop(); return; } // the page was navigated away from
      draw(Math.min(frame + 1, last));
      if (frame >= last) stop();
    }

    function start() {
      if (frame >= last) draw(0); // from the end, play from the first frame
      showPlaying(true);
      timer = window.setInterval(tick, 1000 / FPS);
    }

    range.addEventListener("input", function () {
      stop();
      draw(Number(range.value));
    });
    play.addEventListener("click", function () {
      if (timer !== null) stop(); else start();
    });
    controls.hidden = false;
    root.dataset.mapSliderReady = "true";
    draw(Number(range.value));
  }

  window.attentionRefWidgets.onEveryPage("figure.ar-map-slider", setup); // widgets.js
})();
