"""topology.py's picture: the machine as topology.py detected it, and a parser for `nvidia-smi topo -m`.

`parse_topo_matrix(text)` reads the matrix nvidia-smi prints (a header of device names, one row per device, a
link code per pair, then the CPU and NUMA affinity columns) into devices, pairs and affinities.
`example_machine(matrix)` makes CPU boxes from a matrix's affinity columns, for the example picture drawn from
_topo_example.txt (an example matrix, not any machine's). `draw_topology(...)` draws sockets -> NUMA nodes (cores,
hardware threads, memory) and, when there are GPUs, one box per GPU under the NUMA node nvidia-smi gives for it, a
line per GPU pair labelled with its code, and above them each NIC joined only to its nearest GPU(s). It returns
what it drew; topology.py keeps that in its --json so that a test can compare it with the kernel's own lists.
"""

from __future__ import annotations

import numpy as np

from mlsys import cli, plot

NEAR = ("NV", "PIX", "PXB", "PHB", "NODE", "SYS")  # nvidia-smi's path codes, nearest first


# --8<-- [start:parse]
def parse_topo_matrix(text: str) -> dict:
    """`nvidia-smi topo -m` -> {"devices": [...], "links": [{"a", "b", "code"}], "cpu_affinity": {dev: "0-7"},
    "numa_affinity": {dev: "0"}}. Rows are the devices (GPU0.., NIC0.., mlx5_0..); a cell is X on the diagonal,
    else the path code (NV#, PIX, PXB, PHB, NODE, SYS). The Legend below the matrix is skipped."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.split()[0].startswith("GPU") and "X" not in ln.split()), None)
    if start is None:
        return {"devices": [], "links": [], "cpu_affinity": {}, "numa_affinity": {}}
    rows = []
    for line in lines[start + 1:]:
        cells = line.split()
        if not cells or cells[0] not in lines[start].split():  # the end of the matrix (Legend:, NIC Legend:)
            break
        rows.append(cells)
    devices = [cells[0] for cells in rows]
    n, links, cpu, numa = len(devices), [], {}, {}
    for i, cells in enumerate(rows):
        for j in range(i + 1, n):
            links.append({"a": devices[i], "b": devices[j], "code": cells[1 + j]})
        extra = cells[1 + n:]  # GPUs: CPU affinity, NUMA affinity (and GPU NUMA ID); NICs: nothing
        if extra:
            cpu[devices[i]] = extra[0]
        if len(extra) > 1:
            numa[devices[i]] = extra[1]
    return {"devices": devices, "links": links, "cpu_affinity": cpu, "numa_affinity": numa}
# --8<-- [end:parse]


def example_machine(matrix: dict) -> tuple[list[dict], list[dict]]:
    """For the example picture: CPU threads and NUMA nodes made from a matrix's own affinity columns (each CPU of a
    GPU's CPU Affinity list on that GPU's NUMA node, one socket per node, one thread per core, memory unknown)."""
    cpus = {}
    for dev, text in matrix["cpu_affinity"].items():  # "0-7" or "0-3,8-11", the kernel's list format
        for lo, _, hi in (part.partition("-") for part in text.split(",") if part):
            cpus.update(dict.fromkeys(range(int(lo), int(hi or lo) + 1), int(matrix["numa_affinity"].get(dev, 0))))
    threads = [{"cpu": c, "socket": n, "core": c, "node": n} for c, n in sorted(cpus.items())]
    return threads, [{"node": n, "memory_GiB": None} for n in sorted(set(cpus.values()))]


def layout(threads: list[dict], numa: list[dict]) -> list[dict]:
    """Sockets, each with its NUMA nodes and their cores and hardware threads, from topology.py's per-thread list
    ({cpu, socket, core, node}) and its NUMA nodes (for their memory)."""
    memory = {n["node"]: n["memory_GiB"] for n in numa}
    sockets: dict = {}
    for t in threads:
        node = sockets.setdefault(t["socket"], {}).setdefault(t["node"], {"cores": set(), "cpus": []})
        node["cores"].add(t["core"])
        node["cpus"].append(t["cpu"])
    return [{"socket": s, "numa_nodes": [{"node": k, "cores": len(v["cores"]), "threads": len(v["cpus"]),
                                          "memory_GiB": memory.get(k, 0.0)} for k, v in sorted(nodes.items())]}
            for s, nodes in sorted(sockets.items())]


# --8<-- [start:draw]
def draw_topology(threads: list[dict], numa: list[dict], gpus: dict, args: cli.PlotArgs,
                  title: str = "this machine, as topology.py detected it", file_name: str = "topology") -> dict:
    """Boxes: a socket holds its NUMA nodes, a node its cores, threads and memory; below, the GPUs (if any), each
    under its NUMA node, joined pair by pair with the code `nvidia-smi topo -m` printed. Returns what it drew."""
    plt = plot.pyplot()
    sockets = layout(threads, numa)
    matrix = parse_topo_matrix(gpus.get("nvidia_smi_topo", "")) if gpus.get("devices") else None
    gpu_names = [d for d in (matrix or {}).get("devices", []) if d.startswith("GPU")]
    slots = [(s["socket"], n) for s in sockets for n in s["numa_nodes"]]
    fig, ax = plt.subplots(figsize=(max(6.0, 3.2 * len(slots)), 4.6 if gpu_names or not matrix else 3.2))
    ax.set_axis_off()
    x = 0.0
    centre = {}
    for s in sockets:
        width = 3.0 * len(s["numa_nodes"])
        ax.add_patch(plt.Rectangle((x, 2.0), width - 0.2, 2.2, fill=False, ec="0.3", lw=1.6))
        ax.text(x + 0.1, 4.05, f"socket {s['socket']}", va="top", fontsize=10, weight="bold")
        for k, node in enumerate(s["numa_nodes"]):
            nx = x + 3.0 * k + 0.15
            ax.add_patch(plt.Rectangle((nx, 2.15), 2.5, 1.5, color="C0", alpha=0.15))
            ax.text(nx + 1.25, 2.9, f"NUMA node {node['node']}\n{node['cores']} core(s), {node['threads']} thread(s)"
                    + (f"\nmemory {node['memory_GiB']:.1f} GiB" if node["memory_GiB"] is not None else ""),
                    ha="center", va="center", fontsize=9)
            centre[str(node["node"])] = nx + 1.25
        x += width
    drawn_gpus, drawn_nics, labels = [], [], []
    if gpu_names:
        per_node: dict = {}
        for name in gpu_names:  # under its NUMA node when nvidia-smi says which, else in a row of their own
            per_node.setdefault(matrix["numa_affinity"].get(name, "N/A"), []).append(name)
        spots = {}
        for node, names in per_node.items():
            mid = centre.get(node, x / 2)
            for i, name in enumerate(names):
                spots[name] = (mid + 0.9 * (i - (len(names) - 1) / 2), 0.6)
                ax.add_patch(plt.Rectangle((spots[name][0] - 0.35, 0.35), 0.7, 0.5, color="C2", alpha=0.3))
                ax.text(*spots[name], name, ha="center", va="center", fontsize=8)
                drawn_gpus.append({"gpu": name, "numa_node": node})
        for link in matrix["links"]:  # GPU pairs: an arc below the row, its code on the arc's lowest point
            if link["a"] in spots and link["b"] in spots:
                (xa, ya), (xb, _) = spots[link["a"]], spots[link["b"]]
                depth, u = 0.2 * abs(xb - xa), np.linspace(0, 1, 50)
                line = ax.plot(xa + (xb - xa) * u, ya - 0.25 - depth * 4 * u * (1 - u), color="0.4", lw=1)[0]
                labels.append((ax.text((xa + xb) / 2, ya - 0.25 - depth, link["code"], ha="center", va="center",
                                       fontsize=7, bbox={"fc": "white", "ec": "none", "pad": 0.5}), line))
        for nic in [d for d in matrix["devices"] if not d.startswith("GPU")]:  # a row above: each NIC, joined
            codes = {(lk["b"] if lk["a"] == nic else lk["a"]): lk["code"] for lk in matrix["links"]  # to its
                     if nic in (lk["a"], lk["b"]) and (lk["a"] in spots or lk["b"] in spots)}  # nearest GPU(s)
            best = min(codes.values(), key=lambda c: next((k for k, p in enumerate(NEAR) if c.startswith(p)), 9))
            near = [g for g, c in codes.items() if c == best]
            cx = sum(spots[g][0] for g in near) / len(near) + 0.8 * sum(d["near"] == near for d in drawn_nics)
            ax.add_patch(plt.Rectangle((cx - 0.35, 1.3), 0.7, 0.4, color="C1", alpha=0.3))
            ax.text(cx, 1.5, nic, ha="center", va="center", fontsize=8)
            for g in near:
                line = ax.plot([cx, spots[g][0]], [1.3, 0.85], color="0.4", lw=1)[0]
                labels.append((ax.text((cx + spots[g][0]) / 2, 1.075, best, ha="center", va="center", fontsize=7,
                                       bbox={"fc": "white", "ec": "none", "pad": 0.5}), line))
            drawn_nics.append({"nic": nic, "near": near, "code": best})
    else:
        ax.text(x / 2, 1.2, "no CUDA GPU on this machine: no GPUs, NVLink or PCIe paths to draw"
                if not gpus.get("devices") else "GPUs found, but no `nvidia-smi topo -m` matrix to read links from",
                ha="center", va="center", fontsize=9, style="italic", color="0.35")
    ax.set_xlim(-0.2, x + 0.2)
    ax.set_ylim(-0.9 if gpu_names else 0.6, 4.4)
    ax.set_title(title, fontsize=10)
    fig.canvas.draw()  # each label's box and its line in pixels: a test checks it sits on its line, on no other label
    boxes = [{"text": t.get_text(), "box": [round(v, 1) for v in t.get_window_extent().extents],
              "line": ax.transData.transform(line.get_xydata()).round(1).tolist()} for t, line in labels]
    print(f"figure: {plot.save(fig, args, file_name)}")
    return {"sockets": sockets, "gpus": drawn_gpus, "nics": drawn_nics, "labels": boxes,
            "links": matrix["links"] if matrix else [], "no_gpu": not gpus.get("devices")}
# --8<-- [end:draw]
