"""Chapter 1's process-layout picture: what each rank observed about itself, drawn as a process tree.

`observe(port)` runs inside a rank and uses only the standard library and Linux's /proc: this process's pid, its
parent's pid and its grandparent's, which of those three processes holds the socket that listens on the store's
port, and how many connections this process has open to that port. `draw(...)` turns the ranks' observations
into a tree (parent -> [fork server or torchrun agent ->] ranks, plus the store and who connects to it) and returns
the nodes and edges it drew, so a test can compare them with pids recorded elsewhere. On a system without /proc
the tree is still drawn from the pids; the store is then marked "not observed".
"""

from __future__ import annotations

import math
import os
from typing import Any


def parent_of(pid: int) -> int | None:
    """The parent pid of `pid`, read from /proc/<pid>/stat (None where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state letter
    except (OSError, ValueError, IndexError):
        return None


def launcher_command(pid: int, default: str) -> str:
    """The torchrun command that started `pid` as it was typed, up to the script (`torchrun --standalone
    --nproc-per-node 2`), read from /proc/<pid>/cmdline; `default` where that does not show a torchrun."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return default
    for i, arg in enumerate(argv):
        if os.path.basename(arg) == "torchrun" or arg == "torch.distributed.run":
            flags = []
            for rest in argv[i + 1:]:
                if rest.endswith(".py"):
                    break
                flags.append(rest)
            return " ".join(["torchrun", *flags])
    return default


def _socket_inodes(pid: int) -> set[int]:
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(int(link[8:-1]))
    return found


def _tcp_sockets() -> list[tuple[int, int, str, int]]:
    """(local port, remote port, state, inode) of every TCP socket of this machine; state 0A = LISTEN, 01 = open."""
    rows = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            rows.append((int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16), cols[3], int(cols[9])))
    return rows


def observe(port: int) -> dict[str, Any]:
    """What this process can see of its place in the job: its pid, parent, grandparent and the store's sockets."""
    pid, ppid = os.getpid(), os.getppid()
    grandparent = parent_of(ppid)
    sockets = _tcp_sockets()
    listening = {inode for lport, _, state, inode in sockets if lport == port and state == "0A"}
    listener = next((p for p in (pid, ppid, grandparent) if p and _socket_inodes(p) & listening), None)
    mine = _socket_inodes(pid)
    connected = sum(1 for _, rport, state, inode in sockets if rport == port and state == "01" and inode in mine)
    return {"pid": pid, "ppid": ppid, "grandparent": grandparent, "store_listener": listener,
            "store_connections": connected, "observed_sockets": bool(sockets)}


def tree(ranks: list[dict], root: int, roles: dict[int, str]) -> dict[str, Any]:
    """Nodes and edges of the process tree the ranks observed, from `root` down. A rank's parent that is not
    `root` sits between them (a fork server, a torchrun agent): its own parent is the rank's observed grandparent."""
    nodes = {root: {"pid": root, "label": roles.get(root, f"process {root}"), "level": 0}}
    edges = []
    for r in ranks:
        if r["ppid"] != root and r["ppid"] not in nodes:
            nodes[r["ppid"]] = {"pid": r["ppid"], "label": roles.get(r["ppid"], f"process {r['ppid']}"), "level": 1}
            edges.append([r["grandparent"], r["ppid"]])
        nodes[r["pid"]] = {"pid": r["pid"], "label": f"rank {r['rank']} (local rank {r['local_rank']})",
                           "level": nodes[r["ppid"]]["level"] + 1 if r["ppid"] in nodes else 1, "rank": r["rank"]}
        edges.append([r["ppid"], r["pid"]])
    listeners = {r["store_listener"] for r in ranks} - {None}  # a rank sees itself, its parent, its grandparent
    listener = listeners.pop() if len(listeners) == 1 else None
    return {"nodes": list(nodes.values()), "edges": edges,
            "store": {"address": ranks[0]["store"], "listener": listener},
            "clients": [r["pid"] for r in ranks if r["store_connections"] > 0]}


