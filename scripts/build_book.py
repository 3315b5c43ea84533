"""Build the executed book: run every chapter script, capture what it prints, render the site with mkdocs.

Each chapter's README.md becomes a page. Markers in it are HTML comments (GitHub hides them), expanded here:

    <!-- run: scripts/hello_distributed.py -w 4 -->        the command and its real stdout+stderr, as text
    <!-- run: torchrun --nproc-per-node 2 scripts/x.py -->  the same, launched by torchrun
    <!-- run: scripts/x.py --world-size 0 expect=2 -->     a run that must exit 2 (any other code fails)
    <!-- figure: hello_distributed/placement.png "Caption" -->  a PNG that scripts/hello_distributed.py wrote
                                                           into its --plot-dir during its default run
    <!-- contents -->                                      (book/pages/*.md only) the parts and chapters

Code is included from the real files by pymdownx.snippets (`--8<-- "tutorial/.../x.py:section"`, from the repo
root). Every script gets a page: docstring, full source, the output of a default run (`--json`, and
`--plot-dir` when its --help offers it), its JSON results and figures. Runs are cached in .cache/book-runs/,
keyed by the command and the sources of the chapter and of mlsys/.

    make book                                # = python scripts/build_book.py  (full sizes)
    python scripts/build_book.py --smoke     # every script with --smoke: the fast build the tests use
    python scripts/build_book.py --no-run    # prose edits: cached outputs, placeholders for the rest
    python scripts/build_book.py --smoke --only chapter01   # run one chapter's scripts, the rest as --no-run

Exit 0 built; 1 a run failed (the message names the command) or mkdocs --strict refused the site; 2 bad flags.
Runtime on 2 cores: the runs (a few seconds per script with --smoke) plus about 2 s; about 3 s when cached.
"""
from __future__ import annotations

import argparse, ast, hashlib, html, json, os, re, shlex, shutil, signal, subprocess, sys, tempfile, time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PART_TITLES = {1: "Part I — Distributed foundations", 2: "Part II — Parallelism",
               3: "Part III — Inference", 4: "Part IV — RLHF"}
RUN_RE = re.compile(r"<!--\s*run:\s*(.*?)\s*-->")
FIGURE_RE = re.compile(r'<!--\s*figure:\s*(\S+)\s+"([^"]*)"\s*-->')
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


def number(path: Path) -> int:
    m = re.search(r"\d+", path.name)
    return int(m.group()) if m else 0


def load_chapter(path: Path) -> Chapter:
    readme = (path / "README.md").read_text(encoding="utf-8") if (path / "README.md").exists() else ""
    m = re.search(r"^# +(.+?)\s*$", readme, re.M)
    title = m.group(1) if m else f"Chapter {number(path)}: " + path.name.split("-", 1)[-1].replace("-", " ")
    scripts = sorted(s for s in (path / "scripts").glob("*.py") if not s.name.startswith("_"))
    return Chapter(path, path.name, title, readme if m else f"# {title}\n\n{readme}", scripts)


def discover(root: Path) -> list[tuple[Path, list[Chapter]]]:
    parts = sorted((p for p in (root / "tutorial").glob("part*") if p.is_dir()), key=number)
    return [(p, [load_chapter(c) for c in sorted((c for c in p.glob("chapter*") if c.is_dir()), key=number)])
            for p in parts]


