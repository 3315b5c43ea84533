"""Formulas in the book's markdown, rendered to MathML when the book is built (nothing is fetched at view time).

    inline:   the ring sends $\\frac{2(W-1)}{W}N$ bytes per rank     (no space just inside the dollar signs)
    display:  a paragraph of its own, opened and closed by a line holding only $$ (indentation kept, so a
              formula can sit inside an admonition), or $$ ... $$ on one line

Code (fenced blocks, `inline code`) and HTML comments are left alone, so a shell prompt `$ python x.py` in a code
block is never taken for math. Browsers render MathML natively (Chromium since version 109, Firefox, Safari);
`latex2mathml` writes it from a LaTeX subset (fractions, sums, sub/superscripts, Greek letters, \\text, \\lceil).

    python scripts/book_math.py FILE.md     # print FILE.md with its formulas rendered (to see what the build does)

A formula latex2mathml cannot read fails the build with its text (BookMathError), instead of showing raw LaTeX.
"""
from __future__ import annotations

import re
import sys

FENCE_RE = re.compile(r"^(\s*)(```+|~~~+)")
CODE_SPAN_RE = re.compile(r"(`+)(?:.+?)\1|<!--.*?-->")
INLINE_RE = re.compile(r"(?<![\\\w$])\$(?=[^\s$])([^$\n]*?[^\s\\$])\$(?![\w$])")
ONE_LINE_DISPLAY_RE = re.compile(r"^(\s*)\$\$(.+)\$\$\s*$")
TEXT_NODE_RE = re.compile(r">([^<]+)<")
MARKDOWN_SPECIAL = {"*": "&#42;", "_": "&#95;", "`": "&#96;", "[": "&#91;", "]": "&#93;", "\\": "&#92;",
                    "$": "&#36;"}


class BookMathError(ValueError):
    """A formula that could not be converted: the build names it and stops."""


def to_mathml(latex: str, display: bool = False) -> str:
    """One formula as a single line of MathML whose text nodes cannot be read as markdown (*, _, ` escaped)."""
    from latex2mathml.converter import convert

    try:
        out = convert(latex.strip(), display="block" if display else "inline")
    except Exception as exc:  # latex2mathml raises several exception types for bad input
        raise BookMathError(f"cannot render formula ${latex}$: {exc}") from exc
    out = TEXT_NODE_RE.sub(lambda m: ">" + "".join(MARKDOWN_SPECIAL.get(c, c) for c in m.group(1)) + "<", out)
    return out.replace("\n", "")


def render_inline(line: str) -> str:
    """`$...$` outside code spans and comments -> inline MathML."""
    out, last = [], 0
    for m in CODE_SPAN_RE.finditer(line):
        out.append(INLINE_RE.sub(lambda f: to_mathml(f.group(1)), line[last:m.start()]))
        out.append(m.group())
        last = m.end()
    out.append(INLINE_RE.sub(lambda f: to_mathml(f.group(1)), line[last:]))
    return "".join(out)


def render(text: str) -> str:
    """Every formula in a markdown page rendered; fences and code spans untouched."""
    lines, out, fence, i = text.split("\n"), [], None, 0
    while i < len(lines):
        line = lines[i]
        m = FENCE_RE.match(line)
        if m:
            if fence is None:
                fence = m.group(2)
            elif m.group(2).startswith(fence[0]) and len(m.group(2)) >= len(fence):
                fence = None
            out.append(line)
            i += 1
            continue
        if fence is not None:
            out.append(line)
            i += 1
            continue
        if line.strip() == "$$":
            indent = line[: len(line) - len(line.lstrip())]
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "$$"), None)
            if end is None:
                raise BookMathError(f"line {i + 1}: a display formula opened with $$ is never closed")
            out.append(indent + to_mathml("\n".join(lines[i + 1:end]), display=True))
            i = end + 1
            continue
        one = ONE_LINE_DISPLAY_RE.match(line)
        if one and "$" not in one.group(2):
            out.append(one.group(1) + to_mathml(one.group(2), display=True))
        else:
            out.append(render_inline(line))
        i += 1
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/book_math.py FILE.md", file=sys.stderr)
        return 2
    try:
        with open(argv[0], encoding="utf-8") as f:
            print(render(f.read()))
    except (OSError, BookMathError) as exc:
        print(f"book_math.py: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
