"""Build the executed book: run every chapter script, capture what it prints, render the site with mkdocs.

Each chapter's README.md becomes a page. Markers in it are HTML comments (GitHub hides them), expanded here:

    <!-- run: scripts/hello_distributed.py -w 4 -->        the command and its real stdout+stderr, as text
    <!-- run: torchrun --nproc-per-node 2 scripts/x.py -->  the same, launched by torchrun
    <!-- run: scripts/x.py --world-size 0 expect=2 -->     a run that must exit 2 (any other code fails)
    <!-- figure: hello_distributed/placement.png "Caption" -->  a PNG that scripts/hello_distributed.py wrote
                                                           into its --plot-dir during its default run
    <!-- figure: x/name.png "Caption" run="-w 8" -->       ... during its run with these arguments
    <!-- value: x results.path .2f -->                     a value from the --json of x.py's default run
    <!-- value: x rows[size=1024].busbw .1f run="-w 8" -->  ... of its run with these arguments
    <!-- recorded: results/h200/x.json rows.0.ms .2f -->   a value from a recorded run kept as data in the
                                                           chapter folder (a GPU run: CI has no GPU), not re-run;
                                                           a path ending in `.#` gives a list's length
    <!-- contents -->                                      (book/pages/*.md only) the parts and chapters

Code is included from the real files by pymdownx.snippets (`--8<-- "tutorial/.../x.py:section"`, from the repo
root). Every script gets a page: docstring, full source, the output of a default run, its JSON results and
figures.

One run per configuration: every run (expect=0) gets `--json` and, when the script draws, `--plot-dir`, so a
lesson's `run:` marker, its `figure:` and `value:` markers and the script page all read the same run of a given
(script, arguments): the text, the numbers in it and the figure beneath cannot come from different runs. Runs
are cached in .cache/book-runs/<key>/, keyed by the command, the sources of the chapter and of mlsys/, the
trained weights and requirements/constraints.txt; each configuration's figures go to their own folder.

    make book                                # = python scripts/build_book.py  (full sizes)
    python scripts/build_book.py --smoke     # every script with --smoke: the fast build the tests use
    python scripts/build_book.py --no-run    # prose edits: cached outputs, placeholders for the rest
    python scripts/build_book.py --smoke --only chapter01   # run one chapter's scripts, the rest as --no-run

Exit 0 built; 1 a run failed (the message names the command) or mkdocs --strict refused the site; 2 bad flags.
Runtime on 2 cores: the runs (a few seconds per script with --smoke) plus about 2 s; about 3 s when cached.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import html
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import book_math  # scripts/ is not a package: the formula renderer sits beside this file

REPO = Path(__file__).resolve().parents[1]
PART_TITLES = {1: "Part I — Distributed foundations", 2: "Part II — Parallelism",
               3: "Part III — Inference", 4: "Part IV — RLHF"}
RUN_RE = re.compile(r"<!--\s*run:\s*(.*?)\s*-->")
FIGURE_RE = re.compile(r'<!--\s*figure:\s*(\S+)\s+"([^"]*)"(?:\s+run="([^"]*)")?\s*-->')
VALUE_RE = re.compile(r'<!--\s*value:\s*(.*?)(?:\s+run="([^"]*)")?\s*-->')
RECORDED_RE = re.compile(r"<!--\s*recorded:\s*(.*?)\s*-->")
RUNTIME_RE = re.compile(r"Runtime on 2 (?:idle )?cores:\s*about\s+(\d+(?:\.\d+)?)(?:\s*-\s*(\d+(?:\.\d+)?))?\s*s\b")
CONTENTS_RE = re.compile(r"<!--\s*contents\s*-->")
LINK_RE = re.compile(r"(\]\()([^)\s]+)(\))")
ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
LAUNCHERS = ("python", "torchrun")
GENERATED_MARK = ".generated-by-build_book"   # mkdocs skips dotfiles; its presence lets us wipe --docs


class BuildError(Exception):
    """A failed run, a missing figure or a refused site: the build stops with exit 1."""


@dataclass
class Settings:
    root: Path       # repo root holding tutorial/, mlsys/, book/pages/ (tests pass a fixture root)
    docs: Path       # generated mkdocs source tree, wiped and rewritten on every build
    out: Path        # the built site
    smoke: bool      # append --smoke to every run: tiny sizes, fast build
    no_run: bool     # run nothing: cached outputs where there are some, placeholders elsewhere
    timeout: float   # seconds one run may take before the build fails
    only: str = ""   # run only chapters whose folder name contains this; the others are built as with no_run


@dataclass
class Chapter:
    path: Path
    slug: str            # folder name: the lesson is <slug>/index.md, figures go to <slug>/figures/<script>/
    title: str           # the README's h1, or one made from the folder name
    readme: str          # the lesson, with an h1 added where it had none
    scripts: list[Path]  # scripts/*.py, without the _helpers


@dataclass
class Run:
    dir: Path        # its cache entry: run.json, <stem>.json, <stem>_figures/
    shown: str       # the command as a reader types it at the repo root
    output: str
    seconds: float
    rc: int
    cached: bool = False


def number(path: Path) -> int:
    m = re.search(r"\d+", path.name)
    return int(m.group()) if m else 0


def load_chapter(path: Path) -> Chapter:
    readme = (path / "README.md").read_text(encoding="utf-8") if (path / "README.md").exists() else ""
    m = re.search(r"^# +(.+?)\s*$", readme, re.M)
    title = m.group(1) if m else f"Chapter {number(path)}: " + path.name.split("-", 1)[-1].replace("-", " ")
    scripts = lesson_order(readme, sorted(s for s in (path / "scripts").glob("*.py") if not s.name.startswith("_")))
    return Chapter(path, path.name, title, readme if m else f"# {title}\n\n{readme}", scripts)


ABRIDGE_ITEMS = 6


def abridge(obj, depth: int = 0):
    """A JSON document cut to what a page can show: lists to their first few items (and a count of the rest),
    long strings to 200 characters, nesting to 5 levels. Key results sit near the top and survive."""
    if isinstance(obj, dict):
        return {k: abridge(v, depth + 1) for k, v in obj.items()} if depth < 5 else f"{{{len(obj)} keys}}"
    if isinstance(obj, list):
        items = [abridge(v, depth + 1) for v in obj[:ABRIDGE_ITEMS]]
        return items + ([f"... {len(obj) - ABRIDGE_ITEMS} more"] if len(obj) > ABRIDGE_ITEMS else [])
    if isinstance(obj, str) and len(obj) > 200:
        return obj[:200] + "..."
    return obj


def docstring_section(doc: str, title: str) -> str:
    """The indented block under a line `title` in a script's docstring (its run sheet), dedented; "" if none."""
    lines, body, inside = doc.splitlines(), [], False
    for line in lines:
        if line.strip() == title and not line.startswith(" "):
            inside = True
            continue
        if inside:
            if line and not line.startswith(" "):
                break
            body.append(line)
    return textwrap.dedent("\n".join(body)).strip("\n")