def part_title(part: Path) -> str:
    return PART_TITLES.get(number(part), f"Part {number(part)} — " + part.name.split("-", 1)[-1])


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

    # ---- runs ---------------------------------------------------------------------------------------------
    def sources_digest(self, ch: Chapter) -> str:
        if ch.path not in self.digests:
            h = hashlib.sha256()
            for f in sorted([*(self.root / "mlsys").rglob("*.py"), *ch.path.rglob("*.py")]):
                h.update(f.relative_to(self.root).as_posix().encode() + b"\0" + f.read_bytes())
            self.digests[ch.path] = h.hexdigest()
        return self.digests[ch.path]

    def execute(self, ch: Chapter, tokens: list[str], expect: int = 0, quiet: bool = False) -> Run | None:
        """Run `tokens` (paths relative to the chapter, {OUT} a scratch dir) at the repo root, or reuse its cache."""
        tokens = [self.repo_path(ch, t) for t in tokens] + (["--smoke"] if self.s.smoke else [])
        launcher, args = (tokens[0], tokens[1:]) if tokens[0] in LAUNCHERS else ("python", tokens)
        shown = shlex.join([launcher] + [a.replace("{OUT}", "/tmp") for a in args])
        key = hashlib.sha256(f"{shown}\0{expect}\0{self.sources_digest(ch)}".encode()).hexdigest()[:24]
        entry = self.cache / key
        cached = (entry / "run.json").exists()
        if not cached and self.runs_off(ch):
            return None
        if not cached:
            self.fresh_run(launcher, args, shown, expect, entry)
        meta = json.loads((entry / "run.json").read_text(encoding="utf-8"))
        if not quiet:
            self.counts["cached" if cached else "fresh"] += 1
            what = shown.split(" ", 1)[1].replace(ch.path.relative_to(self.root).as_posix() + "/scripts/", "")
            tag = " (cached)" if cached else ""
            print(f"[run] ch{number(ch.path):02d} {what} ... {meta['seconds']:.1f} s{tag}", flush=True)
        return Run(entry, shown, meta["output"], meta["seconds"], meta["rc"])

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

    def figure_md(self, ch: Chapter, rel: str, caption: str) -> str:
        if not (self.docs / ch.slug / "figures" / rel).is_file():
            if self.runs_off(ch):
                return f'!!! note "Figure not drawn yet"\n    `{rel}` appears once the book is built with its runs.'
            raise BuildError(f"{ch.slug}/README.md: figure `{rel}` was not written by "
                             f"scripts/{rel.split('/')[0]}.py into its --plot-dir")
        return (f'<figure markdown="span">\n  ![{caption.replace("]", "")}](figures/{rel})\n'
                f"  <figcaption>{html.escape(caption)}</figcaption>\n</figure>")

    def script_page(self, ch: Chapter, script: Path) -> str:
        help_run = self.execute(ch, [f"scripts/{script.name}", "--help"], quiet=True)
        plots = "--plot-dir" in (help_run.output if help_run else script.read_text(encoding="utf-8"))
        stem, rel = script.stem, script.relative_to(self.root).as_posix()
        flags = ["--json", f"{{OUT}}/{stem}.json"] + (["--plot-dir", f"{{OUT}}/{stem}_figures"] if plots else [])
        run = self.execute(ch, [f"scripts/{script.name}", *flags])
        doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8"))) or "(no module docstring)"
        parts = [f"# {script.name}", fence("text", doc), "## Source", fence("python", f'--8<-- "{rel}"'),
                 "## Output", self.output_block(run, f"python {rel}")]
        if run:
            parts += self.figures_section(ch, stem, run) + self.results_section(run, stem)
        return "\n\n".join(parts) + "\n"

    def figures_section(self, ch: Chapter, stem: str, run: Run) -> list[str]:
        plots, shown = run.dir / f"{stem}_figures", []
        for png in sorted(plots.rglob("*.png")):
            rel = f"{stem}/{png.relative_to(plots).as_posix()}"
            (self.docs / ch.slug / "figures" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(png, self.docs / ch.slug / "figures" / rel)
            shown.append(self.figure_md(ch, rel, png.name))
        return ["## Figures", *shown] if shown else []

    def results_section(self, run: Run, stem: str) -> list[str]:
        file = run.dir / f"{stem}.json"
        if not file.is_file():
            return ['!!! warning "No JSON results"\n    This run wrote nothing to its `--json` path.']
        block = fence("json", json.dumps(json.loads(file.read_text(encoding="utf-8")), indent=2))
        return ["## Results", '??? info "JSON results (`--json`)"\n    ' + block.replace("\n", "\n    ")]

    def chapter_page(self, ch: Chapter, chapters: list[Chapter]) -> str:
        text = RUN_RE.sub(lambda m: self.run_marker(ch, m.group(1)), ch.readme)
        text = FIGURE_RE.sub(lambda m: self.figure_md(ch, m.group(1), m.group(2)), text)
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
        site = self.s.out / "index.html"
        site = site.relative_to(Path.cwd()) if site.is_relative_to(Path.cwd()) else site
        print(f"[book] {len(chapters)} chapters, {sum(len(c.scripts) for c in chapters)} scripts, "
              f"{self.counts['fresh']} runs + {self.counts['cached']} cached, {time.perf_counter() - start:.1f} s")
        print(f"Book built: {site}  (serve with: make serve)")

    def mkdocs(self, nav: list) -> None:
        """Build with a generated config that INHERITs the static mkdocs.yml and adds the nav and the paths."""
        base = self.root / "mkdocs.yml" if (self.root / "mkdocs.yml").exists() else REPO / "mkdocs.yml"
        config = self.docs.parent / "mkdocs.gen.yml"
        inherit = os.path.relpath(base, config.parent) if config.is_relative_to(base.parent) else str(base)
        settings = {"INHERIT": inherit, "docs_dir": str(self.docs), "site_dir": str(self.s.out), "nav": nav}
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
