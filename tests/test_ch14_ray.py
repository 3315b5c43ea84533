"""Chapter 14 on Ray (scripts/ray_placement.py): the Ray run computes what the launcher run (placement.py) computes,
bit for bit; a local two-node Ray cluster places the roles on the nodes the flags name, as the actors themselves
report; a killed actor is named by role and node; and no Ray process outlives a run or a test.

Every Ray run here gets its own RAY_TMPDIR, so the Ray processes it starts (gcs_server, raylet, workers, agents)
are found by that folder in their command line, by pid, without touching anyone else's.

    python -m pytest -m long tests/test_ch14_ray.py      # (make sweep runs them)"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ROOT, scripts_dir

psutil = pytest.importorskip("psutil")
pytest.importorskip("ray")

# Every case starts Ray (5-10 s) and its worker groups (about 10 s each): about 4 minutes in all on 2 cores, so they
# run in `make sweep` (CI runs it after `make test`), beside the other long checks.
pytestmark = pytest.mark.long

CH14 = scripts_dir(14)
SMOKE = ["--smoke"]


def ray_processes(root: str) -> dict[int, str]:
    """Live processes of the Ray instance under `root`: its folder in their command line, or a child of one."""
    found: dict[int, str] = {}
    procs = list(psutil.process_iter(["pid", "ppid", "name", "cmdline"]))
    def name(p) -> str:  # an actor's title is in its command line even where the kernel's 15-byte name is not
        cmd = " ".join(p.info["cmdline"] or [])
        return "ray::RoleWorker" if "RoleWorker" in cmd else p.info["name"]

    for p in procs:
        try:
            if root in " ".join(p.info["cmdline"] or []):
                found[p.pid] = name(p)
        except psutil.Error:
            continue
    for p in procs:
        if p.info["ppid"] in found and p.pid not in found:
            found[p.pid] = name(p)
    return found


def left_over(pids: dict[int, str], grace: float = 20.0) -> list[str]:
    """The pids of `pids` still running after `grace` seconds (zombies count as gone)."""
    deadline = time.monotonic() + grace
    while True:
        alive = []
        for pid, name in pids.items():
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid} {name}")
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _sigint_as_in_a_terminal() -> None:
    """In the child before exec: SIGINT back to its default. A command started with `&` by a non-interactive shell
    (as `make sweep` may be, in CI) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler,
    so the driver would never see the Ctrl-C this test presses; a terminal's Ctrl-C always finds the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_watched(args: list, timeout: float = 240, interrupt: bool = False,
                presses: list[float] | None = None) -> tuple[subprocess.CompletedProcess, dict[int, str]]:
    """Run `python args...` with its own RAY_TMPDIR; return the result and every Ray process seen while it ran.
    interrupt: press Ctrl-C (SIGINT to the driver) once the first role actor is up; `presses` gets the seconds from
    the start to the press."""
    root = tempfile.mkdtemp(prefix="rayt", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "RAY_TMPDIR": root, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, *map(str, args)], stdout=out, stderr=err, env=env, cwd=ROOT,
                                preexec_fn=_sigint_as_in_a_terminal if interrupt else None)
        seen: dict[int, str] = {}
        start = time.monotonic()
        deadline = start + timeout
        pressed = presses if presses is not None else []
        while proc.poll() is None:
            seen.update(ray_processes(root))
            if interrupt and any("RoleWorker" in name for name in seen.values()):
                proc.send_signal(signal.SIGINT)
                pressed.append(time.monotonic() - start)
                interrupt = False
            if time.monotonic() > deadline:
                proc.kill()
                break
            time.sleep(0.3)
        proc.wait()
        out.seek(0), err.seek(0)
        done = subprocess.CompletedProcess(args, proc.returncode, out.read(), err.read())
    shutil.rmtree(root, ignore_errors=True)
    return done, seen


def check_nothing_left(seen: dict[int, str]) -> None:
    """Every Ray process seen during the run has exited; any that has not is killed here (by pid: they are this
    test's own, found under its RAY_TMPDIR), then reported."""
    assert any(name in ("raylet", "gcs_server") for name in seen.values()), f"no Ray process was seen: {seen}"
    alive = left_over(seen)
    for entry in alive:
        try:
            psutil.Process(int(entry.split()[0])).kill()
        except psutil.Error:
            pass
    assert alive == [], "Ray processes outlived the run"


