// The start-up every widget of the site shares (explorer.js, map-slider.js, char-lm.js,
// reverser-train.js): `onEveryPage(selector, setup)` calls setup(element) for each element the
// selector matches, on the first load and again after each of Material's instant navigations
// (which swap the page's content without loading the scripts again); without Material, once the
// document is parsed. A widget's setup must skip an element it has already set up: instant
// navigation can keep an element (each widget marks its root with a data attribute).
// mkdocs.yml lists this file before the widgets.
(function () {
  "use strict";

  function onEveryPage(selector, setup) {
    function setupAll() {
      document.querySelectorAll(selector).forEach(setup);
    }
    if (window.document$ && typeof window.document$.subscribe === "function") {
      window.document$.subscribe(setupAll); // on the first load and after every instant navigation
    } else if (document.readyState === "loading") {
      document.addEventListener("DOMContentLoaded", setupAll);
    } else {
      setupAll();
    }
  }

  window.attentionRefWidgets = { onEveryPage: onEveryPage };
})();
