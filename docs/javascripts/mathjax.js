// MathJax reads the formulas pymdownx.arithmatex marks (\( \) inline, \[ \] and $$ displayed).
// MathJax itself (tex-svg-full.js, MathJax 3) is copied into the site by docs/hooks.py from the
// django-static-mathjax package, so formulas render with no network. SVG output draws every glyph as a path, so
// it needs no font files (which Firefox, for one, refuses to a page opened from file://, as site/index.html is),
// and "full" holds every TeX extension: the one file is all MathJax loads.
window.MathJax = {
  tex: { inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]], processEscapes: true, processEnvironments: true },
  svg: { fontCache: "global" },
  options: { ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex" },
  startup: {
    // MathJax typesets the page once it has loaded; material's document$ then also fires for every page it
    // swaps in (instant navigation), and on its replay of this one, which finds nothing left to typeset.
    pageReady: () => MathJax.startup.defaultPageReady().then(() => {
      document$.subscribe(() => {
        const pending = [...document.querySelectorAll(".arithmatex")].filter((e) => !e.querySelector("mjx-container"));
        if (!pending.length) return;
        MathJax.startup.output.clearCache();
        MathJax.typesetClear();
        MathJax.texReset();
        MathJax.typesetPromise();
      });
    }),
  },
};
