"""Shared test helpers: run a script as a subprocess the way a learner would, and time the smoke runs."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "tutorial"
SMOKE_TIMES: dict[str, float] = {}


def chapter_dir(number: int) -> Path:
    """The folder of chapter `number` (e.g. 5 -> tutorial/part2-parallelism/chapter05-data-parallel)."""
    (path,) = TUTORIAL.glob(f"part*/chapter{number:02d}-*")
    return path


def scripts_dir(number: int) -> Path:
    """The scripts/ folder of chapter `number`: `scripts_dir(9) / "paged_kv.py"`."""
    return chapter_dir(number) / "scripts"


def run_json(tmp_path_factory, script: Path, *flags: str | os.PathLike, timeout: float = 170) -> dict:
    """Run `script --json OUT *flags`, require exit 0, return the JSON's "results" (the whole JSON if it has none)."""
    out = tmp_path_factory.mktemp(Path(script).stem) / "r.json"
    proc = run([script, "--json", out, *flags], timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-2500:]
    data = json.loads(out.read_text())
    return data.get("results", data) if isinstance(data, dict) else data


def chapter_scripts() -> list[Path]:
    """Every script under tutorial/ that the contract applies to (files starting with _ are helpers)."""
    return sorted(p for p in TUTORIAL.glob("part*/chapter*/scripts/*.py") if not p.name.startswith("_"))


def load_script(path: Path):
    """Import a chapter script (its folder name is not a package name) as a module, to test its functions. Its
    folder goes on sys.path, as `python script.py` puts it there, so it finds its chapter's `_helpers`."""
    from mlsys.exercises import load_module

    if str(Path(path).resolve().parent) not in sys.path:
        sys.path.append(str(Path(path).resolve().parent))
    return load_module(path)


def script_id(path: Path) -> str:
    return f"{path.parent.parent.name.split('-')[0]}/{path.name}"


def _script_env(env: dict | None) -> dict:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # never inherit a job
        if key not in (env or {}):
            full_env.pop(key, None)
    return full_env


def run(args: list[str | os.PathLike], timeout: float = 120, env: dict | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `python <args>` (or a full command if args[0] is an executable path) and capture its output.
    A chapter script (`tutorial/.../scripts/x.py ARGS`) runs as a fresh child of this worker's preloaded zygote
    (see Preloaded): the same process a learner's `python x.py ARGS` starts, without importing torch again."""
    full_env = _script_env(env)
    cmd = [str(a) for a in args]
    runner = _worker_zygote(cmd, cwd or ROOT)
    if runner is not None:
        try:
            return runner.run(cmd, timeout=timeout, env=env, cwd=cwd)
        finally:
            _ZYGOTE_LOCK.release()
    if not cmd[0].endswith(("python", "torchrun")) and not Path(cmd[0]).name.startswith("python"):
        cmd = [sys.executable, *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or ROOT)


class Preloaded:
    """`run` for chapter scripts, through tests/_zygote.py: each run is a fresh process forked from one that has
    already imported torch, numpy and matplotlib (about 2 s saved per run). MLSYS_NO_ZYGOTE=1 turns it off."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "_zygote.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=_script_env(None), cwd=ROOT)
        self.buffer = b""

    def _reply(self, timeout: float) -> dict | None:
        """The zygote's next reply line, or None if none came within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the zygote exited (code {self.proc.wait()})")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, args: list, timeout: float = 120, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        argv = [str(a) for a in args]
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"argv": argv, "cwd": str(cwd or ROOT), "env": _script_env(env), "stdout": str(out),
                       "stderr": str(err)}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            pid = self._reply(60)["pid"]
            reply = self._reply(timeout)
            if reply is None:  # kill the run and everything it started (its own process group)
                os.killpg(pid, signal.SIGKILL)
                self._reply(60)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(errors="replace"),
                                                err.read_text(errors="replace"))
            return subprocess.CompletedProcess([sys.executable, *argv], reply["code"],
                                               out.read_text(errors="replace"), err.read_text(errors="replace"))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


_ZYGOTE: list = []  # this worker's Preloaded, started on the first chapter-script `run`
_ZYGOTE_LOCK = threading.Lock()


def _worker_zygote(cmd: list[str], cwd: Path) -> Preloaded | None:
    """This worker's zygote, locked for the caller, if `cmd` is a chapter script's run and the zygote is free (a
    test running two scripts at once from threads gets a plain process for the second); None otherwise."""
    if os.environ.get("MLSYS_NO_ZYGOTE") == "1" or not cmd[0].endswith(".py"):
        return None
    script = Path(cwd) / cmd[0]  # cmd[0] itself when it is absolute
    if not script.resolve().is_relative_to(TUTORIAL) or script.parent.name != "scripts":
        return None
    if not _ZYGOTE_LOCK.acquire(blocking=False):
        return None
    try:
        if not _ZYGOTE or _ZYGOTE[0].proc.poll() is not None:
            _ZYGOTE[:] = [Preloaded()]
            atexit.register(_ZYGOTE[0].close)
    except BaseException:
        _ZYGOTE_LOCK.release()
        raise
    return _ZYGOTE[0]


