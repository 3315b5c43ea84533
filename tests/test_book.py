"""The executed book: markers become real outputs and figures, broken runs break the build, the site works.

Unit tests build a tiny fixture repo under tmp_path (one part, one chapter, one contract-abiding script).
The `book` test builds the real book with --smoke and opens it in headless Chromium:

    python -m pytest tests/test_book.py -q               # all (about 1 min on 2 cores, more on a cold cache)
    python -m pytest tests/test_book.py -q -m "not book"  # fixture book only (about 20 s)
"""
from __future__ import annotations

import functools
import html
import http.server
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "scripts" / "build_book.py"
CHAPTER = "tutorial/part1-distributed/chapter01-demo"

DEMO_SCRIPT = '''\
"""Demo: every rank says hello, and one bar per rank is drawn.

    python tutorial/part1-distributed/chapter01-demo/scripts/demo.py -w 3

Try next
    python tutorial/part1-distributed/chapter01-demo/scripts/demo.py -w 5
        -> five ranks say hello
"""
import argparse, json, sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot-dir", type=Path)
    p.add_argument("-w", "--world-size", type=int, default=2)
    p.add_argument("--fail", action="store_true")
    args = p.parse_args()
    # --8<-- [start:greet]
    for rank in range(args.world_size):
        print(f"[rank {rank}] hello from rank {rank} of {args.world_size}")
    # --8<-- [end:greet]
    if args.fail:
        print("rank 1 gave up", file=sys.stderr)
        return 3
    if args.plot_dir:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(3, 2))
        ax.bar(range(args.world_size), [1] * args.world_size)
        fig.savefig(args.plot_dir / "ranks.png")
        from PIL import Image   # an animation and its strip of frames, as mlsys.plot.animate writes them
        frames = [Image.new("RGB", (8, 8), (40 * i, 0, 0)) for i in range(3)]
        frames[0].save(args.plot_dir / "steps.gif", save_all=True, append_images=frames[1:])
        frames[0].save(args.plot_dir / "steps_strip.png")
        (args.plot_dir / "demo.trace.json").write_text(json.dumps({"traceEvents": [
            {"ph": "X", "name": "allreduce", "cat": "comm", "ts": 10, "dur": 5, "tid": 2}]}))
    if args.json:
        rows = [{"rank": r, "square": r * r} for r in range(args.world_size)]
        args.json.write_text(json.dumps({"results": {"world_size": args.world_size, "smoke": args.smoke,
                                                     "rows": rows, "ratio": 2 / 3}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''

DEMO_README = f'''\
# Chapter 1 — Demo

<!-- run: scripts/demo.py -w 3 -->

```python
--8<-- "{CHAPTER}/scripts/demo.py:greet"
```

<!-- figure: demo/ranks.png "One bar per rank" -->

Three ranks ran: <!-- value: demo world_size run="-w 3" -->, the last square is
<!-- value: demo rows[rank=2].square run="-w 3" -->, a ratio of <!-- value: demo ratio .1% -->.

<!-- figure: demo/ranks.png "Five bars" run="-w 5" -->

<!-- run: scripts/demo.py --fail expect=3 -->

<!-- figure: demo/steps.gif "The steps, animated" -->

Read [the script](scripts/demo.py), then [chapter 2](../chapter02-stub/README.md).
''' + r'''
Each rank sends $\frac{2(W-1)}{W}N$ bytes, and `$ python demo.py` stays code:

