"""MkDocs hook: what the site needs beyond the Markdown, so that it reads offline from site/index.html.

- The committed studies' and benchmarks' figures join the site from where the report wrote them. Study results
  live outside the site's sources (``studies/``, ``benchmarks/``); pages include their tables with snippets and
  show their figures under the same paths (``studies/reference/ppl_vs_length.png``).
- MathJax joins the site from the ``django-static-mathjax`` package (the ``docs`` extra; MathJax 3's own
  distribution, no Django needed), as ``javascripts/mathjax/tex-svg-full.js``: formulas render with no network.
- Table cells that hold numbers (``29.61 ± 0.37 ~``, ``30.00 †``, ``10,957``, ``n/a``) get the class ``lx-num``, and a table
  whose cells are mostly numbers gets ``data-lx-numeric``; ``stylesheets/extra.css`` keeps those on one line.
  A mean ± std in running text is never split across two lines.
- A page that would load a script, a style sheet, an image or a frame from the network fails the build.
"""

import html
import re
from importlib import metadata
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[1]
RESULT_FOLDERS = ("studies", "benchmarks")

MATHJAX_DIST = "django-static-mathjax"
MATHJAX_ROOT = "mathjax/static/mathjax"  # inside the installed package
MATHJAX_FILES = {  # site path -> path below MATHJAX_ROOT
    "javascripts/mathjax/tex-svg-full.js": "es5/tex-svg-full.js",
    "javascripts/mathjax/LICENSE": "LICENSE",
}


def mathjax_files():
    """{site path: installed file} of MathJax, or a PluginError that says how to install it."""
    try:
        dist = metadata.distribution(MATHJAX_DIST)
    except metadata.PackageNotFoundError:
        raise PluginError(
            f"{MATHJAX_DIST} is not installed: the site bundles MathJax from it (`make install`, or "
            f"`pip install -e '.[docs]'`)"
        ) from None
    found = {site: Path(dist.locate_file(f"{MATHJAX_ROOT}/{src}")) for site, src in MATHJAX_FILES.items()}
    missing = [str(path) for path in found.values() if not path.is_file()]
    if missing:
        raise PluginError(f"{MATHJAX_DIST} {dist.version} lacks {', '.join(missing)} (MathJax 3 expected)")
    return found


def on_files(files, config):
    for folder in RESULT_FOLDERS:
        for path in sorted((REPO / folder).glob("*/*.png")):
            files.append(File.generated(config, path.relative_to(REPO).as_posix(), abs_src_path=str(path)))
    for site, path in mathjax_files().items():
        files.append(File.generated(config, site, abs_src_path=str(path)))
    return files


# A numeric cell is numbers with the signs and units the report and the benchmarks write: "29.61 ± 0.37 ~",
# "**28.07 ± 0.35**", "10,957", "4.0x", "-27%", "n/a", "-", "141.00 ± 8.68 / 35.67 ± 0.13 = 4.0x".
NUMBER_TOKEN = re.compile(r"[~†≈<>=/×*±()]|\+-|[-+−]?\d[\d.,]*(?:%|x|×|e[-+]?\d+)?|n/a|-|–|—|OOM|MB|GB|s|ms|min|h")
TAGS = re.compile(r"<[^>]+>")
TABLE = re.compile(r"<table>(.*?)</table>", re.S)
BODY_CELL = re.compile(r"<td((?:\s[^>]*)?)>(.*?)</td>", re.S)
ROW = re.compile(r"<tr>(.*?)</tr>", re.S)
NUMERIC_SHARE = 0.6  # a table whose body cells (first column aside) are at least this share numeric is numeric


def is_numeric(cell_html):
    text = html.unescape(TAGS.sub("", cell_html)).strip()
    tokens = text.split()
    return (
        bool(tokens)
        and all(NUMBER_TOKEN.fullmatch(token) for token in tokens)
        and any(any(char.isdigit() for char in token) or token in ("n/a", "-", "OOM") for token in tokens)
    )


def mark_cell(match):
    attrs, inner = match.group(1), match.group(2)
    if not is_numeric(inner) or "class=" in attrs:
        return match.group(0)
    return f'<td class="lx-num"{attrs}>{inner}</td>'


def mark_table(match):
    body = match.group(1)
    cells = [cell for row in ROW.findall(body) for cell in BODY_CELL.findall(row)[1:]]
    numeric = sum(is_numeric(inner) for _, inner in cells)
    opening = "<table data-lx-numeric>" if cells and numeric >= NUMERIC_SHARE * len(cells) else "<table>"
    return opening + BODY_CELL.sub(mark_cell, body) + "</table>"


# A mean ± std (or +-) in running text (a sentence, a prose cell) breaks before or after it, never inside: the
# spaces around ± become no-break spaces, in text only (code is copied as written).
PLUS_MINUS = re.compile(r"(\d) (±|\+-) (\d)")
UNTOUCHED = re.compile(r"(<pre\b.*?</pre>|<code\b.*?</code>|<script\b.*?</script>|<[^>]*>)", re.S)


def keep_plus_minus_together(html_text):
    parts = UNTOUCHED.split(html_text)  # odd indices: what is left as is
    return "".join(part if i % 2 else PLUS_MINUS.sub("\\1&nbsp;\\2&nbsp;\\3", part) for i, part in enumerate(parts))


def on_page_content(html_text, page, config, files):
    return keep_plus_minus_together(TABLE.sub(mark_table, html_text))


# What a browser would fetch by itself while showing a page: scripts, style sheets, images, frames, media.
# (Links a reader follows, <a href="https://...">, are not fetched.)
REMOTE_ASSET = re.compile(
    r"<(?:script|img|iframe|source|video|audio|embed)\b[^>]*\bsrc=[\"'](?:https?:)?//[^\"']*"
    r"|<link\b[^>]*\brel=[\"'](?:stylesheet|preload|modulepreload|icon)[\"'][^>]*\bhref=[\"'](?:https?:)?//[^\"']*"
    r"|<link\b[^>]*\bhref=[\"'](?:https?:)?//[^\"']*[\"'][^>]*\brel=[\"'](?:stylesheet|preload|modulepreload|icon)",
    re.I,
)


def on_post_page(output, page, config):
    remote = REMOTE_ASSET.findall(output)
    if remote:
        raise PluginError(
            f"{page.file.src_uri} loads from the network, which the site must not need (README: it reads "
            f"offline): {'; '.join(sorted(set(remote))[:3])}"
        )
    return output
