"""What is this machine wired like? CPU sockets, cores, NUMA nodes and memory; GPUs, NCCL and their links.

What it shows
    A real inspection of the machine it runs on, nothing hard-coded:
      CPU      model (/proc/cpuinfo), sockets, physical cores and hardware threads (/sys/devices/system/cpu
               topology files), the CPUs this process may run on (os.sched_getaffinity), and lscpu's summary
               when the command exists;
      NUMA     the nodes under /sys/devices/system/node with their CPU lists and memory;
      memory   MemTotal from /proc/meminfo;
      GPUs     with CUDA: each device's name, compute capability and memory, the NCCL version torch was built
               with, the peer-access matrix (torch.cuda.can_device_access_peer: can GPU i read GPU j's memory
               directly, over NVLink or PCIe) and the output of `nvidia-smi topo -m` when the command exists.
               Without CUDA it says so plainly;
      NCCL     the environment knobs that steer NCCL (NCCL_ALGO, NCCL_PROTO, NCCL_DEBUG, ...) and their values in
               this environment, and, with 2 or more GPUs, a measurement: chapter 4's bench_collectives.py run in
               a subprocess once per NCCL_ALGO value (Ring, Tree), busbw side by side.
    Figure: topology.png, the machine drawn from what was detected: sockets holding their NUMA nodes (cores,
    threads, memory) and, with GPUs, each GPU under its NUMA node with every pair's `nvidia-smi topo -m` code
    (_topo_draw.py parses the matrix and draws; the JSON keeps what was drawn under "figure"). Without a GPU the
    picture says so. topology_example.png: the same drawing code on an EXAMPLE matrix kept beside this script
    (_topo_example.txt: four GPUs on two NUMA nodes; not this machine, not measured), to show how the codes read
    ("example_figure" in the JSON).
    It checks its own counts against independent sources (the sysfs thread count vs os.cpu_count(), the GPU list vs
    torch.cuda.device_count()).

How to run (a single process: no ranks)
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/topology.py
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/topology.py --json /tmp/topo.json

Contract flags: --smoke skips the NCCL subprocess runs; --seed changes nothing.

Runtime on 2 cores: about 2 s (no GPU); with GPUs add about 20 s for the Ring/Tree runs.

Try next
    python tutorial/part1-distributed/chapter04-nccl-topology/scripts/topology.py \
        --json /tmp/topo.json --plot-dir /tmp/topo
        -> the same report, every count in /tmp/topo.json, and the picture in /tmp/topo/topology.png
    NCCL_ALGO=Tree python tutorial/part1-distributed/chapter04-nccl-topology/scripts/topology.py
        -> the knob table shows NCCL_ALGO=Tree (with 2+ GPUs, the Ring/Tree runs set it per run)
    lscpu; nproc
        -> compare with the CPU section: the script reads the same counts from /sys and /proc
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from _topo_draw import draw_topology, example_machine, parse_topo_matrix

from mlsys import cli, report

BENCH = Path(__file__).resolve().parent / "bench_collectives.py"
EXAMPLE = Path(__file__).resolve().parent / "_topo_example.txt"  # an example `nvidia-smi topo -m`, not measured

# --8<-- [start:knobs]
NCCL_KNOBS = {
    "NCCL_ALGO": "which algorithms NCCL may use (Ring, Tree, CollnetDirect, CollnetChain, NVLS, NVLSTree, PAT)",
    "NCCL_PROTO": "which protocols NCCL may use (LL, LL128, Simple)",
    "NCCL_DEBUG": "logging level (VERSION, WARN, INFO, TRACE); INFO prints the rings/trees and transports chosen",
    "NCCL_DEBUG_SUBSYS": "which parts log at INFO (INIT, COLL, P2P, NET, GRAPH, TUNING, ...); GRAPH: the topology",
    "NCCL_P2P_DISABLE": "1: no direct GPU-to-GPU copies (NVLink/PCIe peer-to-peer); traffic goes through host memory",
    "NCCL_P2P_LEVEL": "the farthest path peer-to-peer may cross (NVL, PIX, PXB, PHB, SYS)",
    "NCCL_SHM_DISABLE": "1: no shared-memory transport between processes on one node",
    "NCCL_IB_DISABLE": "1: no InfiniBand/RoCE; fall back to TCP sockets between nodes",
    "NCCL_SOCKET_IFNAME": "which network interfaces NCCL's sockets use (e.g. eth0, or ^lo to exclude loopback)",
    "NCCL_NET_GDR_LEVEL": "when the NIC may read/write GPU memory directly (GPUDirect RDMA)",
    "NCCL_MIN_NCHANNELS": "lower bound on channels (parallel rings/trees, each driven by its own thread block)",
    "NCCL_MAX_NCHANNELS": "upper bound on channels",
    "NCCL_BUFFSIZE": "bytes of buffer per channel and peer (default 4 MiB)",
    "NCCL_NVLS_ENABLE": "NVLink SHARP: reductions done inside NVSwitch, where the hardware has it",
    "NCCL_TOPO_DUMP_FILE": "write the topology NCCL detected to this XML file",
}
# --8<-- [end:knobs]


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    nccl_max_bytes: int = 64 * 2**20
    """Largest size of the NCCL_ALGO=Ring vs Tree runs (GPU machines only)."""
    skip_nccl_runs: bool = False
    """Do not start the NCCL_ALGO subprocess runs even when there are GPUs."""

    def validate(self) -> None:
        if self.nccl_max_bytes < 1024:
            raise cli.UsageError(f"--nccl-max-bytes must be at least 1024, got {self.nccl_max_bytes}")


def read(path: str | Path) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' (the kernel's list format) -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def cpu_info(numa: list[dict]) -> dict:
    online = parse_cpu_list(read("/sys/devices/system/cpu/online"))
    node_of = {cpu: n["node"] for n in numa for cpu in parse_cpu_list(n["cpus"])}
    packages, cores, threads = set(), set(), []
    for cpu in online:  # each hardware thread says which socket (package) and which core it belongs to
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        package, core = read(f"{topo}/physical_package_id"), read(f"{topo}/core_id")
        packages.add(package)
        cores.add((package, core))
        threads.append({"cpu": cpu, "socket": int(package or 0), "core": int(core or 0), "node": node_of.get(cpu, 0)})
    model = next((line.split(":", 1)[1].strip() for line in read("/proc/cpuinfo").splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown")
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else online
    return {"model": model, "sockets": len(packages), "physical_cores": len(cores), "hardware_threads": len(online),
            "logical_cpus": os.cpu_count(), "usable_by_this_process": len(affinity),
            "threads_per_core": len(online) // max(1, len(cores)), "threads": threads}


def numa_nodes() -> list[dict]:
    nodes = []
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        mem_kb = next((int(line.split()[-2]) for line in read(node / "meminfo").splitlines() if "MemTotal" in line), 0)
        nodes.append({"node": int(node.name[4:]), "cpus": read(node / "cpulist"), "memory_GiB": mem_kb / 2**20})
    return nodes


def memory_gib() -> float:
    line = next((ln for ln in read("/proc/meminfo").splitlines() if ln.startswith("MemTotal")), "MemTotal: 0 kB")
    return int(line.split()[1]) / 2**20


def lscpu_summary() -> dict:
    if not shutil.which("lscpu"):
        return {}
    out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    wanted = ("Model name", "Socket(s)", "Core(s) per socket", "Thread(s) per core", "CPU(s)", "NUMA node(s)",
              "L3 cache", "Hypervisor vendor")
    pairs = (line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {k.strip(): v.strip() for k, v in pairs if k.strip() in wanted}


# --8<-- [start:gpu]
def gpu_info() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"count": torch.cuda.device_count(), "note": "no CUDA GPU on this machine (torch.cuda.is_available() "
                "is False): nothing to report about GPUs, NVLink, peer access or NCCL here"}
    count = torch.cuda.device_count()
    devices = []
    for i in range(count):
        prop = torch.cuda.get_device_properties(i)
        devices.append({"index": i, "name": prop.name, "capability": f"{prop.major}.{prop.minor}",
                        "memory_GiB": prop.total_memory / 2**30, "multiprocessors": prop.multi_processor_count})
    # peer[i][j]: can GPU i address GPU j's memory directly (NVLink or PCIe peer-to-peer)?
    peer = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(count)] for i in range(count)]
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    topo = ""
    if shutil.which("nvidia-smi"):
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    return {"count": count, "devices": devices, "nccl_version": ".".join(map(str, nccl)) if nccl else None,
            "peer_access": peer, "nvidia_smi_topo": topo or "nvidia-smi not found"}
# --8<-- [end:gpu]


# --8<-- [start:algo_runs]
def nccl_algo_runs(num_gpus: int, max_bytes: int) -> list[dict]:
    """bench_collectives.py on every GPU, once per NCCL_ALGO value, each in a fresh process with the env set."""
    rows = []
    for algo in ("Ring", "Tree"):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "bench.json"
            env = {**os.environ, "NCCL_ALGO": algo}
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(key, None)  # a fresh job, not a rank of ours
            cmd = [sys.executable, str(BENCH), "-w", str(num_gpus), "--backend", "nccl", "--min-bytes", "1024",
                   "--max-bytes", str(max_bytes), "--json", str(out), "--plot-dir", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
            if proc.returncode != 0:
                raise cli.SelfCheckFailed(f"NCCL_ALGO={algo} run failed:\n{proc.stderr[-2000:]}")
            for row in json.loads(out.read_text())["results"]["rows"]:
                rows.append({"NCCL_ALGO": algo, "size (B)": row["size (B)"], "time (us)": row["time (us)"],
                             "busbw (GB/s)": row["busbw (GB/s)"]})
    return rows
# --8<-- [end:algo_runs]


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"skip_nccl_runs": True})
    import torch

    numa = numa_nodes()
    cpu, gpus = cpu_info(numa), gpu_info()
    knobs = [{"variable": k, "value": os.environ.get(k, "(unset)"), "what it does": v} for k, v in NCCL_KNOBS.items()]
    print(f"CPU     {cpu['model']}: {cpu['sockets']} socket(s), {cpu['physical_cores']} physical core(s), "
          f"{cpu['hardware_threads']} hardware thread(s) ({cpu['threads_per_core']} per core); this process may use "
          f"{cpu['usable_by_this_process']}")
    print(f"memory  {memory_gib():.1f} GiB")
    print(f"NUMA    {len(numa)} node(s): " + "; ".join(f"node {n['node']} cpus {n['cpus']}, {n['memory_GiB']:.1f} GiB"
                                                     for n in numa))
    numa_total = sum(n["memory_GiB"] for n in numa)
    if numa and abs(numa_total - memory_gib()) > 0.05 * memory_gib():
        print(f"        (the nodes' {numa_total:.1f} GiB and the {memory_gib():.1f} GiB above are counted in "
              "different places, /sys per node and /proc/meminfo for the system; a virtual machine or sandbox can "
              "report them differently, as here: /proc/meminfo is what free and top show)")
    lscpu = lscpu_summary()
    if lscpu:
        print("lscpu   " + ", ".join(f"{k}: {v}" for k, v in lscpu.items()))
    if gpus.get("devices"):
        print(report.table(gpus["devices"], floatfmt=".1f"))
        print(f"NCCL {gpus['nccl_version']}; peer access (row i can read GPU j):")
        print(report.table([{"GPU": i, **{f"->{j}": "yes" if ok else "no" for j, ok in enumerate(row)}}
                            for i, row in enumerate(gpus["peer_access"])]))
        print("nvidia-smi topo -m:\n" + gpus["nvidia_smi_topo"])
    else:
        print(f"GPUs    {gpus['note']}")
    print("\nNCCL environment knobs (values from this environment):")
    print(report.table(knobs))

    algo_rows: list[dict] = []
    if gpus["count"] >= 2 and not args.skip_nccl_runs:
        algo_rows = nccl_algo_runs(gpus["count"], args.nccl_max_bytes)
        print(f"\nNCCL_ALGO=Ring vs Tree, all_reduce on {gpus['count']} GPUs:\n" + report.table(algo_rows, ".2f"))
    else:
        why = "--skip-nccl-runs/--smoke given" if args.skip_nccl_runs else \
            f"it needs at least 2 GPUs and this machine has {gpus['count']}"
        print(f"\nNCCL_ALGO=Ring vs Tree measurement skipped: {why}.")

    # independent sources must agree: the kernel's online-CPU count vs os.cpu_count(), our GPU list vs torch's count
    report.expect_equal("hardware threads (sysfs) vs os.cpu_count()", cpu["hardware_threads"], os.cpu_count())
    report.expect_equal("GPUs listed vs torch.cuda.device_count()", len(gpus.get("devices", [])),
                        torch.cuda.device_count())
    drawn = draw_topology(cpu["threads"], numa, gpus, args)  # the picture, from what was detected above
    # the same drawing code on the example matrix kept beside this script: how to read the codes, on any machine
    example = parse_topo_matrix(EXAMPLE.read_text())
    example_drawn = draw_topology(*example_machine(example), {"devices": example["devices"],
                                                              "nvidia_smi_topo": EXAMPLE.read_text()}, args,
                                  title="EXAMPLE, not this machine, not measured: _topo_example.txt",
                                  file_name="topology_example")
    if args.json:
        report.write_json(args.json, {"figure": drawn, "example_figure": example_drawn, "cpu": cpu,
                                      "numa_nodes": numa, "memory_GiB": memory_gib(),
                                      "lscpu": lscpu, "gpus": gpus, "nccl_env": knobs,
                                      "nccl_algo_runs": algo_rows}, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