def timed_run(name: str, args: list, record_property=None, **kw) -> subprocess.CompletedProcess:
    """`run`, timed. Pass the test's `record_property` fixture: the time then travels with the
    test's report, so the summary below lists it under pytest-xdist too (workers' module globals never reach the
    controller)."""
    start = time.perf_counter()
    proc = run(args, **kw)
    seconds = time.perf_counter() - start
    SMOKE_TIMES[name] = seconds
    if record_property is not None:
        record_property("smoke_seconds", (name, seconds))
    return proc


@pytest.fixture(scope="session")
def smoke_cache(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this run shares (and no other run): the smoke runs' results."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    folder = base.parent / f"smoke-{uid}" if uid else base / "smoke"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def smoke_run(cache: Path, script: Path, record_property=None) -> dict:
    """`script --smoke --json OUT [--plot-dir DIR]`, run once per test run, whichever test (on whichever worker)
    asks first; the others wait for it and read the same result. The smoke test checks the contract on it, and an
    oracle test that needs exactly the smoke run's JSON reads it instead of running the script again.
    Returns {"code", "stdout", "stderr", "json" (the parsed --json, or None), "plot_dir" (or None)}."""
    import fcntl

    name = script_id(script).replace("/", "-")
    folder = cache / name
    done = cache / f"{name}.done.json"
    with open(cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this test fails
        if not done.exists():
            folder.mkdir(exist_ok=True)
            args = [script, "--smoke", "--json", folder / "results.json"]
            plot_dir = folder / "figures" if "PlotArgs" in script.read_text() else None
            if plot_dir is not None:
                args += ["--plot-dir", plot_dir]
            proc = timed_run(script_id(script), args, record_property, timeout=170)
            record = {"code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
                      "plot_dir": str(plot_dir) if plot_dir else None}
            done.write_text(json.dumps(record))
    record = json.loads(done.read_text())
    out = folder / "results.json"
    record["json"] = json.loads(out.read_text()) if record["code"] == 0 and out.exists() else None
    return record


def pytest_runtest_logreport(report) -> None:
    for key, value in getattr(report, "user_properties", ()):
        if key == "smoke_seconds" and report.when == "call":
            name, seconds = value
            SMOKE_TIMES[name] = seconds


def pytest_terminal_summary(terminalreporter) -> None:
    if SMOKE_TIMES:
        terminalreporter.section("smoke run time per script (s)")
        for name, seconds in sorted(SMOKE_TIMES.items()):
            terminalreporter.write_line(f"{seconds:6.1f}  {name}")


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules that decode tiny models token by token: one intra-op thread is faster there, and two fight
    badly on a loaded machine. Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def small_model():
    """The book's trained `small` GPT (built once by scripts/train_weights.py), in eval mode, on one thread."""
    import torch

    from mlsys.weights import load_pretrained

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_pretrained("small")
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_model():
    """A random-init `tiny` GPT (seed 0), eval mode: for tests of mechanisms, not of trained behaviour."""
    import torch

    from mlsys.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny")).eval()


def pytest_collection_modifyitems(config, items) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ----------------------------------------------------------------------- a 1F1B pipeline on an event clock (oracle)
def one_f_one_b(stage: int, p: int, m: int) -> list[tuple[str, int]]:
    """Stage `stage`'s program: p - stage - 1 warm-up forwards, then one forward one backward, then the rest."""
    warm = min(p - stage - 1, m)
    ops, f = [("F", i) for i in range(warm)], warm
    for b in range(m):
        if f < m:
            ops.append(("F", f))
            f += 1
        ops.append(("B", b))
    return ops


def simulate_1f1b(t_fwd: list[float], t_bwd: list[float], m: int) -> float:
    """Walk the 1F1B programs of p stages on an event clock: an op starts when its stage is free and its input is
    there (a forward needs the previous stage's forward of that micro-batch, a backward the next stage's backward,
    or the stage's own forward on the last stage). Returns when the last op ends."""
    p = len(t_fwd)
    programs, pos, free, end = [one_f_one_b(s, p, m) for s in range(p)], [0] * p, [0.0] * p, {}
    while any(pos[s] < len(programs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(programs[s]):
                kind, i = programs[s][pos[s]]
                need = ((kind, s - 1, i) if kind == "F" and s > 0 else (kind, s + 1, i) if kind == "B" and s < p - 1
                        else ("F", s, i) if kind == "B" else None)
                if need is not None and need not in end:
                    break
                free[s] = max(free[s], end[need] if need else 0.0) + (t_fwd[s] if kind == "F" else t_bwd[s])
                end[(kind, s, i)], pos[s], moved = free[s], pos[s] + 1, True
        assert moved, "deadlock: the programs wait on each other"
    return max(free)