$$
t = 2(W-1)\,\alpha + \frac{2(W-1)}{W}\,\frac{N}{\beta}
$$
'''


def make_repo(root: Path, readme: str = DEMO_README) -> Path:
    chapter = root / CHAPTER
    (chapter / "scripts").mkdir(parents=True)
    (chapter / "scripts" / "demo.py").write_text(DEMO_SCRIPT)
    (chapter / "README.md").write_text(readme)
    stub = root / "tutorial/part1-distributed/chapter02-stub"     # a chapter with only a README, no h1
    stub.mkdir()
    (stub / "README.md").write_text("Coming soon.\n")
    (root / "book" / "pages").mkdir(parents=True)
    (root / "book" / "pages" / "index.md").write_text("# Fixture book\n\n<!-- contents -->\n")
    return root


def page_text(html_file: Path) -> str:
    """The text of a built page, tags stripped (highlighted code is split into many spans)."""
    return html.unescape(re.sub(r"<[^>]+>", "", html_file.read_text(encoding="utf-8")))


def build(root: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BUILD), "--root", str(root), *flags], cwd=REPO, text=True,
                          capture_output=True, timeout=240, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def fixture_book(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    root = make_repo(tmp_path_factory.mktemp("book"))
    return root, build(root, "--smoke")


def test_lesson_shows_captured_output_and_figure(fixture_book):
    root, result = fixture_book
    assert result.returncode == 0, result.stderr
    lesson = (root / "book/docs/chapter01-demo/index.md").read_text()
    # the command as it ran: the build adds --json and --plot-dir, so the figure and values come from this run
    assert (f"$ python {CHAPTER}/scripts/demo.py -w 3 --json /tmp/demo.json --plot-dir /tmp/demo_figures --smoke"
            "\n[rank 0] hello") in lesson
    assert "[rank 2] hello from rank 2 of 3" in lesson
    assert "![One bar per rank](figures/demo/ranks.png)" in lesson
    assert "rank 1 gave up\n[exit code 3]" in lesson          # expect=3: shown, not fatal
    assert "[the script](demo.md)" in lesson and "Scripts in this chapter" not in lesson
    assert "[chapter 2](../chapter02-stub/index.md)" in lesson
    assert (root / "book/docs/chapter02-stub/index.md").read_text().startswith("# Chapter 2: stub")
    assert (root / "book/site/chapter01-demo/figures/demo/ranks.png").stat().st_size > 0
    page = page_text(root / "book/site/chapter01-demo/index.html")
    assert "for rank in range(args.world_size):" in page and "--8<--" not in page   # the snippet section
    assert "Book built:" in result.stdout
    assert "Three ranks ran: 3, the last square is\n4, a ratio of 66.7%." in lesson
    assert "![Five bars](figures/demo@-w_5/ranks.png)" in lesson
    assert (root / "book/docs/chapter01-demo/figures/demo@-w_5/ranks.png").stat().st_size > 0
    # one run per configuration: the lesson's -w 3 run, the default run (page), the -w 5 run, the failing run
    runs = [line for line in result.stdout.splitlines() if line.startswith("[run]")]
    assert len(runs) == len(set(runs)) == 4, result.stdout   # printed once each
    assert "the five slowest runs" in result.stdout


def test_value_marker_with_a_missing_path_fails_the_full_build(tmp_path):
    root = make_repo(tmp_path, DEMO_README.replace("rows[rank=2].square", "rows[rank=9].square"))
    result = build(root)
    assert result.returncode == 1
    assert "no row with rank=9" in result.stderr


def test_recorded_marker_reads_the_chapter_folders_json_and_refuses_bad_paths(tmp_path):
    """`<!-- recorded: FILE PATH [FORMAT] -->`: a value from a recorded run's JSON in the chapter folder; a path
    that is not in the JSON, or a file outside the chapter folder, fails the build with a BuildError."""
    import json

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import build_book
    finally:
        sys.path.remove(str(REPO / "scripts"))
    chapter = tmp_path / "chapter99-x"
    (chapter / "results/gpu").mkdir(parents=True)
    (chapter / "results/gpu/run.json").write_text(json.dumps(
        {"settings": {"iters": 3}, "results": {"rows": [{"B": 1, "step ms": 2.6085}, {"B": 8, "step ms": 1.85}],
                                               "launches": {"kernels": ["k0", "k1", "k2"]}}}))
    (tmp_path / "outside.json").write_text(json.dumps({"results": {"x": 1}}))

    def recorded(spec: str) -> str:
        return build_book.recorded_md(chapter, "chapter99-x", spec)

    assert recorded('results/gpu/run.json "rows.0.step ms" .2f') == "2.61"       # looked up in "results"
    assert recorded("results/gpu/run.json rows[B=8].B") == "8"
    assert recorded("results/gpu/run.json launches.kernels.#") == "3"           # a list's length
    for bad, why in (("results/gpu/run.json rows.0.nope", "no key `nope`"),
                     ("results/gpu/run.json rows.5.B", "out of range"),
                     ("results/gpu/missing.json rows.0.B", "No such file"),
                     ("results/gpu/run.json", "wants `file.json path [format]`"),
                     ("../outside.json x", "inside the chapter folder"),
                     (f"{tmp_path / 'outside.json'} x", "inside the chapter folder")):
        with pytest.raises(build_book.BuildError, match=re.escape(why)):
            recorded(bad)


def test_script_page_has_docstring_source_output_results(fixture_book):
    root, _ = fixture_book
    page = (root / "book/docs/chapter01-demo/demo.md").read_text()
    assert page.startswith("# demo.py")
    assert "Demo: every rank says hello" in page
    assert f'--8<-- "{CHAPTER}/scripts/demo.py"' in page
    assert "--json /tmp/demo.json --plot-dir /tmp/demo_figures --smoke" in page
    assert '"world_size": 2' in page and "figures/demo/ranks.png" in page
    assert "One bar per rank" in page and "Five bars" not in page  # the lesson's caption of this (default) run
    assert "def main() -> int:" in page_text(root / "book/site/chapter01-demo/demo.html")


def test_formulas_become_mathml_and_code_keeps_its_dollars(fixture_book):
    root, result = fixture_book
    assert result.returncode == 0, result.stderr
    page = (root / "book/site/chapter01-demo/index.html").read_text(encoding="utf-8")
    assert page.count("<math") == 2 and 'display="block"' in page and "<mfrac>" in page
    text = page_text(root / "book/site/chapter01-demo/index.html")
    assert "$ python demo.py" in text                        # a code span is left alone
    assert not re.search(r"\$[^$\n]+\$", text.replace("$ python demo.py", "")), "raw $...$ left on the page"


def test_an_animation_shows_its_strip_and_a_trace_is_linked(fixture_book):
    root, _ = fixture_book
    lesson = (root / "book/docs/chapter01-demo/index.md").read_text()
    assert "figures/demo/steps.gif" in lesson and "figures/demo/steps_strip.png" in lesson
    assert (root / "book/site/chapter01-demo/figures/demo/steps_strip.png").is_file()
    script_page = (root / "book/docs/chapter01-demo/demo.md").read_text()
    assert "figures/demo/demo.trace.json" in script_page
    assert (root / "book/site/chapter01-demo/figures/demo/demo.trace.json").is_file()
    assert script_page.count("five ranks say hello") == 1     # the run sheet's "Try next" is shown once


def test_book_math_leaves_code_alone_escapes_markdown_and_refuses_bad_latex():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import book_math
    finally:
        sys.path.remove(str(REPO / "scripts"))
    text = "```text\n$ echo $HOME$\n```\nsee `$x$` and $a_i * b_i$ and costs 5$ or $ 3 $\n    $$\n    x^2\n    $$"
    out = book_math.render(text).split("\n")
    assert out[:3] == ["```text", "$ echo $HOME$", "```"]
    assert "`$x$`" in out[3] and out[3].count("<math") == 1 and "5$ or $ 3 $" in out[3]
    assert "*" not in out[3].split("<math")[1].split("</math>")[0]
    assert out[4].startswith("    <math") and 'display="block"' in out[4]
    with pytest.raises(book_math.BookMathError):
        book_math.render("$$\nx^2\n")                     # never closed


def test_second_build_is_served_from_the_cache(fixture_book):
    root, _ = fixture_book
    result = build(root, "--smoke")
    assert result.returncode == 0, result.stderr
    runs = [line for line in result.stdout.splitlines() if line.startswith("[run]")]
    assert runs and all(line.endswith("(cached)") for line in runs), result.stdout


def test_failing_run_fails_the_build_and_names_the_command(tmp_path):
    root = make_repo(tmp_path, DEMO_README.replace("--fail expect=3", "--fail"))
    result = build(root, "--smoke")
    assert result.returncode == 1
    assert (f"`python {CHAPTER}/scripts/demo.py --fail --json /tmp/demo.json --plot-dir /tmp/demo_figures --smoke`"
            " exited 3 (expected 0)") in result.stderr
    assert "rank 1 gave up" in result.stderr


def test_missing_snippet_section_fails_strict_build(tmp_path):
    root = make_repo(tmp_path, DEMO_README.replace(":greet", ":no_such_section"))
    result = build(root, "--smoke")
    assert result.returncode == 1
    assert "no_such_section" in result.stderr


def test_no_run_uses_placeholders(tmp_path):
    root = make_repo(tmp_path)
    result = build(root, "--no-run")
    assert result.returncode == 0, result.stderr
    assert "[run]" not in result.stdout
    assert '!!! note "Not run"' in (root / "book/docs/chapter01-demo/index.md").read_text()


def test_bad_flag_exits_2_with_one_line(tmp_path):
    result = build(make_repo(tmp_path), "--no-such-flag")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "--no-such-flag" in result.stderr


# ---- the real book, in a browser --------------------------------------------------------------------------
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
CH01 = REPO / "tutorial/part1-distributed/chapter01-first-program"


def serve(site: Path) -> http.server.ThreadingHTTPServer:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def chromium(profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", "--window-size=1280,1000", f"--user-data-dir={profile}"]:
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))


@pytest.mark.book
@pytest.mark.browser
@pytest.mark.timeout(300)
def test_real_book_renders_in_a_browser(tmp_path):
    """The book `make book` just built (book/site), opened in headless Chromium: chapter 1's title, a page whose
    figure loads, and search. `make book` runs this after the build; `make test` leaves it out."""
    for tool in (CHROMIUM, CHROMEDRIVER):
        if not tool.exists():
            message = f"{tool} is not installed (make browser, or apt-get install chromium chromium-driver)"
            if os.environ.get("MLSYS_REQUIRE_BROWSER") == "1":  # set by .ci/run: in CI this test must run
                pytest.fail(message)
            pytest.skip(message)
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    docs, site = REPO / "book" / "docs", REPO / "book" / "site"
    if not (site / "index.html").exists() or not (docs / CH01.name / "index.md").exists():
        if os.environ.get("MLSYS_REQUIRE_BROWSER") == "1":
            pytest.fail("book/site is not built: run make book")
        pytest.skip("book/site is not built: run make book")
    title = re.search(r"^# +(.+)$", (docs / CH01.name / "index.md").read_text(), re.M).group(1)
    pages_with_images = sorted(p for p in site.rglob("*.html") if "<img " in p.read_text(encoding="utf-8"))
    assert pages_with_images, "no page of the built book shows a figure"
    pages_with_math = sorted(p for p in site.rglob("*.html") if "<math " in p.read_text(encoding="utf-8"))
    assert pages_with_math, "no page of the built book shows a formula"
    for page in site.rglob("*.html"):     # every formula was rendered at build time: no raw $...$ left in prose
        prose = re.sub(r"<(pre|code|script|style)\b.*?</\1>", "", page.read_text(encoding="utf-8"), flags=re.S)
        raw = re.search(r"(?<![\w$])\$(?=\S)[^$<>\n]*?\S\$(?![\w$])", html.unescape(re.sub(r"<[^>]+>", " ", prose)))
        assert raw is None, f"{page.relative_to(site)}: raw formula {raw.group()!r} left unrendered"
        for block in re.findall(r"<pre\b.*?</pre>", page.read_text(encoding="utf-8"), flags=re.S):
            # markdown shown as code: a line at column 0 inside a `???` block ends it early, and the rest of the
            # block turns into one literal code block with its fences, headings and comments in plain view
            leaked = re.search(r"^\s*(?:```|~~~|--8<--|<!--|#{2,6} |\?\?\?|!!! ).*", html.unescape(
                re.sub(r"<[^>]+>", "", block)), re.M)
            assert leaked is None, f"{page.relative_to(site)}: markdown rendered as code: {leaked.group()!r}"

    server, driver = serve(site), chromium(tmp_path / "chrome-profile")
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        driver.get(f"{base}/{CH01.name}/index.html")
        h1 = driver.find_element(By.CSS_SELECTOR, "article h1").text.replace("¶", "").strip()
        assert h1 == title.replace("`", ""), (h1, title)

        driver.get(f"{base}/{pages_with_images[0].relative_to(site).as_posix()}")
        loaded = "return [...document.images].filter(i => i.complete && i.naturalWidth > 0).length"
        WebDriverWait(driver, 20).until(lambda d: d.execute_script(loaded) > 0)

        driver.get(f"{base}/{pages_with_math[0].relative_to(site).as_posix()}")   # MathML laid out, not raw
        box = driver.execute_script("const m = document.querySelector('article math'); if (!m) return null; "
                                    "const r = m.getBoundingClientRect(); return [m.namespaceURI, r.width, r.height,"
                                    " getComputedStyle(m).display];")
        assert box and box[0] == "http://www.w3.org/1998/Math/MathML" and box[1] > 0 and box[2] > 0, box
        assert "math" in box[3], f"the browser does not lay MathML out as math: display is {box[3]!r}"

        driver.get(f"{base}/index.html")
        search = driver.find_element(By.CSS_SELECTOR, "input.md-search__input")
        search.click()
        search.send_keys("rank")
        WebDriverWait(driver, 30).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item"))
    finally:
        driver.quit()
        server.shutdown()


def test_only_runs_the_chosen_chapter(tmp_path):
    root = make_repo(tmp_path)
    result = build(root, "--smoke", "--only", "chapter99")
    assert result.returncode == 0, result.stderr
    assert "[run]" not in result.stdout
    assert '!!! note "Not run"' in (root / "book/docs/chapter01-demo/index.md").read_text()


def test_lessons_quote_no_hand_typed_measurement_and_every_snippet_section_is_included():
    """Numbers that depend on the machine come from runs (value markers); no snippet section is dead."""
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "check_lessons.py")], cwd=REPO, text=True,
                            capture_output=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def import_check_lessons():
    """scripts/check_lessons.py as a module (scripts/ is not a package)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import check_lessons
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return check_lessons


def test_lesson_checker_flags_a_line_that_ends_a_collapsed_block_early(tmp_path, monkeypatch):
    """Chapter 12's value-clipping note broke this way: its second line started at column 0."""
    check_lessons = import_check_lessons()
    lesson = tmp_path / "README.md"
    lesson.write_text('??? note "Under the hood"\n\n    A sentence that goes on\n[a link](x) here.\n\n    ```python\n'
                      "x = 1\n    ```\n\nA paragraph after the block.\n\n!!! tip\n    fine\n\nNext.\n"
                      "```text\n    indented output\nflush output\n```\n")
    monkeypatch.setattr(check_lessons, "REPO", tmp_path)
    assert [int(f.split(":")[1]) for f in check_lessons.broken_blocks(lesson)] == [4]


def test_lesson_checker_flags_a_typed_time_and_an_orphan(tmp_path, monkeypatch):
    check_lessons = import_check_lessons()
    lesson = tmp_path / "tutorial/part1-x/chapter01-x/README.md"
    lesson.parent.mkdir(parents=True)
    lesson.write_text("The step took 12.5 ms and ran at 3.1 GB/s, 1.42x faster.\n"
                      "NVLink gives 900 GB/s <!-- typed: H100 spec sheet -->\n"
                      "`12.5 ms` in code, and <!-- value: x t .1f --> ms from a run.\n"
                      "```text\n7.5 ms in an output block\n```\n")
    monkeypatch.setattr(check_lessons, "REPO", tmp_path)
    found = check_lessons.hand_typed(lesson)
    assert [f.split("`")[1] for f in found] == ["12.5 ms", "3.1 GB/s", "1.42x"], found
    # the forms a review found slipping through, each on its own line; a `typed:` marker covers what precedes it
    forms = ["it took 3.7 milliseconds", "in about 40 s", "2x faster than eager", "1.4 times faster",
             "a share of 37%", "1,234 tokens per second", "a speed-up of 1.42", "$t = 3.7\\,\\text{ms}$",
             "fine: 16 GB/s <!-- typed: spec --> but 12.5 ms after the marker"]
    lesson.write_text("\n".join(forms) + "\nnot measured: a timeout of 30 s, 40 requests per second, 8 ranks, 10%\n")
    found = check_lessons.hand_typed(lesson)
    assert [int(f.split(":")[1]) for f in found] == list(range(1, len(forms) + 1)), found
    assert "12.5 ms" in found[-1] and "16 GB/s" not in found[-1]
    script = tmp_path / "tutorial/part1-x/chapter01-x/scripts/s.py"
    script.parent.mkdir()
    script.write_text('"""One line.\n\nIt ran in about 40 s here.\n'
                      'Runtime on 2 cores: about 5 s,\n    3 s with --smoke.\n"""\n')
    assert [f.split(":")[1] for f in check_lessons.docstring_typed(script)] == ["3"]
    script = tmp_path / "mlsys/m.py"
    script.parent.mkdir()
    script.write_text("# --8<-- [start:used]\n# --8<-- [end:used]\n# --8<-- [start:dead]\n# --8<-- [end:dead]\n")
    lesson.write_text('--8<-- "mlsys/m.py:used"\n')
    assert [o.split("`")[1] for o in check_lessons.orphan_sections(tmp_path)] == ["dead"]
    # terms: used before the bold introduction -> warned; a later chapter may use what an earlier one introduced
    (tmp_path / "book/pages").mkdir(parents=True)
    (tmp_path / "book/pages/glossary.md").write_text("### KV cache\n\nx\n\n### TTFT / ITL\n\ny\n")
    lesson.write_text("# The KV cache\nThe KV cache grows.\n\nA **KV cache** holds keys. TTFT is [TTFT](g)\n")
    later = tmp_path / "tutorial/part1-x/chapter02-y/README.md"
    later.parent.mkdir(parents=True)
    later.write_text("The KV caches again, and [ITL](../../book/pages/glossary.md#ttft).\n")
    warned = check_lessons.term_warnings(tmp_path, [lesson, later])
    assert [(w.split(":")[0].split("/")[-2], w.split(":")[1], w.split("`")[1]) for w in warned] == [
        ("chapter01-x", "2", "KV cache"), ("chapter01-x", "4", "TTFT / ITL")], warned


def test_glossary_entries_point_at_the_section_that_explains_them(tmp_path):
    """Each glossary entry without a chapter link gets one: where a lesson first writes the term in bold, under the
    id mkdocs gives that section's heading, and where an earlier chapter first names it (bold or a glossary link);
    exercises and Try next name terms without teaching them and do not count."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import build_book
        import check_lessons
    finally:
        sys.path.remove(str(REPO / "scripts"))
    (tmp_path / "book/pages").mkdir(parents=True)
    glossary = ("# Glossary\n\n## Serving\n\n### KV cache\n\nKeys.\n\n### TTFT / ITL\n\nTime.\n\n"
                "### Prefill\n\nFirst pass, [Chapter 1](chapter01-x/index.md#a).\n\n### Nat\n\nUnit.\n")
    (tmp_path / "book/pages/glossary.md").write_text(glossary)
    one = tmp_path / "tutorial/part1-x/chapter01-x/README.md"
    two = tmp_path / "tutorial/part1-x/chapter02-y/README.md"
    for lesson in (one, two):
        lesson.parent.mkdir(parents=True)
    one.write_text("# One\n\nThe [KV cache](../../book/pages/glossary.md#kv-cache) comes later.\n\n"
                   "## Exercises\n\nCompute the **TTFT**.\n")
    two.write_text("# Two\n\nIntro.\n\n## The `KV cache`, in one page\n\n```text\n## not a heading\n```\n\n"
                   "A **KV cache** holds keys. The **TTFT** is ...\n\n## Try next\n\nIn **nats**.\n")
    intros = check_lessons.term_introductions(tmp_path, [one, two])
    assert intros["KV cache"] == {"explained": (two, "the-kv-cache-in-one-page"), "mentioned": (one, "")}
    assert intros["TTFT / ITL"] == {"explained": (two, "the-kv-cache-in-one-page"),
                                    "mentioned": (two, "the-kv-cache-in-one-page")}
    assert "Nat" not in intros  # only in Try next
    chapters = {one: build_book.load_chapter(one.parent), two: build_book.load_chapter(two.parent)}
    page = build_book.glossary_with_chapters(glossary, intros, chapters)
    entries = {e.split("\n", 1)[0]: e for e in page.split("### ")[1:]}
    assert ("*Explained in [Chapter 2](chapter02-y/index.md#the-kv-cache-in-one-page); first mentioned in "
            "[Chapter 1](chapter01-x/index.md).*") in entries["KV cache"]
    assert "*Explained in [Chapter 2](chapter02-y/index.md#the-kv-cache-in-one-page).*" in entries["TTFT / ITL"]
    assert "Explained" not in entries["Prefill"] and "Explained" not in entries["Nat"]  # linked already / untaught