def without_section(doc: str, title: str) -> str:
    """`doc` without the line `title` and the indented block under it (see docstring_section)."""
    kept, skipping = [], False
    for line in doc.splitlines():
        if line.strip() == title and not line.startswith(" "):
            skipping = True
            continue
        if skipping and line and not line.startswith(" "):
            skipping = False
        if not skipping:
            kept.append(line)
    return "\n".join(kept).rstrip()


def lesson_order(readme: str, scripts: list[Path]) -> list[Path]:
    """The scripts in the order the lesson first mentions them (a run marker, a link, an include or the name);
    the ones it never names come last, alphabetically. The navigation lists the script pages in this order."""
    def first(script: Path) -> tuple[int, str]:
        hits = [i for i in (readme.find(f"scripts/{script.name}"), readme.find(script.name)) if i >= 0]
        return (min(hits) if hits else len(readme) + 1, script.name)
    return sorted(scripts, key=first)


def discover(root: Path) -> list[tuple[Path, list[Chapter]]]:
    parts = sorted((p for p in (root / "tutorial").glob("part*") if p.is_dir()), key=number)
    return [(p, [load_chapter(c) for c in sorted((c for c in p.glob("chapter*") if c.is_dir()), key=number)])
            for p in parts]


def part_title(part: Path) -> str:
    return PART_TITLES.get(number(part), f"Part {number(part)} — " + part.name.split("-", 1)[-1])


def glossary_with_chapters(text: str, intros: dict[str, dict[str, tuple[Path, str]]],
                           chapter_of: dict[Path, Chapter]) -> str:
    """The glossary page, with a line under every entry that links no chapter yet: where a lesson explains the
    term (first in bold) and, when an earlier chapter already names it, where it first comes up
    (check_lessons.term_introductions finds both)."""
    def link(where: tuple[Path, str]) -> str:
        ch = chapter_of[where[0]]
        return f"[Chapter {number(ch.path)}]({ch.slug}/index.md" + (f"#{where[1]})" if where[1] else ")")

    out, head, body = [], None, []

    def flush() -> None:
        found = intros.get(head or "", {})
        if head and found and not any("](chapter" in line for line in body):
            explained, mentioned = found.get("explained"), found.get("mentioned")
            early = mentioned and (not explained or number(mentioned[0].parent) < number(explained[0].parent))
            words = (f"Explained in {link(explained)}" if explained else "") + (
                ("; first mentioned in " if explained else "First comes up in ") + link(mentioned) if early else "")
            while body and not body[-1].strip():
                body.pop()
            body.extend(["", f"*{words}.*", ""])
        out.extend(body)

    for line in text.splitlines():
        if line.startswith("#"):
            flush()
            out.append(line)
            head, body = (line[4:].strip() if line.startswith("### ") else None), []
        else:
            body.append(line)
    flush()
    return "\n".join(out) + "\n"


