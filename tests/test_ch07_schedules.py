"""Chapter 7, interleaved and zero-bubble schedules (interleaved_zero_bubble.py and its _schedules.py).

- Real runs at p = 2 and 4: every schedule's parameters after one SGD step equal a one-process step computed here.
- The bubble formulas against a brute-force count of idle ticks on a clock simulated here, tick by tick, from the
  orders torch plans and from the orders the runs logged (not from the script's replay or formula).
- Peak activations and message counts against cases worked by hand.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from conftest import load_script, run, run_json, scripts_dir

SCRIPT = scripts_dir(7) / "interleaved_zero_bubble.py"
zs = load_script(scripts_dir(7) / "_schedules.py")
NAMES = ["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv"]


# ----------------------------------------------------------------------------------------------- real runs
@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.sweep), 4],
                ids=lambda p: f"p{p}")  # p=2: make sweep
def real_run(request, tmp_path_factory) -> dict:
    p = request.param
    flags = ["--smoke", "-w", str(p), "--micro-batches", "8", "--plot-dir", tmp_path_factory.mktemp("fig")]
    return run_json(tmp_path_factory, SCRIPT, *flags)


def one_process_step(p: int, seed: int = 0, m: int = 8, rows: int = 8, width: int = 32, lr: float = 0.5) -> list:
    """The smoke run's model and batch (the script's own `build`), trained here in one process for one SGD step."""
    module = load_script(SCRIPT)
    settings = module.Settings(world_size=p, micro_batches=m, rows=rows, width=width, lr=lr, seed=seed)
    blocks, x, y = module.build(settings, p)
    out = x
    for block in blocks:
        out = block(out)
    ((out - y) ** 2).mean().backward()
    with torch.no_grad():
        return [(q - lr * q.grad).clone() for q in blocks.parameters()]


@pytest.mark.timeout(120)
def test_every_schedule_equals_one_process_after_one_sgd_step(real_run) -> None:
    p = real_run["p"]
    want = one_process_step(p)
    module = load_script(SCRIPT)
    for name in NAMES:
        got = real_run["schedules"][name]["param_fingerprints"]
        assert len(got) == len(want), name
        for j, (fp, q) in enumerate(zip(got, want)):
            assert fp == pytest.approx(module.fingerprint(q, j), rel=1e-10, abs=1e-12), f"{name} p={p} tensor {j}"
        assert real_run["schedules"][name]["max_param_diff"] < 1e-13


@pytest.mark.timeout(120)
def test_the_runs_counted_bubble_is_the_brute_force_count_of_their_orders(real_run) -> None:
    p, v, m = real_run["p"], real_run["v"], real_run["m"]
    for name in NAMES:
        row = real_run["schedules"][name]
        orders = {int(r): parse(text) for r, text in row["order"].items()}
        assert orders == zs.planned_orders(name, p, v, m)
        shares, _ = tick_count(orders, zs.placement(name, p, v))
        assert row["counted_per_rank"] == pytest.approx([float(s) for s in shares], abs=1e-12), name
        # the printed idle units (quoted by the lesson): every rank works 3m units (F, I, W of each micro-batch) in
        # a step of idle + 3m units, so idle / (idle + 3m) is each rank's brute-force idle share
        assert [row["idle_units"] / (row["idle_units"] + 3 * m)] * p == pytest.approx(
            [float(s) for s in shares], abs=1e-12), name
        if zs.formula_holds(name, p, v, m):
            assert row["counted"] == pytest.approx(row["formula"], abs=1e-12), name


@pytest.mark.timeout(120)
def test_the_drawn_ideal_timelines_match_a_brute_force_clock(real_run) -> None:
    """timelines.png draws, per schedule, the orders the ranks ran: the boxes on each rank are those orders, and
    the idle ticks counted on the picture (in ticks of one stage's forward) are the tick-by-tick clock's; the
    formula is only the third check."""
    p, v, m = real_run["p"], real_run["v"], real_run["m"]
    for name in NAMES:
        row = real_run["schedules"][name]
        orders = {int(r): parse(text) for r, text in row["order"].items()}
        boxes = row["drawn_ideal"]  # [rank, kind, stage, mb, start, end], one micro-batch's forward on a rank = 1
        assert {r: [(k, s, i) for rr, k, s, i, _, _ in sorted(boxes, key=lambda b: (b[0], b[4])) if rr == r]
                for r in range(p)} == orders, name
        chunks = zs.chunks_per_rank(name, v)
        end = max(b[5] for b in boxes) * chunks
        drawn_idle = [end - sum(b[5] - b[4] for b in boxes if b[0] == r) * chunks for r in range(p)]
        shares, ticks = tick_count(orders, zs.placement(name, p, v))
        assert end == pytest.approx(ticks), name
        assert drawn_idle == pytest.approx([float(sh * ticks) for sh in shares], abs=1e-9), name
        if zs.formula_holds(name, p, v, m):
            assert [i / end for i in drawn_idle] == pytest.approx([zs.formula(name, p, v, m)] * p), name


def test_ideal_boxes_of_torchs_plans_match_the_brute_force_clock() -> None:
    """The drawing helper on torch's own plans (no process group): idle ticks on the boxes = the clock's."""
    p, v, m = 4, 2, 8
    for name in NAMES:
        orders, chunks = zs.planned_orders(name, p, v, m), zs.chunks_per_rank(name, v)
        boxes = zs.ideal_boxes(orders, zs.placement(name, p, v), chunks)
        shares, ticks = tick_count(orders, zs.placement(name, p, v))
        assert [i * chunks for i in zs.idle_ticks(boxes)] == pytest.approx([float(sh * ticks) for sh in shares])


def parse(text: str) -> list[tuple[str, int, int]]:
    """'F0.1 I2.0' -> [("F", 0, 1), ("I", 2, 0)]"""
    return [(a[0], int(a[1:].split(".")[0]), int(a.split(".")[1])) for a in text.split()]


# ----------------------------------------------------------------------------------------------- brute force
TICKS = {"F": 1, "I": 1, "W": 1, "B": 2}  # per stage: every stage of a schedule is the same size


def tick_count(orders: dict, where: list[int]) -> tuple[list[Fraction], int]:
    """Advance a clock one tick at a time: a rank that is free starts its next action if the action's input was
    finished at an earlier tick; count every tick a rank spends without work until the last rank is done."""
    n = len(where)
    finished: dict = {}  # (kind, stage, mb) -> tick it finished
    pos = dict.fromkeys(orders, 0)
    busy_until = dict.fromkeys(orders, 0)
    idle = dict.fromkeys(orders, 0)
    t = 0
    while any(pos[r] < len(orders[r]) for r in orders) or any(busy_until[r] > t for r in orders):
        for r in orders:
            if busy_until[r] > t or pos[r] == len(orders[r]):
                continue
            kind, s, i = orders[r][pos[r]]
            needs = {"F": [("F", s - 1, i)] if s else [],
                     "B": [("F", s, i)] if s == n - 1 else [("B", s + 1, i), ("I", s + 1, i)],
                     "I": [("F", s, i)] if s == n - 1 else [("B", s + 1, i), ("I", s + 1, i)],
                     "W": [("I", s, i)]}[kind]
            ready = not needs or any(finished.get(d, t + 1) <= t for d in needs)
            if ready:
                busy_until[r] = t + TICKS[kind]
                finished[(kind, s, i)] = t + TICKS[kind]
                pos[r] += 1
        for r in orders:
            if busy_until[r] <= t:
                idle[r] += 1
        t += 1
    return [Fraction(idle[r], t) for r in sorted(orders)], t  # t: the tick the last action finished


def cases() -> list[tuple[str, int, int, int]]:
    out = []
    for p in (2, 3, 4, 5):
        for m in sorted({p, p + 1, 2 * p, 3 * p}):
            if m % max(1, m // p):
                continue  # torch's interleaved schedules need equal rounds
            for name in NAMES:
                for v in ((1,) if name in ("gpipe", "1f1b") else (2,) if name == "zbv" else (1, 2, 3)):
                    out.append((name, p, v, m))
    return out


@pytest.mark.timeout(60)
def test_formulas_against_a_brute_force_count_of_idle_ticks() -> None:
    checked = 0
    for name, p, v, m in cases():
        orders = zs.planned_orders(name, p, v, m)
        shares, _ = tick_count(orders, zs.placement(name, p, v))
        chunks = zs.chunks_per_rank(name, v)
        if name in ("gpipe", "1f1b"):
            want = Fraction(p - 1, m + p - 1)
        elif name == "interleaved-1f1b":
            want = Fraction(p - 1, chunks * m + p - 1)
        else:
            want = Fraction(p - 1, 3 * chunks * m + p - 1)
        if zs.formula_holds(name, p, v, m):
            assert shares == [want] * p, (name, p, v, m, shares)
            assert zs.formula(name, p, v, m) == pytest.approx(float(want), abs=1e-15)
            checked += 1
        else:  # ZB-V with m < 2p - 1: torch leaves holes; never better than the formula
            assert all(s >= want for s in shares), (name, p, v, m)
    assert checked > 100


def test_idle_in_slots_by_hand() -> None:
    """GPipe, p = 2, m = 2, F 1 tick and B 2 ticks: rank 0 runs F F _ _ _ B B B B, rank 1 _ F F B B B B _ _:
    3 idle ticks of 9 on each, one micro-batch's forward + backward; the formula (p-1)/(m+p-1) = 1/3."""
    orders = {0: [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)],
              1: [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)]}
    shares, span = tick_count(orders, [0, 1])
    assert span == 9 and shares == [Fraction(3, 9)] * 2
    events = zs.replay(orders, [0, 1], 1)
    assert zs.idle_shares(events) == [pytest.approx(1 / 3)] * 2
    assert events[0][2] == {"kind": "B", "stage": 0, "mb": 0, "start": 5, "end": 7}


