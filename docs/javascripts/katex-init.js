// Typeset the math that pymdownx.arithmatex (generic mode) leaves as \( .. \) and \[ .. \]
// inside .arithmatex elements, with the KaTeX the site serves itself (assets/vendor/katex).
// Material's document$ emits on the first load and after every instant navigation.
document$.subscribe(({ body }) => {
  for (const element of body.querySelectorAll(".arithmatex")) {
    renderMathInElement(element, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: false, // bad TeX is caught by tests/site/test_math.py, not by readers
    });
  }
});