SELECT_RE = re.compile(r"^([^\[\]]*)\[([^=\]]+)=([^\]]*)\]$")


def lookup(data, path: str):
    """The value at `path` in JSON data: dotted keys, integer indexes (rows.0, rows.-1), `rows[size=1024]`,
    the first dict of a list whose field prints as that value, and `rows.#`, the length of a list."""
    for part in path.split("."):
        m = SELECT_RE.match(part)
        if part == "#" and isinstance(data, list):
            data = len(data)
        elif m:
            key, field, want = m.groups()
            rows = data[key] if key else data
            match = [r for r in rows if isinstance(r, dict) and field in r and str(r[field]) == want]
            if not match:
                raise KeyError(f"no row with {field}={want} in `{key or path}`")
            data = match[0]
        elif isinstance(data, list):
            data = data[int(part)]
        else:
            if part not in data:
                raise KeyError(f"no key `{part}` (have: {', '.join(list(data)[:12])})")
            data = data[part]
    return data


def recorded_md(folder: Path, slug: str, spec: str) -> str:
    """`FILE PATH [FORMAT]`: the value at PATH in FILE, a JSON file of a recorded run kept in the chapter folder."""
    words = shlex.split(spec)
    if len(words) not in (2, 3):
        raise BuildError(f"{slug}/README.md: `<!-- recorded: {spec} -->` wants `file.json path [format]`")
    file = (folder / words[0]).resolve()
    if folder.resolve() not in file.parents:
        raise BuildError(f"{slug}/README.md: `<!-- recorded: {spec} -->`: the file must be inside the chapter folder")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        value = lookup(data.get("results", data) if isinstance(data, dict) else data, words[1])
        return format(value, words[2] if len(words) == 3 else "")
    except (OSError, KeyError, IndexError, ValueError, TypeError) as exc:
        raise BuildError(f"{slug}/README.md: `<!-- recorded: {spec} -->`: {exc}") from exc


def fence(lang: str, body: str) -> str:
    ticks = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", body)), default=0))
    return f"{ticks}{lang}\n{body.rstrip()}\n{ticks}"


