"""The shared launcher: free ports under concurrency, failing ranks, timeouts, torchrun, no orphans (not even the
ranks' own children)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, run, scripts_dir

JOB = ROOT / "tests" / "fixtures" / "job.py"
HELLO = scripts_dir(1) / "hello_distributed.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def alive(pid: int) -> bool:
    """True if `pid` is a live process (a zombie counts as dead: it has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(pid_dir.glob("rank*.pid"))]


def wait_dead(pid_list: list[int], within: float = 10.0) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p) for p in pid_list):
        time.sleep(0.1)
    return [p for p in pid_list if alive(p)]


def wait_files(pid_dir: Path, pattern: str, count: int, within: float = 60.0) -> list[Path]:
    """The files matching `pattern` once there are `count` of them (a guard deadline only: [] if they never come)."""
    deadline = time.monotonic() + within
    while len(list(pid_dir.glob(pattern))) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    found = sorted(pid_dir.glob(pattern))
    return found if len(found) >= count else []


def kill_leftovers(pid_list: list[int]) -> None:
    """After a failed assertion: do not leave the processes the test was about running."""
    for pid in pid_list:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_ok_job_returns_rank0_result(tmp_path, monkeypatch) -> None:
    out = tmp_path / "r.json"
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the launcher's own share of the cores
    proc = run([JOB, "-w", "3", "--json", out, "--all-ranks"])
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())["results"]
    assert result["sum"] == [6.0, 6.0]  # 1 + 2 + 3
    cores = len(os.sched_getaffinity(0))
    assert result["threads"] == max(1, cores // 3)  # 3 ranks share the cores: together never more than the cores
    hellos = [line for line in proc.stdout.splitlines() if "says hello" in line]
    assert sorted(hellos) == [f"[rank {r}] rank {r} says hello" for r in range(3)]  # whole lines, never mixed


@pytest.mark.long  # 45-75 s on a loaded 2-core machine: make sweep runs it, keeping make test near 10 minutes
@pytest.mark.timeout(120)
def test_concurrent_jobs_get_distinct_free_ports(tmp_path) -> None:
    """Four copies started at the same moment all succeed, each on its own port."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    procs = [subprocess.Popen([sys.executable, str(JOB), "-w", "2", "--json", str(tmp_path / f"{i}.json")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    outs = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [o[1][-2000:] for o in outs]
    ports = {json.loads((tmp_path / f"{i}.json").read_text())["results"]["master_port"] for i in range(4)}
    assert len(ports) == 4


@pytest.mark.long  # 45-75 s on a loaded 2-core machine: make sweep runs it, keeping make test near 10 minutes
@pytest.mark.timeout(120)
def test_two_copies_of_chapter1_at_once(tmp_path) -> None:
    procs = [subprocess.Popen([sys.executable, str(HELLO), "--smoke", "--plot-dir", str(tmp_path / str(i))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert all("OK: all_gather and all_reduce match" in o[0] for o in outs)


@pytest.mark.timeout(120)
def test_master_port_from_environment_is_honoured(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "r.json"
    proc = run([JOB, "-w", "2", "--json", out], env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["results"]["master_port"] == str(port)


@pytest.mark.timeout(120)
def test_failing_rank_stops_the_job_with_its_traceback(tmp_path) -> None:
    """Rank 1 raises while rank 0 waits for it in a collective: the job must end fast, not at the timeout."""
    # the collective timeout is 300 s: if the launcher did not stop the waiting ranks, run() would time out at 100
    proc = run([JOB, "-w", "3", "--mode", "raise", "--pid-dir", tmp_path, "--timeout", "300"], timeout=100)
    assert proc.returncode == 1
    assert "rank 1 failed" in proc.stderr and "ValueError: boom from the test job" in proc.stderr
    assert "Traceback" in proc.stderr
    assert "(job stopped: rank 1 failed" in proc.stderr  # blamed: not rank 0 or 2, which fail because it is gone
    assert "rank 0 failed:" not in proc.stderr and "rank 2 failed:" not in proc.stderr
    assert len(pids(tmp_path)) == 3 and wait_dead(pids(tmp_path)) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "how"), [("exit", "exit code 3"), ("segv", "killed by SIGSEGV"),
                                           ("kill", "killed by SIGKILL")])
def test_rank_dying_without_a_report_is_blamed(mode: str, how: str, tmp_path) -> None:
    """Rank 1 dies with no Python exception while rank 0 waits for it in all_reduce. Rank 0 then fails with
    "connection closed" and its report reaches the launcher first, often before the death does: rank 1 is still
    the one to blame, with its exit code or signal, and rank 0 is listed as failing after it."""
    proc = run([JOB, "-w", "2", "--mode", mode, "--pid-dir", tmp_path, "--timeout", "300"], timeout=100)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"rank 1 died ({how}) without a Python exception or report" in proc.stderr, proc.stderr[-3000:]
    assert "(job stopped: rank 1 failed first; rank(s) 0 failed after it" in proc.stderr, proc.stderr[-3000:]
    assert "rank 0 failed:" not in proc.stderr  # the victim's traceback is not shown as the cause
    if mode == "segv":
        assert "Segmentation fault" in proc.stderr and "in worker" in proc.stderr  # faulthandler: where it died
    assert len(pids(tmp_path)) == 2 and wait_dead(pids(tmp_path)) == []


def test_blame_prefers_a_silent_death_unless_a_report_clearly_precedes_it() -> None:
    from mlsys.launch import _blame, _Seen

    dead = _Seen(gone=(100.0, 100.2), exitcode=-9)  # last seen alive at 100.0, seen gone at 100.2
    victim = _Seen(message=("error", "connection closed", 100.1), gone=(100.2, 100.3), exitcode=1)
    assert _blame([victim, dead]) == 1  # reported before the death was noticed, but after rank 1 was last alive
    close = _Seen(message=("error", "connection closed", 99.9), gone=(100.2, 100.3), exitcode=1)
    assert _blame([close, dead]) == 1  # a dying rank's sockets can close before its pipe to the launcher does
    earlier = _Seen(message=("error", "boom", 99.0), gone=(99.1, 99.2), exitcode=1)
    assert _blame([earlier, dead]) == 0  # sent clearly before rank 1 was last seen alive: it failed first
    assert _blame([_Seen(message=("ok", None, 99.0), gone=(99.0, 99.1), exitcode=0), dead]) == 1
    assert _blame([_Seen(message=("ok", None, 99.0), gone=(99.0, 99.1), exitcode=0)]) is None



def test_each_rank_failing_after_the_first_is_reported_with_its_own_failure() -> None:
    """Ranks that fail after the first are not all victims: a rank whose own self-check failed says so, a rank
    that lost its peer quotes its own error (without gloo's source location), a silent death gives its signal."""
    from mlsys.launch import _failure, _Seen

    first = _Seen(message=("selfcheck", "self-check failed on rank 0: sum", 10.0), gone=(10.1, 10.2), exitcode=1)
    own = _Seen(message=("selfcheck", "self-check failed on rank 1: sum", 10.3), gone=(10.4, 10.5), exitcode=1)
    victim = _Seen(message=("error", "rank 2 failed:\nTraceback ...\nRuntimeError: [/x/gloo/pair.cc:553] "
                            "Connection closed by peer [127.0.0.1]:5. This is typically caused by a crash.\n", 10.3),
                   gone=(10.4, 10.5), exitcode=1)
    late = _Seen(message=("timeout", "rank 3 failed:\nTimeout\n", 12.0), gone=(12.1, 12.2), exitcode=1)
    dead = _Seen(gone=(10.6, 10.7), exitcode=-9)
    note = str(_failure(0, [first, own, victim, late, dead])).splitlines()[-1]
    assert note.startswith("(job stopped: rank 0 failed first; rank(s) 1, 2, 3, 4 failed after it: "), note
    assert "rank 1 failed its own self-check" in note, note
    assert "rank 2 raised RuntimeError: Connection closed by peer [127.0.0.1]:5;" in note, note
    assert "rank 3 timed out in a collective" in note and "rank 4 died (killed by SIGKILL)" in note, note
    assert "waiting on a peer" not in note, note

@pytest.mark.timeout(120)
def test_straggler_after_a_rank_returned_ends_the_job(tmp_path) -> None:
    """Rank 0 returns; rank 1 sleeps far past --timeout with no collective left to time out: the launcher stops it."""
    proc = run([JOB, "-w", "2", "--mode", "straggle", "--pid-dir", tmp_path, "--timeout", "3"], timeout=100)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ("job stopped: rank(s) 1 still running 3 s after rank 0 returned from the worker (--timeout 3); "
            "they were terminated") in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert len(pids(tmp_path)) == 2 and wait_dead(pids(tmp_path)) == []


@pytest.mark.timeout(60)
def test_busy_master_port_is_a_one_line_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run([JOB, "-w", "2"], env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"job.py: error: MASTER_PORT={port} is already in use"), lines


@pytest.mark.timeout(120)
def test_selfcheck_failure_exits_1_with_a_message() -> None:
    proc = run([JOB, "-w", "2", "--mode", "selfcheck"])
    assert proc.returncode == 1
    assert "self-check failed on rank 1: fixture value" in proc.stderr


@pytest.mark.timeout(120)
def test_no_collective_progress_names_the_rank_the_others_waited_for(tmp_path) -> None:
    """Rank 1 never joins the all_reduce; ranks 0 and 2 time out in it after --timeout. Rank 1 is named, not them."""
    proc = run([JOB, "-w", "3", "--mode", "stall", "--timeout", "3", "--pid-dir", tmp_path], timeout=100)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ("job stopped: rank(s) 1 made no collective progress: rank(s) 0, 2 timed out after 3 s (--timeout) in a "
            "collective that rank(s) 1 never joined; they were terminated") in proc.stderr.splitlines(), \
        proc.stderr[-3000:]
    assert len(pids(tmp_path)) == 3 and wait_dead(pids(tmp_path)) == []


@pytest.mark.timeout(120)
def test_killed_parent_leaves_no_orphans(tmp_path) -> None:
    """SIGKILL the launcher while its ranks are blocked in recv: the kernel must take the ranks down too."""
    parent = subprocess.Popen([sys.executable, str(JOB), "-w", "2", "--mode", "block", "--pid-dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(pids(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(pids(tmp_path)) == 2, "the ranks never started"
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert wait_dead(pids(tmp_path)) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "code"), [("ok", 0), ("raise", 1)])
def test_a_ranks_child_process_ends_with_the_job(mode: str, code: int, tmp_path) -> None:
    """Rank 1 starts a child (a 100 s sleep that holds the rank's stdout and stderr) and then returns, or raises,
    without waiting for it. The launcher stops each rank's own process group when the job ends: the child is gone
    and the run returns (an orphan holding the output pipes kept `run`, which reads them to EOF, waiting)."""
    try:
        proc = run([JOB, "-w", "2", "--mode", mode, "--child", "--pid-dir", tmp_path, "--timeout", "300"],
                   timeout=60)
    except subprocess.TimeoutExpired:
        proc = None
    child = [int(f.read_text()) for f in tmp_path.glob("child1.pid")]
    try:
        assert proc is not None, "the run did not return: a process left behind still holds its output"
        assert proc.returncode == code, proc.stderr[-3000:]
        assert len(child) == 1 and wait_dead(child) == []
    finally:
        kill_leftovers(child)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_rank_that_closes_its_stdout_still_succeeds(stream: str, tmp_path) -> None:
    """Every rank closes sys.stdout (sys.stderr) and returns normally: the job succeeds. (The rank's last flush,
    before it exits, raised on the closed stream: exit 1, "died without a Python exception".)"""
    out = tmp_path / "r.json"
    proc = run([JOB, "-w", "2", "--mode", f"close-{stream}", "--json", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text())["results"]["sum"] == [3.0, 3.0]


@pytest.mark.timeout(120)
def test_a_rank_that_never_joins_the_process_group_is_named(tmp_path) -> None:
    """Rank 1 is stuck before init_process_group; ranks 0 and 2 wait for it there and time out ("wait timeout"
    from the rendezvous store, not gloo's "Timed out"). Rank 1 is named, not rank 0."""
    proc = run([JOB, "-w", "3", "--mode", "join-late", "--timeout", "3"], timeout=100)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ("job stopped: rank(s) 1 never joined the process group: rank(s) 0, 2 timed out after 3 s (--timeout) "
            "waiting for them in init_process_group; they were terminated") in proc.stderr.splitlines(), \
        proc.stderr[-3000:]
    assert "rank 0 failed" not in proc.stderr


@pytest.mark.timeout(120)
def test_killed_parent_leaves_no_rank_that_hangs_before_its_code_runs(tmp_path) -> None:
    """Each rank hangs while unpickling its arguments (user code: an argument's __reduce__ can run anything, and
    unpickling the worker imports its module). SIGKILL the launcher then: the ranks must die too, so they arm
    their lifeline before they unpickle anything."""
    parent = subprocess.Popen([sys.executable, str(JOB), "-w", "2", "--mode", "hang-unpickling", "--pid-dir",
                               str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    found = wait_files(tmp_path, "unpickling-*.pid", 2)
    hung = [int(f.read_text()) for f in found]
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    try:
        assert len(hung) == 2, "the ranks never started unpickling"
        assert wait_dead(hung) == []
    finally:
        kill_leftovers(hung)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("case", "code"), [("parent gone", -signal.SIGKILL), ("launcher gone", -signal.SIGKILL),
                                            ("both there", 0)])
def test_a_rank_whose_parent_died_before_it_armed_kills_itself(case: str, code: int) -> None:
    """PR_SET_PDEATHSIG only fires for a parent that dies after it is armed. So once armed, the rank checks: its
    direct parent is still the one it had (else it was reparented: the parent already died), and the launcher's end
    of the pipe is still open. Either gone: the rank kills itself at once, before running anything."""
    program = f"""
import multiprocessing as mp, os
from mlsys.launch import _die_with_parent
ours, theirs = mp.Pipe(duplex=True)
if {case!r} == "launcher gone":
    ours.close()
_die_with_parent(theirs, 1 if {case!r} == "parent gone" else os.getppid())  # pid 1 is never our parent here
print("still running")
"""
    proc = run([sys.executable, "-c", program], timeout=50)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert ("still running" in proc.stdout) == (code == 0)


def as_from_a_terminal() -> None:
    """Ctrl-C as a shell leaves it to a program it starts: SIGINT at its default and not blocked. A test worker may
    carry a different state (an ignored disposition and a blocked mask are inherited through exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def signal_state(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "(gone)"
    return " ".join(line for line in status.splitlines() if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


@pytest.mark.timeout(120)
def test_interrupted_parent_stops_its_ranks(tmp_path) -> None:
    parent = subprocess.Popen([sys.executable, str(JOB), "-w", "2", "--mode", "block", "--pid-dir", str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=as_from_a_terminal)
    deadline = time.monotonic() + 60
    while len(pids(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    state = signal_state(parent.pid)
    parent.send_signal(signal.SIGINT)
    try:
        _, err = parent.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        parent.kill()
        _, err = parent.communicate()
        pytest.fail(f"the launcher was still running 30 s after SIGINT ({state}); its stderr:\n{err[-3000:]}")
    assert parent.returncode != 0, err
    assert wait_dead(pids(tmp_path)) == []


@pytest.mark.timeout(120)
def test_ctrl_c_in_a_terminal_reaches_the_ranks_children(tmp_path) -> None:
    """Ctrl-C in a terminal sends SIGINT to the foreground process group, which no longer holds the ranks (each
    has its own group): the launcher passes it on to each rank's group, so rank 1's child gets SIGINT as it would
    from the terminal, and has time to end on it before the launcher's SIGTERM; then the job stops and nothing is
    left."""
    parent = subprocess.Popen([sys.executable, str(JOB), "-w", "2", "--mode", "block", "--child", "--pid-dir",
                               str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True, preexec_fn=as_from_a_terminal)  # its own group, as a job
    found = wait_files(tmp_path, "child1.ready", 1) and wait_files(tmp_path, "rank*.pid", 2)
    everyone = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
    os.killpg(parent.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
    try:
        _, err = parent.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(parent.pid, signal.SIGKILL)
        _, err = parent.communicate()
    try:
        assert found, "the ranks or the child never started"
        assert parent.returncode == 130 and "interrupted" in err, err[-3000:]
        got = (tmp_path / "child1.signal").read_text().splitlines()
        assert got == ["SIGINT"], f"the child got {got}: the launcher's SIGTERM came before it had ended on SIGINT"
        assert wait_dead(everyone) == []
    finally:
        kill_leftovers(everyone)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.sweep), 2])  # 1: make sweep
def test_same_script_under_torchrun(nproc: int, tmp_path) -> None:
    out = tmp_path / "r.json"
    proc = run([*TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), HELLO, "--smoke", "--json", out,
                "--plot-dir", tmp_path], timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())["results"]
    assert result["world_size"] == nproc and result["ok"] is True


DDP_THEN_THREADS = """
import os, sys
sys.path.insert(0, {root!r})
import torch
from torch.nn.parallel import DistributedDataParallel
from mlsys.launch import launch


def worker(ctx):
    ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
    ddp(torch.ones(2, 4)).sum().backward()


if __name__ == "__main__":
    launch(worker, world_size=int(os.environ["WORLD_SIZE"]))
    threads = [open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    with open(os.path.join({out!r}, "rank" + os.environ["RANK"] + ".txt"), "w") as f:  # torchrun merges stdout
        f.write(" ".join(sorted(t for t in threads if "gloo" in t)))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc (Linux)")
@pytest.mark.timeout(120)
def test_a_torchrun_rank_leaves_no_gloo_thread_behind_after_ddp(tmp_path) -> None:
    """Under torchrun a rank tears its interpreter down at exit; gloo threads still running then can abort it
    ("terminate called without an active exception" after ddp_recipe.py's OK line, about 1 run in 8). A
    DistributedDataParallel built inside the job used to keep the default group, and so gloo's threads, alive
    past destroy_process_group (torch's ShardedGradScaler default argument, see _import_before_the_group)."""
    script = tmp_path / "ddp_then_threads.py"
    script.write_text(DDP_THEN_THREADS.format(root=str(ROOT), out=str(tmp_path)))
    proc = run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", script], timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    left = {rank: (tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    assert left == {0: "", 1: ""}, f"gloo threads still running after launch() returned: {left}"


@pytest.mark.timeout(120)
def test_torchrun_world_size_mismatch_is_a_usage_error() -> None:
    proc = run([*TORCHRUN, "--standalone", "--nproc-per-node", "1", JOB, "-w", "3"], timeout=110)
    assert proc.returncode != 0
    assert "disagrees with torchrun's WORLD_SIZE=1" in proc.stderr


@pytest.mark.timeout(60)
def test_verbose_traces_collectives() -> None:
    proc = run([JOB, "-w", "2", "--verbose"])
    assert proc.returncode == 0, proc.stderr
    assert "[rank 0] -> all_reduce(tensor[2]:float32)" in proc.stderr
    assert "[rank 1] <- all_reduce done in" in proc.stderr


@pytest.mark.timeout(90)
def test_verbose_works_with_batched_point_to_point_ops() -> None:
    """dist.P2POp accepts only torch's own isend/irecv; under --verbose a script hands it the traced ones. The
    ring all-reduce (mlsys.collectives) is built from P2POp batches: it must still run and be traced."""
    proc = run([scripts_dir(3) / "ring_allreduce.py", "-w", "2", "--smoke", "--verbose"], timeout=80)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[rank 0] -> batch_isend_irecv(" in proc.stderr and "Invalid op" not in proc.stderr


@pytest.mark.timeout(60)
def test_nccl_without_gpus_is_a_one_line_usage_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = run([JOB, "--backend", "nccl"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "job.py: error: --backend nccl needs CUDA GPUs and this machine has none; use --backend gloo or auto"]


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_nccl_all_reduce_on_gpus(tmp_path) -> None:
    import torch

    world = min(2, torch.cuda.device_count())
    out = tmp_path / "r.json"
    proc = run([JOB, "-w", str(world), "--backend", "nccl", "--json", out])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["results"]["sum"] == [world * (world + 1) / 2] * 2


@pytest.mark.timeout(120)
def test_two_node_torchrun_on_one_machine(tmp_path) -> None:
    """Multi-node torchrun (static rendezvous): two 'nodes' of one process each, node 0 hosting the store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # torchrun's static rendezvous needs the port up front (a test-only race)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    nodes = []
    for node_rank in (0, 1):
        cmd = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank),
               "--master-addr", "127.0.0.1", "--master-port", str(port),
               str(HELLO), "--smoke", "--json", str(tmp_path / f"node{node_rank}.json"), "--plot-dir", str(tmp_path)]
        nodes.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=110) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    result = json.loads((tmp_path / "node0.json").read_text())["results"]  # global rank 0 lives on node 0
    assert result["world_size"] == 2 and result["ok"] is True
    assert not (tmp_path / "node1.json").exists()  # only rank 0 reports


def test_a_ctrl_c_while_a_rank_starts_is_raised_once_it_has_started() -> None:
    """The launcher holds a Ctrl-C back while Process.start() runs (a started rank must have its pid, or nothing
    can stop it), then raises it."""
    from mlsys.launch import _interrupt_after

    reached_end, before = False, signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a script
    try:
        with pytest.raises(KeyboardInterrupt):
            with _interrupt_after():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # a handler that raised would have raised by now, before the next line
                reached_end = True
        assert reached_end
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_launchers_store_listens_on_loopback_only() -> None:
    """The parent's TCPStore (and so tensor-parallel serving's) accepts connections from this machine only: in
    the kernel's own table of listening sockets (/proc/net/tcp, state 0A), the store's port is bound to
    127.0.0.1, not to every interface (0.0.0.0), which TCPStore alone would do."""
    from mlsys.launch import _rendezvous

    env, store = _rendezvous(2, 30)
    port = int(env["MASTER_PORT"])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:
                listening.append(addr)
    assert listening == ["0100007F"], listening           # 127.0.0.1 in the kernel's little-endian hex
    del store



@pytest.mark.timeout(120)
def test_an_omp_num_threads_you_set_wins_over_the_share_of_the_cores(tmp_path) -> None:
    """Each rank gets cores // W threads (test_ok_job_returns_rank0_result) unless you set OMP_NUM_THREADS, which
    wins as it does for torch itself and under torchrun (the launcher used to override it, so
    `OMP_NUM_THREADS=1 python x.py -w 1` still ran two threads on two cores)."""
    out = tmp_path / "r.json"
    proc = run([JOB, "-w", "2", "--json", out], env={"OMP_NUM_THREADS": "3"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["results"]["threads"] == 3
