// Figures and diagrams never shrink below the width at which their text stays readable (9 px; the
// width is set per figure by attention_ref.viz or attention_ref.diagrams and applied in the CSS), and formulas keep their size.
// Where one is wider than the column it scrolls inside its own box: mark that box, so the page
// says so under it (extra.css). Marked again when the box resizes and once the fonts have
// loaded (KaTeX's fonts widen a formula without resizing its box). Material's document$ emits
// on the first load and after every instant navigation.
(() => {
  const WIDE = "figure.ar-figure-box, .md-typeset div.ar-diagram-box, .md-typeset div.arithmatex";
  const mark = (box) => box.classList.toggle("ar-wide", box.scrollWidth > box.clientWidth + 1);
  const watcher = new ResizeObserver((entries) => entries.forEach((e) => mark(e.target)));
  document$.subscribe(({ body }) => {
    const boxes = [...body.querySelectorAll(WIDE)];
    boxes.forEach((box) => {
      mark(box);
      watcher.observe(box);
    });
    document.fonts.ready.then(() => boxes.forEach(mark));
  });
})();