# ------------------------------------------------------------------------------------------ equality
@pytest.fixture(scope="module")
def both_runs(tmp_path_factory) -> dict:
    """ray_placement.py and placement.py, --smoke each, with their JSON and their saved final actor weights."""
    out = tmp_path_factory.mktemp("ray_vs_launcher")
    proc, seen = run_watched([CH14 / "ray_placement.py", *SMOKE, "--json", out / "ray.json", "--save-weights",
                              out / "ray_w", "--plot-dir", out / "figures"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    check_nothing_left(seen)  # (4): after the script
    launcher = subprocess.run([sys.executable, CH14 / "placement.py", *SMOKE, "--json", out / "launcher.json",
                               "--save-weights", out / "launcher_w", "--plot-dir", out / "launcher_figures"],
                              capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert launcher.returncode == 0, launcher.stderr[-3000:]
    return {"dir": out, "ray": json.loads((out / "ray.json").read_text()),
            "launcher": json.loads((out / "launcher.json").read_text())}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("placement", ["colocated", "disaggregated", "async"])
def test_ray_run_equals_launcher_run_bitwise(both_runs: dict, placement: str) -> None:
    """Per-iteration rewards and KL as each script recorded them, and the final actor weights each saved, tensor by
    tensor with torch.equal: the same bits, whether ranks or Ray actors ran the roles."""
    import torch

    ray_stats = both_runs["ray"]["results"][placement]["stats"]
    launcher_stats = both_runs["launcher"]["results"][placement]["stats"]
    assert len(ray_stats) == len(launcher_stats) == both_runs["ray"]["settings"]["iterations"]
    for key in ("reward", "kl", "off_policy_gap"):
        assert [s[key] for s in ray_stats] == [s[key] for s in launcher_stats], key
    a = torch.load(both_runs["dir"] / "ray_w" / f"{placement}.pt")
    b = torch.load(both_runs["dir"] / "launcher_w" / f"{placement}.pt")
    assert list(a) == list(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.timeout(600)
def test_pools_picture_against_the_placement_asked_for(both_runs: dict) -> None:
    """pools.png is drawn from the recorded pools (Ray's placement-group table) and actors (what each actor said
    about itself). Against the layout worked out here from W alone: co-located, one pool of W bundles and actor r
    (role all) in bundle r; disaggregated and async, a trainer pool of one bundle with trainer-0 and a rollout pool
    of W - 1 bundles with rollout-r in bundle r - 1. Every actor ran on the node Ray reserved its bundle on, in a
    process of its own."""
    res, W = both_runs["ray"]["results"], both_runs["ray"]["settings"]["world_size"]
    want = {"colocated": [("colocated", W, [("all", r, r) for r in range(W)])],
            "disaggregated": [("trainer", 1, [("trainer", 0, 0)]),
                              ("rollout", W - 1, [("rollout", r, r - 1) for r in range(1, W)])]}
    want["async"] = want["disaggregated"]
    pids = []
    for placement, pools in want.items():
        got = res[placement]
        assert [(p["name"], len(p["bundles"])) for p in got["pools"]] == [(n, k) for n, k, _ in pools]
        actors = [(a["pool"], a["role"], a["rank"], a["bundle"]) for a in got["actors"]]
        assert actors == [(n, role, r, b) for n, _, members in pools for role, r, b in members]
        node_of = {(p["name"], b["index"]): b["node_id"] for p in got["pools"] for b in p["bundles"]}
        for a in got["actors"]:
            assert a["node_id"] == node_of[(a["pool"], a["bundle"])], a
            assert a["assigned"].get("GPU") == 1.0  # a whole (logical) GPU per bundle
        pids.append([a["pid"] for a in got["actors"]])
    # co-located: W processes of its own; async reuses the disaggregated actors (their models rebuilt)
    assert len(set(pids[0] + pids[1])) == 2 * W and pids[2] == pids[1]
    assert (both_runs["dir"] / "figures" / "pools.png").exists()


# ------------------------------------------------------------------------------------------ a two-node cluster
@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster: a head with no GPU, node A advertising trainer_node, node B rollout_node, 2 logical
    GPUs each. Yields (cluster, root); afterwards, checks that none of its processes is left."""
    from ray.cluster_utils import Cluster

    root = tempfile.mkdtemp(prefix="rayc", dir="/tmp")
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = root  # every node of the cluster, and the address file, under root
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False,
                                                      "object_store_memory": 100 * 2**20})
    nodes = {"A": c.add_node(num_cpus=2, num_gpus=2, resources={"trainer_node": 1},
                             object_store_memory=100 * 2**20),
             "B": c.add_node(num_cpus=2, num_gpus=2, resources={"rollout_node": 1},
                             object_store_memory=100 * 2**20)}
    c.wait_for_nodes()
    try:
        yield c, nodes, root
    finally:
        seen = ray_processes(root)
        c.shutdown()
        os.environ.pop("RAY_TMPDIR") if saved is None else os.environ.update(RAY_TMPDIR=saved)
        shutil.rmtree(root, ignore_errors=True)
        check_nothing_left(seen)  # (4): after the test


@pytest.mark.timeout(600)
def test_roles_land_on_the_named_nodes(cluster) -> None:
    c, nodes, root = cluster
    out = Path(root) / "r.json"
    proc = subprocess.run([sys.executable, CH14 / "ray_placement.py", *SMOKE, "--address", c.address,
                           "--trainer-on", "trainer_node", "--rollout-on", "rollout_node", "--strategy", "SPREAD",
                           "--placements", "colocated", "disaggregated", "--json", out,
                           "--plot-dir", Path(root) / "figures"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    a, b = nodes["A"].node_id, nodes["B"].node_id
    # disaggregated: the trainer on the node with trainer_node, every rollout actor on the one with rollout_node
    where = {(x["role"], x["rank"]): x["node_id"] for x in res["disaggregated"]["actors"]}
    assert where == {("trainer", 0): a, ("rollout", 1): b}
    # co-located, SPREAD over the two GPU nodes: one actor on each (the head has no GPU, so no bundle there)
    assert sorted(x["node_id"] for x in res["colocated"]["actors"]) == sorted([a, b])


@pytest.mark.timeout(300)
def test_a_node_resource_no_node_advertises_is_refused_at_once(cluster) -> None:
    """A pool asking for a resource no node has could never be placed: one line, exit 2, not a wait for --timeout."""
    c, _, _ = cluster
    proc = subprocess.run([sys.executable, CH14 / "ray_placement.py", *SMOKE, "--address", c.address,
                           "--trainer-on", "no_such_node", "--rollout-on", "rollout_node"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"ray_placement.py: error: no node of the cluster at {c.address} advertises no_such_node"], proc.stderr


@pytest.mark.timeout(600)
def test_killed_generation_actor_is_named_with_its_node(cluster) -> None:
    c, nodes, _ = cluster
    proc = subprocess.run([sys.executable, CH14 / "ray_placement.py", *SMOKE, "--address", c.address,
                           "--trainer-on", "trainer_node", "--rollout-on", "rollout_node",
                           "--placements", "disaggregated", "--fault", "generate"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr
    assert "generation actor rollout-1" in lines[0] and "iteration 1" in lines[0], lines[0]
    assert f"node {nodes['B'].node_id}" in lines[0], lines[0]


@pytest.mark.timeout(600)
def test_killed_trainer_is_named_and_nothing_is_left() -> None:
    proc, seen = run_watched([CH14 / "ray_placement.py", *SMOKE, "--placements", "disaggregated",
                              "--fault", "train"])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr
    m = re.search(r"trainer actor trainer-0 \(pid (\d+), node ([0-9a-f]{56})\) died in train of iteration 1",
                  lines[0])
    assert m, lines[0]
    assert int(m[1]) in seen  # a process of this run's Ray
    check_nothing_left(seen)


@pytest.mark.timeout(600)
def test_ctrl_c_leaves_nothing() -> None:
    """Ctrl-C once the actors are up: the driver's `finally` shuts Ray down; exit 130, one line. 200 iterations keep
    the loop running well past the moment the test sees an actor and presses Ctrl-C. The driver starts with SIGINT
    at its default, as under a terminal (`_sigint_as_in_a_terminal`): run from a backgrounded `make sweep`, it had
    inherited SIGINT ignored and ran all 200 iterations through two presses (exit 0)."""
    presses: list[float] = []
    proc, seen = run_watched([CH14 / "ray_placement.py", *SMOKE, "--placements", "disaggregated",
                              "--iterations", "200"], interrupt=True, presses=presses)
    why = f"Ctrl-C pressed at {presses} s; processes seen: {sorted(set(seen.values()))}\n"
    assert proc.returncode == 130, why + proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == ["ray_placement.py: interrupted"]
    assert any("RoleWorker" in name for name in seen.values())
    check_nothing_left(seen)