def draw(ranks: list[dict], root: int, roles: dict[int, str], args: Any, name: str, title: str) -> tuple[str, dict]:
    """Draw the tree (boxes = processes, arrows = parent -> child, dashed = connections to the store) and return
    (the saved path, the nodes and edges drawn)."""
    from mlsys import plot

    plt = plot.pyplot()
    drawn = tree(ranks, root, roles)
    levels: dict[int, list[dict]] = {}
    for node in drawn["nodes"]:
        levels.setdefault(node["level"], []).append(node)
    width = max(len(v) for v in levels.values())
    depth = len(levels)  # the store goes on a row of its own, below the ranks
    fig, ax = plt.subplots(figsize=(2.2 * max(width, 2) + 1.0, 1.0 + 1.1 * (depth + 1)))
    where = {}
    for level, row in levels.items():
        row.sort(key=lambda n: n.get("rank", -1))
        for i, node in enumerate(row):
            where[node["pid"]] = ((i + 0.5) * width / len(row), -level)
    store_xy = (width / 2, -depth)
    listener = drawn["store"]["listener"]
    boxes = {}  # pid (or "store") -> the text box drawn there
    for node in drawn["nodes"]:
        hosts = node["pid"] == listener
        boxes[node["pid"]] = ax.text(
            *where[node["pid"]], f"{node['label']}\npid {node['pid']}" + ("\nhosts the store" if hosts else ""),
            ha="center", va="center", fontsize=8, zorder=5,
            bbox={"boxstyle": "round", "fc": "#fde0c5" if hosts else ("#dbe9f6" if "rank" in node else "#eeeeee"),
                  "ec": "C1" if hosts else "#777777"})
    store_text = (f"TCPStore {drawn['store']['address']}\n"
                  + ("listening socket held by pid " + str(listener) if listener else "listener not observed"))
    boxes["store"] = ax.text(*store_xy, store_text, ha="center", va="center", fontsize=8, zorder=5,
                             bbox={"boxstyle": "round", "fc": "#fff4e6", "ec": "C1", "lw": 1.5})
    ax.set_xlim(-0.1, width + 0.3)
    ax.set_ylim(-depth - 0.8, 0.5)
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    fig.canvas.draw()  # lays the boxes out, so the arrows can start and end at their edges
    to_data = ax.transData.inverted()
    half = {}  # each box's half width and half height, in data units
    for key, text in boxes.items():
        (x0, y0), (x1, y1) = to_data.transform(text.get_bbox_patch().get_window_extent())
        half[key] = ((x1 - x0) / 2, (y1 - y0) / 2)
    xy = where | {"store": store_xy}

    def edge(a: Any, b: Any, shift: tuple[float, float]) -> tuple[float, float]:
        """Where the straight line from the centre of box `a` (moved by `shift`) towards box `b` (moved the
        same) leaves box `a`."""
        (xa, ya), (xb, yb), (hw, hh), (sx, sy) = xy[a], xy[b], half[a], shift
        dx, dy = xb - xa, yb - ya
        t = min((hw - math.copysign(1, dx) * sx) / abs(dx) if dx else math.inf,
                (hh - math.copysign(1, dy) * sy) / abs(dy) if dy else math.inf)
        return xa + sx + t * dx, ya + sy + t * dy

    def arrow(a: Any, b: Any, offset: float = 0.0, **style: Any) -> None:
        """An arrow from box `a`'s edge to box `b`'s, moved `offset` data units sideways."""
        (xa, ya), (xb, yb) = xy[a], xy[b]
        norm = ((xb - xa) ** 2 + (yb - ya) ** 2) ** 0.5
        shift = (offset * (yb - ya) / norm, -offset * (xb - xa) / norm)
        ax.annotate("", xy=edge(b, a, shift), xytext=edge(a, b, shift), zorder=6,
                    arrowprops={"arrowstyle": "-|>", "shrinkA": 2, "shrinkB": 2, "mutation_scale": 14, **style})

    for parent, child in drawn["edges"]:
        if parent in where and child in where:
            arrow(parent, child, color="#444444")
    for pid in drawn["clients"]:  # the host's own connection runs beside the thick line, not hidden under it
        arrow(pid, "store", 0.12 if pid == listener else 0.0, color="C1", linestyle="--")
    if listener in where:  # a thick line from the process that hosts the store, around the others if it is above
        (x0, y0), (x1, y1) = where[listener], store_xy
        if y0 == y1 + 1:
            ax.plot([x0, x1], [y0, y1], color="C1", lw=3, zorder=0)
        else:
            side = width + 0.15
            ax.plot([x0, side, side, x1], [y0, y0, y1, y1], color="C1", lw=3, zorder=0)
    ax.text(-0.05, -depth - 0.65, "grey arrow: parent -> child process    dashed: a connection to the store    "
            "thick: the process listening on the store's port", fontsize=7, color="#555555")
    return str(plot.save(fig, args, name)), drawn
