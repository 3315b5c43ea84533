"""Checker for ch07.4 — the interleaved bubble against torch's interleaved 1F1B plans replayed, your idle shares
against the chapter's replay (scripts/_schedules.py) on torch's plans of all five schedules, and the zero-bubble
paper's ZB-H1 idle time with unequal F, I and W."""

from __future__ import annotations

from pathlib import Path

from mlsys.exercises import load_module, task

zs = load_module(Path(__file__).resolve().parent.parent / "scripts" / "_schedules.py")


def _cases(names: tuple[str, ...]) -> list[tuple[str, int, int, int]]:
    out = []
    for p in (2, 3, 4):
        for m in (p, 2 * p, 3 * p):
            for name in names:
                for v in (1,) if name in ("gpipe", "1f1b") else (2,) if name == "zbv" else (1, 2, 3):
                    out.append((name, p, v, m))
    return out


@task("interleaved_bubble equals the idle share of torch's interleaved 1F1B plan, p = 2-4, v = 1-3")
def check_formula(ex) -> None:
    for _, p, v, m in _cases(("interleaved-1f1b",)):
        orders = zs.planned_orders("interleaved-1f1b", p, v, m)
        want = zs.idle_shares(zs.replay(orders, zs.placement("interleaved-1f1b", p, v), v))[0]
        got = ex.interleaved_bubble(p, m, v)
        assert abs(got - want) < 1e-9, f"interleaved_bubble({p}, {m}, {v}) = {got:.6f}, the plan gives {want:.6f}"


@task("idle_shares: the lesson's GPipe example, then torch's plans of all five schedules, p = 2-4")
def check_shares(ex) -> None:
    gpipe = {0: [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)],
             1: [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)]}
    got = ex.idle_shares(gpipe, 2, {"F": 1.0, "B": 2.0})
    assert len(got) == 2 and all(abs(g - 1 / 3) < 1e-9 for g in got), f"GPipe p=2 m=2: got {got}, want [1/3, 1/3]"
    cost = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
    for name, p, v, m in _cases(tuple(zs.SCHEDULES)):
        orders = zs.planned_orders(name, p, v, m)
        where = zs.placement(name, p, v)
        want = zs.idle_shares(zs.replay(orders, where, 1))
        got = ex.idle_shares(orders, len(where), cost)
        assert len(got) == p, f"{name} p={p}: want one share per rank, got {len(got)}"
        assert all(abs(a - b) < 1e-9 for a, b in zip(got, want)), \
            f"{name} p={p} v={v} m={m}: got {[round(g, 4) for g in got]}, want {[round(w, 4) for w in want]}"


@task("your idle_shares shows the zero-bubble paper's claim: ZB-H1 idles (p-1)(T_F + T_I - T_W), 1F1B (p-1)(T_F + T_B)")
def check_zero_bubble(ex) -> None:
    for t_f, t_i, t_w in ((1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0)):
        cost = {"F": t_f, "I": t_i, "W": t_w, "B": t_i + t_w}
        for p in (2, 3, 4):
            m = 3 * p
            work = m * (t_f + t_i + t_w)  # one stage per rank (v = 1): ScheduleInterleavedZeroBubble is ZB-H1
            for name, idle in (("interleaved-zb", (p - 1) * (t_f + t_i - t_w)), ("1f1b", (p - 1) * (t_f + t_i + t_w))):
                orders = zs.planned_orders(name, p, 1, m)
                got = ex.idle_shares(orders, p, cost)
                want = idle / (idle + work)
                assert all(abs(g - want) < 1e-9 for g in got), \
                    f"{name} p={p} m={m} F/I/W={t_f}/{t_i}/{t_w}: got {[round(g, 4) for g in got]}, want {want:.4f}"
