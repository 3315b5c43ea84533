"""Chapter 1 oracles: what each rank holds after all_gather / all_reduce, against numpy; the environment check."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, _script_env, load_script, run, scripts_dir

CH01 = scripts_dir(1)


def load(name: str):
    return load_script(CH01 / f"{name}.py")


def numpy_reference(world_size: int, numel: int) -> tuple[np.ndarray, np.ndarray]:
    per_rank = np.arange(world_size * numel, dtype=np.float32).reshape(world_size, numel)  # row r = rank r's data
    return per_rank, per_rank.sum(axis=0)


@pytest.mark.parametrize("world_size, numel", [(1, 1), (2, 3), (5, 4), (8, 2)])
def test_expected_values_match_numpy(world_size: int, numel: int) -> None:
    hello = load("hello_distributed")
    gathered, summed = numpy_reference(world_size, numel)
    np.testing.assert_array_equal(hello.expected_gather(world_size, numel).numpy(), gathered)
    np.testing.assert_array_equal(hello.expected_sum(world_size, numel).numpy(), summed)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.sweep), 3])  # W=1: make sweep
def test_every_rank_holds_the_numpy_result(world_size: int, tmp_path) -> None:
    out = tmp_path / "r.json"
    proc = run([CH01 / "hello_distributed.py", "-w", world_size, "--numel", 4, "--json", out, "--plot-dir", tmp_path])
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())["results"]
    gathered, summed = numpy_reference(world_size, 4)
    assert len(result["per_rank"]) == world_size
    for rank, held in enumerate(result["per_rank"]):
        np.testing.assert_array_equal(held["before"], gathered[rank])
        np.testing.assert_array_equal(held["gathered"], gathered.ravel())
        np.testing.assert_array_equal(held["summed"], summed)
    assert (tmp_path / "placement.png").stat().st_size > 1000
    if world_size > 1:
        check_launcher_tree(json.loads(out.read_text())["results"], world_size)
    assert (tmp_path / "layout.png").stat().st_size > 1000


def check_launcher_tree(result: dict, world_size: int) -> None:
    """The launcher's drawn tree: the parent's own pid (recorded by the parent) on top, one fork server under it,
    W ranks under that; the parent holds the store's listening socket and every rank connects to it."""
    drawn, parent = result["layout"]["drawn"], result["layout"]["parent_pid"]
    ranks = {n["rank"]: n["pid"] for n in drawn["nodes"] if "rank" in n}
    assert sorted(ranks) == list(range(world_size)) and len(drawn["nodes"]) == world_size + 2
    middle = [n["pid"] for n in drawn["nodes"] if "rank" not in n and n["pid"] != parent]
    assert len(middle) == 1
    want = [(parent, middle[0])] + [(middle[0], pid) for pid in ranks.values()]
    assert sorted(map(tuple, drawn["edges"])) == sorted(want)
    assert drawn["store"]["listener"] == parent and sorted(drawn["clients"]) == sorted(ranks.values())


@pytest.mark.timeout(120)
def test_crashing_rank_ends_the_job_with_exit_1() -> None:
    proc = run([CH01 / "hello_distributed.py", "--smoke", "--crash-rank", "1"])
    assert proc.returncode == 1
    assert "RuntimeError: rank 1 crashes on purpose" in proc.stderr and "rank 1 failed" in proc.stderr


@pytest.mark.timeout(120)
def test_env_check_reports_ready_here(tmp_path) -> None:
    out = tmp_path / "env.json"
    proc = run([CH01 / "env_check.py", "--json", out])
    doc = json.loads(out.read_text())["results"]
    checks = {row["check"]: row for row in doc["checks"]}
    assert proc.returncode == 0 and doc["ready"], proc.stdout
    assert checks["2-rank all_reduce (gloo)"]["status"] == "ok"
    assert "ranks hold [3.0, 3.0], expected 3" in checks["2-rank all_reduce (gloo)"]["detail"]
    assert checks["spawn a process"]["status"] == "ok"


def test_env_check_flags_an_old_torch() -> None:
    env_check = load("env_check")
    assert env_check.version_tuple("2.13.0+cpu") >= env_check.MIN_TORCH
    assert env_check.version_tuple("2.12.1") < env_check.MIN_TORCH


@pytest.mark.timeout(120)
def test_env_check_require_gpu_fails_without_one() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = run([CH01 / "env_check.py", "--require-gpu"])
    assert proc.returncode == 1 and "NOT READY: cuda devices" in proc.stdout