def run_process(argv: list[str], cwd: Path, timeout: float) -> tuple[int | None, str]:
    """Run argv, stdout+stderr interleaved; on timeout kill its process group (torchrun's workers too)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(cwd), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
        return proc.returncode, out
    except BaseException as exc:
        os.killpg(proc.pid, signal.SIGKILL)
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        return None, proc.communicate()[0]


class Builder:
    def __init__(self, s: Settings):
        self.s, self.root, self.docs = s, s.root, s.docs
        self.cache = s.root / ".cache" / "book-runs"
        self.digests: dict[Path, str] = {}
        self.counts = {"fresh": 0, "cached": 0}
        self.timings: dict[str, tuple[float, bool]] = {}   # shown command -> (seconds, served from cache)
        self.missing_try_next: list[str] = []              # scripts whose docstring has no "Try next" section
        self.runtime_drift: list[str] = []                 # run sheets whose "Runtime" is off by more than 2x
        self.inputs = self.inputs_digest()

    # ---- runs ---------------------------------------------------------------------------------------------
    def sources_digest(self, ch: Chapter) -> str:
        if ch.path not in self.digests:
            h = hashlib.sha256()
            for f in sorted([*(self.root / "mlsys").rglob("*.py"), *ch.path.rglob("*.py")]):
                h.update(f.relative_to(self.root).as_posix().encode() + b"\0" + f.read_bytes())
            self.digests[ch.path] = h.hexdigest()
        return self.digests[ch.path]

    def inputs_digest(self) -> str:
        """What every run depends on besides the sources: the trained weights and the pinned versions."""
        h = hashlib.sha256()
        files = [*sorted((self.root / ".cache" / "weights").glob("*")), self.root / "requirements/constraints.txt"]
        for f in files:
            if f.is_file():
                h.update(f.name.encode() + b"\0" + f.read_bytes())
        return h.hexdigest()

    def book_flags(self, ch: Chapter, tokens: list[str]) -> list[str]:
        """--json (and --plot-dir for a script that draws) for the script named in `tokens`: every run of a
        configuration writes its results, so the lesson and the script page can share it."""
        script = next((t for t in tokens if t.endswith(".py") and (ch.path / t).is_file()), None)
        if script is None or {"--json", "--help", "-h"} & set(tokens):
            return []
        stem = Path(script).stem
        return ["--json", f"{{OUT}}/{stem}.json"] + (["--plot-dir", f"{{OUT}}/{stem}_figures"]
                                                     if self.draws(ch, script) else [])

    def draws(self, ch: Chapter, script: str) -> bool:
        """Whether a script takes --plot-dir. Read from its source when that settles it (a `--help` run costs a
        torch import, about 2 s, times 70 scripts); asked with `--help` only when a `_helper` beside it might
        declare the flag for it."""
        declares = re.compile(r"\bPlotArgs\b|add_argument\(\s*[\"']--plot-dir[\"']")   # not a mere mention
        if declares.search((ch.path / script).read_text(encoding="utf-8")):
            return True
        helpers = (ch.path / script).parent.glob("_*.py")
        if not any(declares.search(h.read_text(encoding="utf-8")) for h in helpers):
            return False
        helped = self.execute(ch, [script, "--help"], quiet=True)
        return "--plot-dir" in (helped.output if helped else "")

    def configuration(self, ch: Chapter, stem: str, spec: str | None) -> list[str]:
        """The tokens of a run named by a figure or value marker: x.py's default run, x.py with `spec`'s
        arguments, or the full command in `spec` when it names the script itself (e.g. a torchrun launch)."""
        stem = stem.removesuffix(".py")
        if not (ch.path / "scripts" / f"{stem}.py").is_file():
            raise BuildError(f"{ch.slug}/README.md: no script scripts/{stem}.py for a figure or value marker")
        args = shlex.split(spec or "")
        return args if any(a.endswith(".py") for a in args) else [f"scripts/{stem}.py", *args]

    def execute(self, ch: Chapter, tokens: list[str], expect: int = 0, quiet: bool = False) -> Run | None:
        """Run `tokens` (paths relative to the chapter, {OUT} a scratch dir) at the repo root, or reuse its cache.
        A run expected to succeed also writes its --json (and figures): one run per configuration."""
        tokens = [*tokens, *(self.book_flags(ch, tokens) if expect == 0 else [])]
        tokens = [self.repo_path(ch, t) for t in tokens] + (["--smoke"] if self.s.smoke else [])
        launcher, args = (tokens[0], tokens[1:]) if tokens[0] in LAUNCHERS else ("python", tokens)
        shown = shlex.join([launcher] + [a.replace("{OUT}", "/tmp") for a in args])
        key = hashlib.sha256(f"{shown}\0{expect}\0{self.sources_digest(ch)}\0{self.inputs}".encode()).hexdigest()[:24]
        entry = self.cache / key
        cached = (entry / "run.json").exists()
        if not cached and self.runs_off(ch):
            return None
        if not cached:
            self.fresh_run(launcher, args, shown, expect, entry)
        meta = json.loads((entry / "run.json").read_text(encoding="utf-8"))
        if shown not in self.timings and "--help" not in tokens:   # --help runs only tell which flags exist
            self.counts["cached" if cached else "fresh"] += 1
            self.timings[shown] = (meta["seconds"], cached)
            if not quiet or not cached:
                what = shown.split(" ", 1)[1].replace(ch.path.relative_to(self.root).as_posix() + "/scripts/", "")
                tag = " (cached)" if cached else ""
                print(f"[run] ch{number(ch.path):02d} {what} ... {meta['seconds']:.1f} s{tag}", flush=True)
        return Run(entry, shown, meta["output"], meta["seconds"], meta["rc"], cached)

    def fresh_run(self, launcher: str, args: list[str], shown: str, expect: int, entry: Path) -> None:
        self.cache.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="tmp-", dir=self.cache))   # becomes `entry` once it succeeded
        argv = [sys.executable, *(["-m", "torch.distributed.run"] if launcher == "torchrun" else []),
                *(a.replace("{OUT}", str(work)) for a in args)]
        start = time.perf_counter()
        rc, out = run_process(argv, self.root, self.s.timeout)
        out = self.clean_output(out, work)
        if rc != expect:
            shutil.rmtree(work, ignore_errors=True)
            why = f"timed out after {self.s.timeout:.0f} s" if rc is None else f"exited {rc} (expected {expect})"
            tail = "\n".join(out.splitlines()[-40:])
            raise BuildError(f"run failed: `{shown}` {why}\n--- last lines of its output ---\n{tail}")
        for results in work.glob("*.json"):    # scripts echo their --json/--plot-dir paths into the results
            results.write_text(self.clean_output(results.read_text(encoding="utf-8"), work), encoding="utf-8")
        meta = {"shown": shown, "rc": rc, "seconds": round(time.perf_counter() - start, 2), "output": out}
        (work / "run.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        shutil.rmtree(entry, ignore_errors=True)
        try:
            os.replace(work, entry)
        except OSError:                          # a parallel build stored the same run first: keep theirs
            shutil.rmtree(work, ignore_errors=True)

    def clean_output(self, out: str, work: Path) -> str:
        """What a terminal shows: no colour codes, \\r-redrawn lines collapsed, no local absolute paths."""
        out = ANSI_RE.sub("", out).replace(str(work), "/tmp").replace(str(self.root) + os.sep, "")
        return "\n".join(line.rsplit("\r", 1)[-1].rstrip() for line in out.rstrip().split("\n"))

    def runs_off(self, ch: Chapter) -> bool:
        """True when this build shows cached outputs or placeholders for `ch` instead of running its scripts."""
        return self.s.no_run or bool(self.s.only) and self.s.only not in ch.slug

    def repo_path(self, ch: Chapter, token: str) -> str:
        path = ch.path / token
        return path.relative_to(self.root).as_posix() if token.endswith(".py") and path.is_file() else token

    # ---- pages --------------------------------------------------------------------------------------------
    def run_marker(self, ch: Chapter, spec: str) -> str:
        tokens = [t for t in shlex.split(spec) if not re.fullmatch(r"expect=\d+", t)]
        expect = re.search(r"(?:^|\s)expect=(\d+)(?:\s|$)", spec)
        if not any(t.endswith(".py") and (ch.path / t).is_file() for t in tokens):
            raise BuildError(f"{ch.slug}/README.md: `<!-- run: {spec} -->` names no script of this chapter")
        run = self.execute(ch, tokens, expect=int(expect.group(1)) if expect else 0)
        shown = [self.repo_path(ch, t) for t in tokens]
        return self.output_block(run, shlex.join(shown if shown[0] in LAUNCHERS else ["python", *shown]))

    def output_block(self, run: Run | None, wanted: str) -> str:
        if run is None:
            return f'!!! note "Not run"\n    `{wanted}` runs when the book is built without `--no-run`.'
        exit_note = f"\n[exit code {run.rc}]" if run.rc else ""
        return fence("text", f"$ {run.shown}\n{run.output}{exit_note}")

    def figure_md(self, ch: Chapter, rel: str, caption: str, spec: str | None = None) -> str:
        """A figure from the run of a configuration (x.py's default run, or the one `spec` names), copied into
        the chapter's figures/<stem>/ (default run) or figures/<stem>@<arguments>/ (any other configuration)."""
        stem, _, name = rel.partition("/")
        run = self.execute(ch, self.configuration(ch, stem, spec), quiet=True)
        if run is None:
            return f'!!! note "Figure not drawn yet"\n    `{rel}` appears once the book is built with its runs.'
        png = run.dir / f"{stem}_figures" / name
        if not png.is_file():
            raise BuildError(f"{ch.slug}/README.md: figure `{rel}` was not written by `{run.shown}` into its "
                             f"--plot-dir")
        folder = stem if not spec else f"{stem}@" + re.sub(r"[^A-Za-z0-9._=-]+", "_", spec).strip("_")
        target = self.docs / ch.slug / "figures" / folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(png, target)
        shown = (f'<figure markdown="span">\n  ![{caption.replace("]", "")}](figures/{folder}/{name})\n'
                 f"  <figcaption>{html.escape(caption)}</figcaption>\n</figure>")
        strip = png.with_name(png.stem + "_strip.png")
        if png.suffix == ".gif" and strip.is_file():   # an animation: its frames side by side, for print
            shutil.copy2(strip, target.with_name(strip.name))
            shown += (f'\n\n??? note "All frames of this animation (for print)"\n'
                      f"    ![every frame, in order](figures/{folder}/{strip.name})")
        return shown

    def value_md(self, ch: Chapter, spec: str, run_spec: str | None) -> str:
        """`x PATH [FORMAT]`: the value at PATH in the --json results of x.py's run, formatted."""
        words = shlex.split(spec)
        if len(words) not in (2, 3):
            raise BuildError(f"{ch.slug}/README.md: `<!-- value: {spec} -->` wants `script path [format]`")
        stem, path, fmt = words[0], words[1], (words[2] if len(words) == 3 else "")
        run = self.execute(ch, self.configuration(ch, stem, run_spec), quiet=True)
        if run is None:
            return "<abbr title=\"built with --no-run: this value appears once its run has run\">…</abbr>"
        file = run.dir / f"{stem.removesuffix('.py')}.json"
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
            value = lookup(data.get("results", data) if isinstance(data, dict) else data, path)
            return format(value, fmt)
        except (OSError, KeyError, IndexError, ValueError, TypeError) as exc:
            if self.s.smoke:   # smoke sizes may not have every row the full run has
                return f"<abbr title=\"not in the --smoke run: {html.escape(str(exc))}\">…</abbr>"
            raise BuildError(f"{ch.slug}/README.md: `<!-- value: {spec} -->` from `{run.shown}`: {exc}") from exc

    def script_page(self, ch: Chapter, script: Path) -> str:
        stem, rel = script.stem, script.relative_to(self.root).as_posix()
        run = self.execute(ch, [f"scripts/{script.name}"])   # the default run, shared with the lesson
        doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8"))) or "(no module docstring)"
        try_next = docstring_section(doc, "Try next")
        shown_doc = without_section(doc, "Try next") if try_next else doc   # shown once, under its own heading
        parts = [f"# {script.name}", fence("text", shown_doc), "## Source", fence("python", f'--8<-- "{rel}"'),
                 "## Output", self.output_block(run, f"python {rel}")]
        if run:
            parts += self.figures_section(ch, stem, run) + self.results_section(run, stem)
        self.check_runtime(rel, doc, run)
        if try_next:
            parts += ["## Try next", fence("text", try_next)]
        else:
            self.missing_try_next.append(rel)
        return "\n\n".join(parts) + "\n"

    def check_runtime(self, rel: str, doc: str, run: Run | None) -> None:
        """A run sheet's "Runtime on 2 cores: about N s" against the default run just captured: off by more than
        a factor of two is a warning at the end of the build (the docstring drifted, or the machine was busy)."""
        m = RUNTIME_RE.search(doc)
        if run is None or self.s.smoke or not m:
            return
        low, high = float(m.group(1)), float(m.group(2) or m.group(1))
        if run.seconds > 2 * high or run.seconds < low / 2:
            self.runtime_drift.append(f"{rel}: docstring says about {m.group(0).split('about')[-1].strip()}, "
                                      f"the default run took {run.seconds:.0f} s")

    def figures_section(self, ch: Chapter, stem: str, run: Run) -> list[str]:
        plots = run.dir / f"{stem}_figures"
        animated = {g.with_name(g.stem + "_strip.png") for g in plots.rglob("*.gif")}
        # a figure the lesson shows from this same (default) run keeps the lesson's caption; others get their name
        captions = {m.group(1): m.group(2) for m in FIGURE_RE.finditer(ch.readme) if not m.group(3)}
        shown = []
        for png in sorted([*plots.rglob("*.png"), *plots.rglob("*.gif")]):
            if png not in animated:
                name = f"{stem}/{png.relative_to(plots).as_posix()}"
                shown.append(self.figure_md(ch, name, captions.get(name, png.stem.replace("_", " "))))
        traces = sorted([*plots.rglob("*.trace.json"), *plots.rglob("*.trace.json.gz")])
        if traces:      # torch.profiler traces: open them in https://ui.perfetto.dev or chrome://tracing
            links = []
            for trace in traces:
                target = self.docs / ch.slug / "figures" / stem / trace.relative_to(plots)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(trace, target)
                links.append(f"- [`{trace.name}`](figures/{stem}/{trace.relative_to(plots).as_posix()})")
            shown += ["### Profiler traces", "Chrome trace files written by `torch.profiler` during this run: "
                      "download one and open it in [Perfetto](https://ui.perfetto.dev) (drag the file onto the "
                      "page) or in Chromium at `chrome://tracing`.", "\n".join(links)]
        return ["## Figures", *shown] if shown else []

    def results_section(self, run: Run, stem: str) -> list[str]:
        file = run.dir / f"{stem}.json"
        if not file.is_file():
            return ['!!! warning "No JSON results"\n    This run wrote nothing to its `--json` path.']
        doc = json.loads(file.read_text(encoding="utf-8"))
        shown = {k: doc[k] for k in ("settings", "results") if k in doc}
        block = fence("json", json.dumps(abridge(shown), indent=2))
        return ["## Results", '??? info "JSON results (`--json`), abridged"\n    ' + block.replace("\n", "\n    ")
                + f"\n\n    Long lists show their first {ABRIDGE_ITEMS} items; run the script with `--json PATH` "
                "for the whole file, with the environment it ran in."]

    def chapter_page(self, ch: Chapter, chapters: list[Chapter]) -> str:
        text = RUN_RE.sub(lambda m: self.run_marker(ch, m.group(1)), ch.readme)
        text = FIGURE_RE.sub(lambda m: self.figure_md(ch, m.group(1), m.group(2), m.group(3)), text)
        text = VALUE_RE.sub(lambda m: self.value_md(ch, m.group(1), m.group(2)), text)
        text = RECORDED_RE.sub(lambda m: recorded_md(ch.path, ch.slug, m.group(1)), text)
        text = LINK_RE.sub(lambda m: m.group(1) + self.rewrite_link(ch, chapters, m.group(2)) + m.group(3), text)
        if any(f"]({s.stem}.md" not in text for s in ch.scripts):
            text = text.rstrip() + "\n\n## Scripts in this chapter\n\n" + "\n".join(
                f"- [`{s.name}`]({s.stem}.md)" for s in ch.scripts) + "\n"
        return text

    def rewrite_link(self, ch: Chapter, chapters: list[Chapter], target: str) -> str:
        """A README's GitHub-relative link → the book's script page, chapter page, or a copy of the file."""
        path, sep, anchor = target.partition("#")
        if not path or re.match(r"^[a-zA-Z][a-zA-Z+.-]*:|^/", path):
            return target
        src, dirs = (ch.path / path).resolve(), {c.path.resolve(): c.slug for c in chapters}
        if src in {s.resolve() for s in ch.scripts}:
            new = f"{src.stem}.md"
        elif src in dirs or (src.name == "README.md" and src.parent in dirs):
            new = f"../{dirs.get(src) or dirs[src.parent]}/index.md"
        elif src.parent == (self.root / "book/pages").resolve() and src.suffix == ".md":
            new = f"../{src.name}"  # a book page such as the glossary: it sits at the top of the site
        elif src.is_file() and src.is_relative_to(self.root):
            copy = self.docs / "files" / src.relative_to(self.root)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, copy)
            new = os.path.relpath(copy, self.docs / ch.slug).replace(os.sep, "/")
        else:
            return target          # as written: mkdocs --strict reports it if it is broken
        return new + sep + anchor

    def contents(self, parts: list[tuple[Path, list[Chapter]]]) -> str:
        lines = []
        for part, chapters in parts:
            lines += ["", f"### {part_title(part)}", ""]
            lines += [f"- [{ch.title}]({ch.slug}/index.md)" for ch in chapters] or ["- (no chapters yet)"]
        return "\n".join(lines[1:])

    # ---- the build ----------------------------------------------------------------------------------------
    def write(self, rel: str, text: str) -> None:
        """Write a generated page; a markdown page gets its `$...$` / `$$` formulas rendered to MathML."""
        if rel.endswith(".md"):
            try:
                text = book_math.render(text)
            except book_math.BookMathError as exc:
                raise BuildError(f"{rel}: {exc}") from exc
        (self.docs / rel).parent.mkdir(parents=True, exist_ok=True)
        (self.docs / rel).write_text(text, encoding="utf-8")

    def fresh_docs_dir(self) -> None:
        if self.docs.exists():
            if any(self.docs.iterdir()) and not (self.docs / GENERATED_MARK).exists():
                raise BuildError(f"refusing to wipe --docs {self.docs}: it was not made by build_book.py")
            shutil.rmtree(self.docs)
        self.write(GENERATED_MARK, "generated by scripts/build_book.py: edit book/pages/ or the chapters\n")

    def static_pages(self, parts: list[tuple[Path, list[Chapter]]]) -> list[str]:
        pages = {p.name: p.read_text(encoding="utf-8") for p in sorted((self.root / "book/pages").glob("*.md"))}
        pages.setdefault("index.md", "# The book\n\n<!-- contents -->\n")
        chapters = [ch for _, chs in parts for ch in chs]
        if "glossary.md" in pages:  # each entry points at the lesson that teaches it
            check_lessons = self.check_lessons()
            readmes = {ch.path / "README.md": ch for ch in chapters if (ch.path / "README.md").is_file()}
            intros = check_lessons.term_introductions(self.root, list(readmes))
            pages["glossary.md"] = glossary_with_chapters(pages["glossary.md"], intros, readmes)
        for name, text in pages.items():
            self.write(name, CONTENTS_RE.sub(lambda _: self.contents(parts), text))
        for asset in sorted((self.root / "book/pages").glob("*.css")):  # the book's stylesheet(s)
            shutil.copy2(asset, self.docs / asset.name)
        return sorted((n for n in pages if n != "index.md"), key=lambda n: (n == "glossary.md", n))

    def build_chapter(self, ch: Chapter, chapters: list[Chapter]) -> list[str]:
        for script in ch.scripts:         # scripts first: their figures feed the lesson's figure markers
            self.write(f"{ch.slug}/{script.stem}.md", self.script_page(ch, script))
        self.write(f"{ch.slug}/index.md", self.chapter_page(ch, chapters))
        return [f"{ch.slug}/index.md", *(f"{ch.slug}/{s.stem}.md" for s in ch.scripts)]

    def build(self) -> None:
        start = time.perf_counter()
        self.fresh_docs_dir()
        parts = discover(self.root)
        chapters = [ch for _, chs in parts for ch in chs]
        nav: list = [{"Home": "index.md"}]
        for part, chs in parts:
            nav.append({part_title(part): [{ch.title: self.build_chapter(ch, chapters)} for ch in chs]})
        self.mkdocs(nav + self.static_pages(parts))
        self.term_warnings(chapters)
        if self.missing_try_next:
            print(f"[book] warning: {len(self.missing_try_next)} script(s) without a \"Try next\" section in "
                  "their docstring: " + ", ".join(Path(r).name for r in self.missing_try_next))
        if self.runtime_drift:
            print(f"[book] warning: {len(self.runtime_drift)} run sheet(s) whose Runtime is off by more than 2x "
                  "(load average now: " + " ".join(f"{x:.1f}" for x in os.getloadavg()) + ")")
            for line in self.runtime_drift:
                print("  " + line)
        site = self.s.out / "index.html"
        site = site.relative_to(Path.cwd()) if site.is_relative_to(Path.cwd()) else site
        slowest = sorted(self.timings.items(), key=lambda kv: -kv[1][0])[:5]
        if slowest:
            print("[book] the five slowest runs (seconds when run; cached ones cost nothing this time):")
            for shown, (seconds, cached) in slowest:
                print(f"  {seconds:7.1f} s  {shown}{'  (cached)' if cached else ''}")
        print(f"[book] {len(chapters)} chapters, {sum(len(c.scripts) for c in chapters)} scripts, "
              f"{self.counts['fresh']} runs + {self.counts['cached']} cached, "
              f"total {time.perf_counter() - start:.1f} s")
        print(f"Book built: {site}  (serve with: make serve)")

    @staticmethod
    def check_lessons():
        sys.path.insert(0, str(REPO / "scripts"))
        try:
            import check_lessons
        finally:
            sys.path.remove(str(REPO / "scripts"))
        return check_lessons

    def term_warnings(self, chapters: list[Chapter]) -> None:
        """Glossary terms a lesson uses before it defines them (scripts/check_lessons.py --terms): warnings only."""
        warned = self.check_lessons().term_warnings(self.root, [ch.path / "README.md" for ch in chapters
                                                         if (ch.path / "README.md").is_file()])
        if warned:
            print(f"[book] warning: {len(warned)} glossary term(s) used before they are defined "
                  "(python scripts/check_lessons.py --terms lists them)")
            for line in warned[:10]:
                print("  " + line.split(": bold it")[0])

    def mkdocs(self, nav: list) -> None:
        """Build with a generated config that INHERITs the static mkdocs.yml and adds the nav and the paths."""
        base = self.root / "mkdocs.yml" if (self.root / "mkdocs.yml").exists() else REPO / "mkdocs.yml"
        config = self.docs.parent / "mkdocs.gen.yml"
        inherit = os.path.relpath(base, config.parent) if config.is_relative_to(base.parent) else str(base)
        settings = {"INHERIT": inherit, "docs_dir": str(self.docs), "site_dir": str(self.s.out), "nav": nav}
        if self.s.only or self.s.no_run:  # pages not run here lack the headings their runs add: anchors not checked
            settings["validation"] = {"links": {"anchors": "info"}}
        config.write_text("# Generated by scripts/build_book.py; the static settings live in mkdocs.yml.\n"
                          + yaml.safe_dump(settings, allow_unicode=True, sort_keys=False), encoding="utf-8")
        start = time.perf_counter()
        rc, out = run_process([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config)],
                              self.root, self.s.timeout)
        if rc != 0:
            problems = [line for line in out.splitlines() if re.match(r"(WARNING|ERROR|Error|Aborted)", line)]
            raise BuildError("mkdocs build --strict failed:\n" + "\n".join(problems or out.splitlines()[-30:]))
        print(f"[mkdocs] build --strict ... {time.perf_counter() - start:.1f} s", flush=True)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: list[str] | None) -> Settings:
    p = OneLineParser(prog="build_book.py", description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, default=REPO, help="repo root with tutorial/ (default: this repo)")
    p.add_argument("--docs", type=Path, help="generated mkdocs source tree (default: ROOT/book/docs)")
    p.add_argument("--out", type=Path, help="site directory (default: ROOT/book/site)")
    p.add_argument("--smoke", action="store_true", help="run every script with --smoke (tiny sizes)")
    p.add_argument("--no-run", action="store_true", help="run nothing: cached outputs or placeholders")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (default 900)")
    p.add_argument("--only", default="", metavar="TEXT",
                   help="run only the chapters whose folder contains TEXT (e.g. chapter01); others as --no-run")
    a = p.parse_args(argv)
    root = a.root.resolve()
    if not (root / "tutorial").is_dir():
        p.error(f"--root {a.root} has no tutorial/ folder")
    if a.timeout <= 0:
        p.error("--timeout must be positive")
    return Settings(root, (a.docs or root / "book/docs").resolve(), (a.out or root / "book/site").resolve(),
                    a.smoke, a.no_run, a.timeout, a.only)


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    try:
        Builder(settings).build()
    except BuildError as exc:
        print(f"build_book.py: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