def test_zbv_idles_only_at_the_ends_and_interleaved_zb_ends_together() -> None:
    """The lesson's reading of the figure: under ZB-V (m >= 2p - 1) rank r starts r stage-forwards late and never
    waits between its first and last action; the interleaved zero-bubble schedule ends every rank at once."""
    for p in (2, 3, 4):
        for m in (2 * p - 1, 2 * p, 3 * p):
            if m % max(1, m // p):
                continue
            ev = zs.replay(zs.planned_orders("zbv", p, 2, m), zs.placement("zbv", p, 2), 2)
            for r in range(p):
                assert ev[r][0]["start"] == Fraction(r, 2)  # one stage-forward is half a rank-forward
                assert all(a["end"] == b["start"] for a, b in zip(ev[r], ev[r][1:])), (p, m, r)
            ev = zs.replay(zs.planned_orders("interleaved-zb", p, 2, m), zs.placement("interleaved-zb", p, 2), 2)
            assert len({evs[-1]["end"] for evs in ev.values()}) == 1


# ----------------------------------------------------------------------------------------------- memory, messages
def test_peak_activations_worked_by_hand() -> None:
    """p = 2, m = 4. Interleaved 1F1B (v = 2) on rank 0 runs F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 ...: five stage
    activations (each half of the rank's layers) are alive after F0.2, so 2.5 micro-batches, where 1F1B holds 2
    and GPipe all 4. Interleaved zero bubble holds each until its W: at most 4 stages = 2 micro-batches."""
    order = zs.planned_orders("interleaved-1f1b", 2, 2, 4)[0]
    assert order[:7] == [("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1), ("F", 0, 2), ("B", 2, 0), ("F", 0, 3)]
    assert zs.peak_held(order, 2) == 2.5
    assert zs.peak_held(zs.planned_orders("1f1b", 2, 1, 4)[0], 1) == 2
    assert zs.peak_held(zs.planned_orders("gpipe", 2, 1, 4)[0], 1) == 4
    zb = zs.planned_orders("interleaved-zb", 2, 2, 4)[0]
    assert zb[:6] == [("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1), ("I", 2, 0), ("W", 2, 0)]
    assert zs.peak_held(zb, 2) == 2.0  # 4 alive after F2.1; I2.0 keeps it, W2.0 frees it, F0.2 takes its place
    assert zs.peak_held([("F", 0, 0), ("I", 0, 0), ("F", 0, 1), ("W", 0, 0), ("I", 0, 1), ("W", 0, 1)], 1) == 2


def test_peak_activations_of_the_runs(real_run) -> None:
    p, m = real_run["p"], real_run["m"]
    rows = real_run["schedules"]
    assert rows["gpipe"]["peak_held"] == [m] * p
    assert rows["1f1b"]["peak_held"] == [min(p - r, m) for r in range(p)]  # bounded by p, whatever m is
    assert rows["zbv"]["peak_held"] == [p] * p  # ZB-V: balanced, at 1F1B's first-rank peak (m >= 2p - 1 here)


def test_message_counts_and_placement_by_hand() -> None:
    assert zs.placement("interleaved-1f1b", 4, 2) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert zs.placement("zbv", 4, 2) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert zs.p2p_messages("gpipe", 4, 2, 8) == 2 * 8 * 3  # 3 boundaries, activation + gradient, 8 micro-batches
    assert zs.p2p_messages("interleaved-1f1b", 4, 2, 8) == 2 * 8 * 7  # 7 boundaries, all between ranks
    assert zs.p2p_messages("zbv", 4, 2, 8) == 2 * 8 * 6  # the turn 3 -> 4 stays on rank 3


@pytest.mark.timeout(60)
def test_too_few_micro_batches_is_a_usage_error() -> None:
    proc = run([SCRIPT, "-w", "4", "--micro-batches", "3"])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