@pytest.mark.timeout(120)
def test_hand_built_groups_from_tcp_and_file_stores(tmp_path) -> None:
    out = tmp_path / "r.json"
    proc = run([CH01 / "rendezvous.py", "-w", "3", "--json", out, "--plot-dir", tmp_path])
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "steps.png").is_file()
    rows = json.loads(out.read_text())["results"]["rows"]
    for kind in ("tcp", "file"):
        mine = [r for r in rows if r["store"] == kind]
        assert sorted(r["ticket"] for r in mine) == [1, 2, 3]  # the atomic counter: one ticket per rank
        assert all(r["peers_seen"] == 3 and r["all_reduce"] == 6.0 for r in mine)
    assert "drew the FileStore's last ticket (3)" in json.loads(out.read_text())["results"]["file_store_text"]


def test_file_store_text_follows_the_rows() -> None:
    mod = load_script(CH01 / "rendezvous.py")

    def rows(*bars: tuple[int, float, float]) -> list[dict]:  # (ticket, blue, orange) for ranks 0, 1, ...
        tcp = [{"store": "tcp", "rank": r, "ticket": 1, "rendezvous_ms": 0.0, "build_group_ms": 99.0}
               for r in range(len(bars))]  # the TCP store's rows are never read
        return tcp + [{"store": "file", "rank": r, "ticket": t, "rendezvous_ms": b, "build_group_ms": o}
                      for r, (t, b, o) in enumerate(bars)]

    usual = mod.file_store_text(rows((4, 1.7, 20.9), (1, 11.3, 10.8), (3, 12.4, 10.8), (2, 11.5, 11.2)))
    assert usual.startswith("In this run rank 0 drew the FileStore's last ticket (4) and had the shortest blue bar")
    assert "(1.7 ms, the others 11.3 to 12.4 ms)" in usual
    assert "orange bar was the longest (20.9 ms, the others 10.8 to 11.2 ms): it waited in gloo's" in usual
    # the round-1 reading: the last ticket short in blue, but the others waited as long in gloo's exchange
    flat = mod.file_store_text(rows((1, 12.0, 10.5), (2, 11.0, 10.5), (4, 2.0, 10.5), (3, 11.5, 10.5)))
    assert "rank 2 drew" in flat and "had the shortest blue bar" in flat
    assert "orange bar was not the longest (10.5 ms, the others 10.5 ms)." in flat and "waited in gloo" not in flat
    late = mod.file_store_text(rows((2, 3.0, 12.0), (1, 4.0, 11.0), (3, 9.0, 10.0)))
    assert "rank 2 drew the FileStore's last ticket (3) but not the shortest blue bar (9.0 ms" in late
    assert "did not wait in `store.wait`" in late
    assert "With a single rank" in mod.file_store_text(rows((1, 1.0, 1.0)))


@pytest.mark.timeout(120)
def test_verbose_traces_the_scripts_own_calls_only(tmp_path) -> None:
    proc = run([CH01 / "hello_distributed.py", "--smoke", "--verbose", "--plot-dir", tmp_path])
    assert proc.returncode == 0, proc.stderr
    starts = [line for line in proc.stderr.splitlines() if " -> " in line]
    for rank in (0, 1):
        called = [line.split(" -> ")[1].split("(")[0] for line in starts if line.startswith(f"[rank {rank}]")]
        # print_ordered's internal gathers are not traced; the worker's own final all_gather_object is
        assert called == ["all_gather", "all_reduce", "all_gather_object"], called
    assert "all_reduce(tensor[2]:float32, op=SUM)" in proc.stderr


def bare_spawn_reference(world_size: int, numel: int, seed: int) -> np.ndarray:
    """The sum bare_spawn.py's all_reduce must give: each rank's seeded tensor, summed by numpy."""
    import torch

    per_rank = [torch.randn(numel, generator=torch.Generator().manual_seed(seed + r), dtype=torch.float64).numpy()
                for r in range(world_size)]
    return np.sum(per_rank, axis=0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.sweep), 3,
                                        pytest.param(5, marks=pytest.mark.sweep)])  # 1 and 5: make sweep
def test_bare_spawn_all_reduce_matches_numpy(world_size: int, tmp_path) -> None:
    """The book-free mp.spawn program: every rank reports, rank 0's sum equals numpy's."""
    out = tmp_path / "r.json"
    proc = run([CH01 / "bare_spawn.py", "-w", world_size, "--numel", 6, "--seed", 7, "--json", out], timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert sorted(line.split(" (")[0] for line in lines) == [f"rank {r} of {world_size}" for r in range(world_size)]
    result = json.loads(out.read_text())["results"]
    np.testing.assert_allclose(result["sum"], bare_spawn_reference(world_size, 6, 7), rtol=0, atol=1e-12)
    # the drawn tree against what the processes printed themselves: the parent its pid and the store's address,
    # each rank its pid and its parent's pid
    parent = re.search(r"parent pid (\d+): spawning \d+ ranks; they meet at (\S+)", proc.stdout)
    printed = {int(r): (int(pid), int(ppid)) for r, pid, ppid in
               re.findall(r"rank (\d+) of \d+ \(pid (\d+), parent (\d+)\)", proc.stdout)}
    assert {ppid for _, ppid in printed.values()} == {int(parent.group(1))}  # mp.spawn: all children of the parent
    check_tree(result["layout"]["drawn"], int(parent.group(1)), printed, parent.group(2), listener=printed[0][0])


def check_tree(drawn: dict, root: int, printed: dict[int, tuple[int, int]], address: str, listener: int) -> None:
    """A one-level tree: `root` above W ranks (their printed pids), `listener` holding the store at `address`."""
    ranks = {n["rank"]: n["pid"] for n in drawn["nodes"] if "rank" in n}
    assert ranks == {r: pid for r, (pid, _) in printed.items()}
    assert [n["pid"] for n in drawn["nodes"] if "rank" not in n] == [root]
    assert sorted(map(tuple, drawn["edges"])) == sorted((root, pid) for pid, _ in printed.values())
    assert drawn["store"] == {"address": address, "listener": listener}
    assert sorted(drawn["clients"]) == sorted(pid for pid, _ in printed.values())


@pytest.mark.timeout(180)
def test_bare_spawn_runs_under_torchrun_and_reports_a_crashing_rank(tmp_path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = tmp_path / "r.json"
    # Popen, not run(): the test records torchrun's own pid, which the drawn tree must have as the ranks' parent
    agent = subprocess.Popen([*torchrun, str(CH01 / "bare_spawn.py"), "--numel", "3", "--json", str(out),
                              "--plot-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=_script_env(None), cwd=ROOT)
    stdout, stderr = agent.communicate(timeout=110)
    assert agent.returncode == 0, stderr[-3000:]
    assert sum(line.startswith("rank ") and "of 2" in line for line in stdout.splitlines()) == 2
    result = json.loads(out.read_text())["results"]
    np.testing.assert_allclose(result["sum"], bare_spawn_reference(2, 3, 0), rtol=0, atol=1e-12)
    printed = {int(r): (int(pid), int(ppid)) for r, pid, ppid in
               re.findall(r"rank (\d+) of 2 \(pid (\d+), parent (\d+)\)", stdout)}
    store = f"{result['layout']['ranks'][0]['store']}"
    assert store.rsplit(":", 1)[0] in ("localhost", "127.0.0.1") and (tmp_path / "layout.png").is_file()
    check_tree(result["layout"]["drawn"], agent.pid, printed, store, listener=agent.pid)  # the agent hosts it
    # mp.spawn passes on one failed process's traceback (not always the rank that crashed) and stops the rest
    crash = run([CH01 / "bare_spawn.py", "-w", 3, "--crash-rank", 1], timeout=110)
    assert crash.returncode == 1, crash.stderr[-3000:]
    assert "a rank failed; the others were terminated" in crash.stderr
    assert "terminated with the following error" in crash.stderr


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc")
def test_observe_finds_the_listener_and_the_connections_of_a_real_socket() -> None:
    """_layout.observe against sockets this test opens itself: it listens, then connects twice."""
    layout = load_script(CH01 / "_layout.py")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        seen = layout.observe(port)
        assert seen["store_listener"] == os.getpid() and seen["store_connections"] == 0
        assert seen["pid"] == os.getpid() and seen["ppid"] == os.getppid()
        with socket.create_connection(("127.0.0.1", port)), socket.create_connection(("127.0.0.1", port)):
            assert layout.observe(port)["store_connections"] == 2
    assert layout.observe(port)["store_listener"] is None
