"""Chapter 7, pipeline half: schedules, the bubble formula, stage splitting, and real runs against one process."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import chapter_dir, load_script, run, scripts_dir
from mlsys.model import GPT, GPTConfig
from mlsys.pipeline import (
    bubble_fraction,
    check_actions,
    max_in_flight,
    measured_bubble,
    schedule_actions,
    simulate,
    split_gpt,
)

CHAPTER = chapter_dir(7)
SCRIPTS = scripts_dir(7)


# ----------------------------------------------------------------------------------------------- formulas
def test_bubble_formula_values() -> None:
    assert bubble_fraction(1, 5) == 0.0
    assert bubble_fraction(2, 1) == 0.5
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError):
        bubble_fraction(0, 4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_ideal_timeline_has_exactly_the_formula_bubble(schedule: str) -> None:
    """The lesson's (p-1)/(m+p-1): equal stages, any forward/backward ratio, both schedules, every stage."""
    for p in range(1, 6):
        for m in range(1, 10):
            for t_f, t_b in [(1.0, 2.0), (1.0, 1.0), (0.3, 1.7)]:
                bubble = measured_bubble(simulate(schedule, p, m, t_f, t_b))
                assert bubble["per_stage"] == pytest.approx([bubble_fraction(p, m)] * p, abs=1e-12)
                assert bubble["span"] == pytest.approx((m + p - 1) * (t_f + t_b))


def test_one_f_one_b_order_and_memory_bound() -> None:
    assert schedule_actions("1f1b", 0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert schedule_actions("1f1b", 1, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    for p in range(1, 6):
        for m in range(1, 10):
            for s in range(p):
                gpipe, ofob = schedule_actions("gpipe", s, p, m), schedule_actions("1f1b", s, p, m)
                check_actions(gpipe, m)
                check_actions(ofob, m)
                assert max_in_flight(gpipe) == m  # GPipe keeps every micro-batch's activations
                assert max_in_flight(ofob) == min(p - s, m)  # 1F1B: at most p - s, whatever m is


def test_bad_orders_are_rejected() -> None:
    with pytest.raises(ValueError):
        check_actions([("B", 0), ("F", 0)], 1)  # backward before forward
    with pytest.raises(ValueError):
        check_actions([("F", 1), ("F", 0), ("B", 0), ("B", 1)], 2)  # out of order
    with pytest.raises(ValueError):
        schedule_actions("interleaved", 0, 2, 2)
    with pytest.raises(ValueError):  # stage 0 waits for B0 that stage 1 only runs after F1, which needs stage 0's F1
        simulate(lambda s, p, m: [("F", 0), ("B", 0), ("F", 1), ("B", 1)] if s == 0 else
                 [("F", 0), ("F", 1), ("B", 0), ("B", 1)], 2, 2)


def test_simulate_per_stage_times_by_hand() -> None:
    """bubble.py's replay: per-stage op times. p=2, m=1; stage 0 F=1 B=3, stage 1 F=2 B=1, worked by hand:
    s0 F [0,1], s1 F [1,3], s1 B [3,4], s0 B [4,7]; span 7, s0 busy 4, s1 busy 3."""
    events = simulate("1f1b", 2, 1, t_fwd=[1.0, 2.0], t_bwd=[3.0, 1.0])
    assert [(e["kind"], e["start"], e["end"]) for e in events[0]] == [("F", 0.0, 1.0), ("B", 4.0, 7.0)]
    assert [(e["kind"], e["start"], e["end"]) for e in events[1]] == [("F", 1.0, 3.0), ("B", 3.0, 4.0)]
    assert measured_bubble(events)["per_stage"] == pytest.approx([3 / 7, 4 / 7])


def test_measured_bubble_by_hand() -> None:
    events = [[{"start": 0.0, "end": 1.0}, {"start": 3.0, "end": 4.0}], [{"start": 1.0, "end": 3.0}]]
    out = measured_bubble(events)
    assert out["span"] == 4.0
    assert out["per_stage"] == [0.5, 0.5]


# ----------------------------------------------------------------------------------------------- splitting
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_split_stages_compose_to_the_whole_model(p: int) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_layer=4))
    x = torch.randint(0, model.config.vocab_size, (2, 10))
    stages = split_gpt(model, p)
    h = x
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, model(x)[0], rtol=0, atol=0)
    assert [st.layer_range for st in stages][0][0] == 0 and stages[-1].layer_range[1] == 4
    assert sum(sum(p_.numel() for p_ in st.parameters()) for st in stages) == \
        sum(p_.numel() for p_ in model.parameters()) + (model.wte.weight.numel() if p > 1 else 0)  # one extra copy
    names = {st.global_name(n) for st in stages for n, _ in st.named_parameters()}
    assert {n for n, _ in model.named_parameters()} <= names


def test_split_rejects_impossible_cuts() -> None:
    model = GPT(GPTConfig.preset("tiny", n_layer=2))
    with pytest.raises(ValueError):
        split_gpt(model, 3)
    with pytest.raises(ValueError):
        split_gpt(model, 2, boundaries=[0, 2, 2])
    assert [s.layer_range for s in split_gpt(model, 2, boundaries=[0, 1, 2])] == [(0, 1), (1, 2)]


# ----------------------------------------------------------------------------------------------- real runs
def subgroup_worker(ctx, m: int) -> dict:
    """Two pipelines inside a 4-rank job, on rank lists [3, 1] and [0, 2], each in its own process group."""
    import torch.distributed as dist

    from mlsys.pipeline import run_pipeline_step

    pipelines = [[3, 1], [0, 2]]
    groups = [dist.new_group(r) for r in pipelines]  # every rank creates every group, in the same order
    which = next(i for i, r in enumerate(pipelines) if ctx.rank in r)
    ranks = pipelines[which]
    torch.manual_seed(which)  # each pipeline trains its own model on its own data
    model = GPT(GPTConfig.preset("tiny", n_layer=2))
    x = torch.randint(0, model.config.vocab_size, (2 * m, 12), generator=torch.Generator().manual_seed(which))
    y = torch.roll(x, -1, dims=1)
    stage = split_gpt(model, 2)[ranks.index(ctx.rank)]
    out = run_pipeline_step(stage, ranks, list(x.chunk(m)), list(y.chunk(m)), "1f1b", group=groups[which])
    _, loss = model(x, y)
    loss.backward()
    diff = 0.0
    for name, param in stage.named_parameters():
        full = stage.global_name(name)
        want = model.wte.weight.grad if full == "lm_head.weight" else model.get_parameter(full).grad
        diff = max(diff, float((param.grad - want).abs().max()))
    return {"rank": ctx.rank, "diff": diff, "loss": out["loss"], "ref_loss": float(loss.detach()),
            "stage": out["stage"], "in_flight": out["peak_in_flight"]}


@pytest.mark.timeout(120)
def test_pipelines_over_arbitrary_rank_lists_and_subgroups() -> None:
    from mlsys.launch import launch

    results = launch(_gather_subgroup, 3, world_size=4, backend="gloo", timeout=60)
    by_rank = {r["rank"]: r for r in results}
    assert by_rank[3]["stage"] == 0 and by_rank[1]["stage"] == 1  # position in the list, not rank order
    for r in results:
        assert r["diff"] < 1e-6, r
        assert r["in_flight"] == (2 if r["stage"] == 0 else 1)
    for last in (1, 2):
        assert by_rank[last]["loss"] == pytest.approx(by_rank[last]["ref_loss"], rel=1e-5)


def _gather_subgroup(ctx, m: int) -> list[dict]:
    import torch.distributed as dist

    mine = subgroup_worker(ctx, m)
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, mine)
    return out


@pytest.fixture(scope="module")
def schedules_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ch07") / "schedules.json"
    proc = run([SCRIPTS / "pipeline_schedules.py", "-w", "3", "--micro-batches", "5", "--layers", "3", "--double",
                "--json", out, "--plot-dir", out.parent], timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("ideal_schedules.png", "fill_drain.gif", "fill_drain_strip.png"):
        assert (out.parent / name).exists() and f"figure: {out.parent / name}" in proc.stdout, name
    return json.loads(out.read_text())["results"]


def tick_by_tick(orders: list[list[tuple[str, int]]]) -> tuple[list[list[tuple[str, int, int]]], int]:
    """Brute force: advance a clock one tick at a time. A free stage starts its next action when the action's input
    finished at an earlier or the same tick: F(i) on stage s after F(i) on s - 1, B(i) after B(i) on s + 1 (the
    last stage after its own F(i)). F takes 1 tick, B 2. Returns each stage's (kind, mb, start) and the end tick."""
    p = len(orders)
    finished: dict = {}  # (kind, mb, stage) -> tick
    pos, free, started = [0] * p, [0] * p, [[] for _ in range(p)]
    t = 0
    while any(pos[s] < len(orders[s]) for s in range(p)):
        for s in range(p):
            if free[s] > t or pos[s] == len(orders[s]):
                continue
            kind, i = orders[s][pos[s]]
            need = (("F", i, s - 1) if s else None) if kind == "F" else ("F", i, s) if s == p - 1 else ("B", i, s + 1)
            if need is None or finished.get(need, t + 1) <= t:
                free[s] = finished[(kind, i, s)] = t + (1 if kind == "F" else 2)
                started[s].append((kind, i, t))
                pos[s] += 1
        t += 1
    return started, max(finished.values())


@pytest.mark.timeout(120)
def test_ideal_picture_is_the_brute_force_clock_of_the_orders_run(schedules_run: dict) -> None:
    """ideal_schedules.png and fill_drain.gif draw the orders each stage ran: every box where a tick-by-tick clock
    puts it, the idle ticks counted on the picture equal to the clock's, and (third) to the bubble formula."""
    p, m = 3, 5
    for name in ("gpipe", "1f1b"):
        run_orders = [[(a[0], int(a[1:])) for a in row["order"].split()] for row in schedules_run["schedules"][name]]
        assert run_orders == [schedule_actions(name, s, p, m) for s in range(p)]
        started, end = tick_by_tick(run_orders)
        boxes = schedules_run["ideal"][name]["boxes"]
        drawn = [[(b["kind"], b["mb"], b["start"]) for b in boxes if b["rank"] == s] for s in range(p)]
        assert drawn == started, name
        assert all(b["end"] - b["start"] == (1 if b["kind"] == "F" else 2) for b in boxes)
        idle = [end - sum(b["end"] - b["start"] for b in boxes if b["rank"] == s) for s in range(p)]
        busy = [set() for _ in range(p)]  # the clock's busy ticks of every stage, counted one by one
        for s in range(p):
            for kind, _, start in started[s]:
                busy[s].update(range(start, start + (1 if kind == "F" else 2)))
        assert idle == [end - len(b) for b in busy] == schedules_run["ideal"][name]["idle_ticks"], name
        assert [i / end for i in idle] == pytest.approx([bubble_fraction(p, m)] * p)


@pytest.mark.timeout(120)
def test_schedules_match_one_process_in_float64(schedules_run: dict) -> None:
    for schedule in ("gpipe", "1f1b"):
        stages = schedules_run["schedules"][schedule]
        assert [s["stage"] for s in stages] == [0, 1, 2]
        for s in stages:
            assert s["max_grad_diff"] < 1e-12, (schedule, s)
            assert s["max_param_diff"] < 1e-12, (schedule, s)
        assert stages[-1]["loss"] == pytest.approx(schedules_run["reference_loss"], rel=1e-12)


@pytest.mark.timeout(120)
def test_activation_memory_gpipe_holds_m_1f1b_at_most_p_minus_s(schedules_run: dict) -> None:
    gpipe, ofob = schedules_run["schedules"]["gpipe"], schedules_run["schedules"]["1f1b"]
    for s in range(3):
        assert gpipe[s]["peak_in_flight"] == 5
        assert ofob[s]["peak_in_flight"] == 3 - s
        per_mb = gpipe[s]["peak_activation_bytes"] / 5  # every micro-batch saves the same bytes
        assert ofob[s]["peak_activation_bytes"] == pytest.approx(per_mb * (3 - s), rel=1e-9)


@pytest.mark.timeout(120)
def test_torch_pipelining_gives_the_same_gradients(tmp_path) -> None:
    out = tmp_path / "torch.json"
    proc = run([SCRIPTS / "pipelining_torch.py", "-w", "2", "--layers", "2", "--json", out], timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())["results"]
    assert res["problems"] == {}, res["problems"]  # both of torch's schedules ran on gloo/CPU
    assert set(res["losses"]) == {"gpipe", "1f1b", "torch GPipe", "torch 1F1B"}
    for name, diff in res["max_grad_diff_vs_ours"].items():
        assert diff <= 1e-6, (name, diff)
    for name, loss in res["losses"].items():
        assert loss == pytest.approx(res["reference_loss"], rel=1e-5), name


@pytest.mark.timeout(120)
def test_bubble_script_reports_formula_and_memory(tmp_path) -> None:
    out = tmp_path / "bubble.json"
    proc = run([SCRIPTS / "bubble.py", "--smoke", "-w", "2", "--json", out, "--plot-dir", tmp_path], timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())["results"]
    assert {(r["schedule"], r["m"]) for r in res["runs"]} == {(s, m) for s in ("gpipe", "1f1b") for m in (1, 2)}
    for r in res["runs"]:
        assert r["predicted"] == pytest.approx(bubble_fraction(2, r["m"]))
        assert 0.0 < r["measured"] < 1.0 and len(r["per_stage"]) == 2
        want = [r["m"]] * 2 if r["schedule"] == "gpipe" else [min(2 - s, r["m"]) for s in range(2)]
        assert [n for n, _ in r["memory"]] == want
        if r["m"] == 1:  # the replay at m = 1, by hand: span = F0 + F1 + B1 + B0, busy F_s + B_s, so the mean idle
            assert r["replayed"] == pytest.approx(0.5)  # share is 1 - 1/p whatever the measured times are
        ms = r["median_ms"]
        assert 0.0 < r["replayed"] < 1.0 and all(len(ms[k]) == 2 and min(ms[k]) > 0 for k in "FB")
    # the lesson quotes replay_below: it must name a row only when the rel. error column shows one under the formula
    below = [r for r in res["runs"] if round(100 * r["rel_error"], 1) < 0]
    assert res["replay_below"].startswith("the replay came out below" if below else "no replayed bubble"), res
    assert (tmp_path / "timeline.png").exists() and (tmp_path / "bubble_vs_m.png").exists()
    # the chain outlined in timeline.png: from the op that ends last back to stage 0's F0, each op preceded by
    # whichever of its inputs (its stage's previous op, the op that sent its message) ended later
    for r in (r for r in res["runs"] if r["m"] == 2):
        ops = {(s, e["kind"], e["mb"]): e for s, stage in enumerate(r["timeline"]) for e in stage}
        chain = [tuple(c) for c in r["critical_path"]]
        assert chain[0] == (0, "F", 0) and ops[chain[-1]]["end"] == max(e["end"] for e in ops.values()), chain
        for before, op in zip(chain, chain[1:]):
            s, kind, mb = op
            stage = [(e["kind"], e["mb"]) for e in r["timeline"][s]]
            inputs = [(s, *stage[stage.index((kind, mb)) - 1])] if stage.index((kind, mb)) else []
            sender = (s - 1, "F", mb) if kind == "F" else (s + 1, "B", mb)
            inputs += [sender] if sender in ops else []
            assert before == max(inputs, key=lambda k: ops[k]["end"]), (chain, op)
    # the line after the tables counts the wall-clock bubbles above the formula, as the runs table prints them
    above = sum(round(r["measured"], 3) > round(r["predicted"], 3) for r in res["runs"])
    assert res["wall_above"] == above
    assert f"above the formula in {above} of {len(res['runs'])} rows" in proc.stdout


def dependencies(events: list[list[dict]]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """What each op (stage, index) waits for: its stage's previous op and the op that sends its message."""
    where = {(s, e["kind"], e["mb"]): (s, j) for s, stage in enumerate(events) for j, e in enumerate(stage)}
    deps = {}
    for (s, kind, mb), (_, j) in where.items():
        sender = where.get((s - 1, "F", mb) if kind == "F" else (s + 1, "B", mb))
        deps[s, j] = [d for d in ((s, j - 1) if j else None, sender) if d is not None]
    return deps


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_critical_path_is_the_longest_chain_of_the_ideal_clock(schedule: str) -> None:
    """On the ideal clock (each op as soon as its inputs are done) the critical path bubble.py outlines must be a
    chain of dependencies whose op times add up to the step, and the step must be the longest such chain, found
    here by dynamic programming over every op, with unequal stage times."""
    bubble = load_script(SCRIPTS / "bubble.py")
    rng = np.random.default_rng(7)
    for p, m in [(2, 1), (2, 4), (3, 2), (3, 5), (4, 3), (4, 8)]:
        for _ in range(5):
            tf, tb = rng.uniform(0.5, 1.5, p), rng.uniform(1.0, 3.0, p)
            ev = simulate(schedule, p, m, list(tf), list(tb))
            deps = dependencies(ev)
            dur = {(s, j): e["end"] - e["start"] for s, stage in enumerate(ev) for j, e in enumerate(stage)}
            longest: dict = {}
            for key in sorted(dur, key=lambda k: ev[k[0]][k[1]]["start"]):  # inputs always start earlier
                longest[key] = dur[key] + max((longest[d] for d in deps[key]), default=0.0)
            path = bubble.critical_path(ev)
            assert path[0] == (0, 0) and all(a in deps[b] for a, b in zip(path, path[1:])), path
            span = measured_bubble(ev)["span"]
            assert sum(dur[k] for k in path) == pytest.approx(span) == pytest.approx(max(longest.values()))


def test_wall_above_counts_rows_as_the_table_prints_them(capsys) -> None:
    """The count of wall-clock bubbles above the formula, on hand-made rows: one above, one below, and one above
    only past the third decimal (the table prints both as 0.500, so it must not count)."""
    bubble = load_script(SCRIPTS / "bubble.py")
    args = bubble.Settings(micro_batches=[1, 2], steps=1)
    runs = [{"schedule": "gpipe", "m": 1, "predicted": 0.5, "measured": 0.5004},
            {"schedule": "gpipe", "m": 2, "predicted": 1 / 3, "measured": 0.41},
            {"schedule": "1f1b", "m": 1, "predicted": 0.5, "measured": 0.45},
            {"schedule": "1f1b", "m": 2, "predicted": 1 / 3, "measured": 0.3}]
    for r in runs:
        r.update(replayed=r["predicted"], rel_error=0.0, goal_met=True, memory=[(1, 1024), (1, 1024)])
    results = {"runs": runs}
    bubble.print_report(args, 2, [{"a": 1}], [{"a": 1}], results)
    assert results["wall_above"] == 1
    assert "above the formula in 1 of 4 rows" in capsys.readouterr().out


def test_wall_trend_calls_a_change_within_two_percent_about_the_same(capsys) -> None:
    """The lesson quotes wall_trend: a move of 0.001 (0.318 to 0.319) is noise, not a rise. Hand-made rows: GPipe
    falls by a third, 1F1B moves by 0.3 %; the oracle is the ratio of the two bubbles against [0.98, 1/0.98]."""
    bubble = load_script(SCRIPTS / "bubble.py")
    args = bubble.Settings(micro_batches=[1, 2], steps=1)
    measured = {("gpipe", 1): 0.45, ("gpipe", 2): 0.30, ("1f1b", 1): 0.318, ("1f1b", 2): 0.319}
    runs = [{"schedule": s, "m": m, "predicted": 0.5 if m == 1 else 1 / 3, "measured": v,
             "replayed": 0.5, "rel_error": 0.0, "goal_met": True, "memory": [(1, 1024), (1, 1024)]}
            for (s, m), v in measured.items()]
    results = {"runs": runs}
    bubble.print_report(args, 2, [{"a": 1}], [{"a": 1}], results)
    for name, s in (("GPipe", "gpipe"), ("1F1B", "1f1b")):
        ratio = measured[s, 2] / measured[s, 1]
        word = "stayed about the same (within 2%)" if 0.98 <= ratio <= 1 / 0.98 else "rose" if ratio > 1 else "fell"
        assert f"{word} under {name}" in results["wall_trend"], results["wall_trend"]
    assert "rose" not in results["wall_trend"]


@pytest.mark.long  # a timing check: make sweep (and CI) run it
@pytest.mark.timeout(180)
def test_measured_bubble_agrees_with_the_formula_where_the_lesson_says(tmp_path) -> None:
    """The lesson: at m = 1 only one stage computes at a time, so the timed bubble should come close to
    (p - 1) / (m + p - 1) = 0.5; with more micro-batches it shrinks, never below the formula (equal work per stage
    makes the formula the least possible idle share). Real timings at the default model size, fastest of 8 steps;
    the tolerance (0.1 absolute) is about five times the error measured on a quiet 2-core machine (+0.01)."""
    out = tmp_path / "bubble.json"
    proc = run([SCRIPTS / "bubble.py", "-w", "2", "--micro-batches", "1", "4", "--timeline-m", "1", "--steps", "8",
                "--json", out], timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = {(r["schedule"], r["m"]): r["measured"] for r in json.loads(out.read_text())["results"]["runs"]}
    for schedule in ("gpipe", "1f1b"):
        assert runs[schedule, 1] == pytest.approx(0.5, abs=0.1), runs
        assert bubble_fraction(2, 4) - 0.03 <= runs[schedule, 4] < runs[schedule, 1], runs
    # the lesson quotes wall_trend: its direction for each schedule must be what the runs table shows
    trend = json.loads(out.read_text())["results"]["wall_trend"]
    for name, schedule in (("GPipe", "gpipe"), ("1F1B", "1f1b")):
        x, y = runs[schedule, 1], runs[schedule, 4]
        word = "stayed about the same (within 2%)" if 0.98 <= y / x <= 1 / 0.98 else "rose" if y > x else "fell"
        assert f"{word} under {name}" in trend, (trend, runs)


# ----------------------------------------------------------------------------------------------- the profiler trace
def one_f_one_b_as_a_memory_rule(s: int, p: int, m: int) -> list[tuple[str, int]]:
    """The oracle, written as the rule 1F1B obeys rather than as its three phases: stage s runs the next forward
    while forwards are left and fewer than p - s micro-batches are in flight, else the backward of the oldest."""
    order, fwd, bwd = [], 0, 0
    while bwd < m:
        if fwd < m and fwd - bwd < p - s:
            order.append(("F", fwd))
            fwd += 1
        else:
            order.append(("B", bwd))
            bwd += 1
    return order


@pytest.fixture(scope="module", params=[2, 3])
def trace_run(request, tmp_path_factory) -> tuple[int, dict, list[dict]]:
    """pipeline_trace.py at p = 2 (the lesson's) and 3, m = 5: its JSON and the raw events of its merged trace."""
    p = request.param
    out = tmp_path_factory.mktemp(f"trace{p}") / "trace.json"
    proc = run([SCRIPTS / "pipeline_trace.py", "--smoke", "-w", str(p), "--micro-batches", "5", "--json", out,
                "--plot-dir", out.parent], timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    png, trace = out.parent / "pipeline_1f1b.png", out.parent / "pipeline_1f1b.trace.json"
    assert png.is_file() and f"figure: {png}" in proc.stdout
    return p, json.loads(out.read_text())["results"], json.loads(trace.read_text())["traceEvents"]


@pytest.mark.timeout(120)
def test_trace_shows_the_1f1b_order_and_the_picture_draws_it(trace_run) -> None:
    """The merged torch.profiler trace file itself: per process (stage), the runner's F<i>/B<i> ranges sorted by
    time are the 1F1B order computed here as a memory rule; the boxes of pipeline_1f1b.png are exactly those
    events (ms from the first compute start); every stage waits only on its own channels (activations from the
    stage before, gradients from the one after)."""
    p, res, raw = trace_run
    m = 5
    stage_of = {e["pid"]: int(e["args"]["name"].split()[1]) for e in raw
                if e.get("ph") == "M" and e.get("name") == "process_name"}
    assert sorted(set(stage_of.values())) == list(range(p))
    ranges = [e for e in raw if e.get("ph") == "X" and e.get("pid") in stage_of]
    compute = {s: sorted((e for e in ranges if stage_of[e["pid"]] == s and e["name"][0] in "FB"
                          and e["name"][1:].isdigit()), key=lambda e: e["ts"]) for s in range(p)}
    t0 = min(e["ts"] for events in compute.values() for e in events)
    for s in range(p):
        assert [(e["name"][0], int(e["name"][1:])) for e in compute[s]] == one_f_one_b_as_a_memory_rule(s, p, m), s
        drawn = [(sp["label"], sp["start"], sp["end"]) for sp in res["spans"] if sp["lane"] == f"stage {s}"]
        want = [(e["name"], (e["ts"] - t0) / 1000, (e["ts"] + e["dur"] - t0) / 1000) for e in compute[s]]
        assert [d[0] for d in drawn] == [w[0] for w in want]
        assert [t for d in drawn for t in d[1:]] == pytest.approx([t for w in want for t in w[1:]], abs=1e-6)
        waits = {e["name"].split()[1] for e in ranges if stage_of[e["pid"]] == s and e["name"].startswith("recv ")}
        assert waits == {c for c, on in (("act", s > 0), ("grad", s < p - 1)) if on}, (s, waits)


@pytest.mark.timeout(120)
def test_trace_bubble_is_counted_from_the_raw_events_and_the_ideal_by_the_tick_clock(trace_run) -> None:
    """The idle shares the lesson quotes: measured = 1 - (a stage's F/B time) / (first start to last end over all
    stages), recomputed here from the raw trace events; ideal = the tick-by-tick clock of the oracle orders."""
    p, res, raw = trace_run
    m = 5
    stage_of = {e["pid"]: int(e["args"]["name"].split()[1]) for e in raw
                if e.get("ph") == "M" and e.get("name") == "process_name"}
    ops = [e for e in raw if e.get("ph") == "X" and e.get("pid") in stage_of and e["name"][0] in "FB"
           and e["name"][1:].isdigit()]
    span = max(e["ts"] + e["dur"] for e in ops) - min(e["ts"] for e in ops)
    idle = [1 - sum(e["dur"] for e in ops if stage_of[e["pid"]] == s) / span for s in range(p)]
    assert res["measured"]["per_stage"] == pytest.approx(idle, abs=1e-6)
    assert res["measured"]["mean"] == pytest.approx(sum(idle) / p, abs=1e-6)
    started, end = tick_by_tick([one_f_one_b_as_a_memory_rule(s, p, m) for s in range(p)])
    busy = [sum(1 if k == "F" else 2 for k, _, _ in started[s]) for s in range(p)]
    assert res["ideal_per_stage"] == pytest.approx([1 - b / end for b in busy])
    assert res["ideal"] == pytest.approx((p - 1) / (m + p - 1))


def test_longest_op_points_at_a_wait_box_only_when_the_figure_shows_it() -> None:
    """pipeline_trace.longest_op on made-up spans (ms): stage 0's F1 is 3x the mean forward; stage 1's a1 wait is
    either 0.05 ms (too short to draw: the sentence quotes the time and points at no box) or 3 ms (a visible green
    box under half a forward: the sentence points at it)."""
    trace = load_script(SCRIPTS / "pipeline_trace.py")
    Span = trace.plot.Span

    def sentence(wait: float) -> str:
        spans = [Span("stage 0", 0, 10, "F0", "forward"), Span("stage 0", 10, 40, "F1", "forward"),
                 Span("stage 1", 40, 50, "F1", "forward"), Span("stage 0", 50, 150, "B0", "backward"),
                 Span("stage 0 messages", 40, 40.01, "a1", "send posted"),
                 Span("stage 1 messages", 40 - wait, 40, "a1", "blocked in recv")]
        return trace.longest_op(spans, {"forward": 10.0, "backward": 100.0}, 2)

    short, seen, long = sentence(0.05), sentence(3.0), sentence(15.0)
    assert "stage 0's F1, 3.0× the mean forward" in short
    assert "its a1 receive waited only 0.05 ms" in short and "green" not in short
    assert "(its green a1 box, 3.0 ms)" in seen
    # a 15 ms wait is shorter than F1's 20 ms excess over the mean forward: the long box caused all of it
    assert "stage 1 was blocked 15.0 ms in its green a1 box, all of it within F1's excess over the mean forward " \
           "(20.0 ms)" in long


def test_longest_op_follows_the_next_message_the_stage_sends() -> None:
    """1F1B with p = 2: the last stage's long F0 sends nothing itself, but it delays the B0 right after it, which
    sends g0, and stage 0 sits in its g0 receive for that. The sentence must point at that wait and split it: of
    stage 0's 40 ms, F0's 20 ms excess over the mean forward is the long box's doing, the other 20 ms (a mean F0 and
    B0 on stage 1) stage 0 waits under 1F1B anyway. Only a stage that sends nothing after the long op may be said to
    hold nobody up."""
    trace = load_script(SCRIPTS / "pipeline_trace.py")
    Span = trace.plot.Span
    spans = [Span("stage 0", 0, 10, "F0", "forward"), Span("stage 0 messages", 10, 10.01, "a0", "send posted"),
             Span("stage 0", 10, 20, "F1", "forward"), Span("stage 0 messages", 20, 20.01, "a1", "send posted"),
             Span("stage 1 messages", 0, 10, "a0", "blocked in recv"),
             Span("stage 1", 10, 40, "F0", "forward"), Span("stage 1", 40, 60, "B0", "backward"),
             Span("stage 1 messages", 60, 60.01, "g0", "send posted"),
             Span("stage 0 messages", 20, 60, "g0", "blocked in recv"), Span("stage 0", 60, 80, "B0", "backward")]
    text = trace.longest_op(spans, {"forward": 10.0, "backward": 20.0}, 2)
    assert "stage 1's F0, 3.0× the mean forward" in text
    assert "no other stage" not in text
    assert "delayed stage 1's next message, g0 (sent after its B0)" in text
    assert "stage 0 was blocked 40.0 ms in its green g0 box. About 20.0 ms of that is F0's excess over the mean " \
           "forward; the other 20.0 ms it would have waited with a forward of mean length too" in text
    assert "covers" not in text
    last = [sp for sp in spans if not (sp.lane == "stage 1 messages" and sp.kind == "send posted")]
    assert "stage 1 sent no message after it" in trace.longest_op(last, {"forward": 10.0, "backward": 20.0}, 2)



@pytest.mark.timeout(120)
def test_trace_replay_keeps_the_op_lengths_and_drops_the_gaps(trace_run) -> None:
    """The lesson's note splits measured - ideal into gaps_added (measured - replayed, never negative) and
    lengths_added (replayed - ideal). The replay is recomputed here from the raw trace events as a longest path:
    an op ends its length after the later of its stage's previous op and its input op (F i after F i on the stage
    before; B i after B i on the stage after, the last stage's after its own F i)."""
    from functools import cache

    p, res, raw = trace_run
    stage_of = {e["pid"]: int(e["args"]["name"].split()[1]) for e in raw
                if e.get("ph") == "M" and e.get("name") == "process_name"}
    ops = [sorted(((e["name"][0], int(e["name"][1:]), e["dur"], e["ts"]) for e in raw if e.get("ph") == "X"
                   and stage_of.get(e.get("pid")) == s and e["name"][0] in "FB" and e["name"][1:].isdigit()),
                  key=lambda op: op[3]) for s in range(p)]
    where = {(s, k, i): j for s in range(p) for j, (k, i, _, _) in enumerate(ops[s])}

    @cache
    def end(s: int, j: int) -> float:
        kind, i, dur, _ = ops[s][j]
        before = [end(s, j - 1)] if j else [0.0]
        if kind == "F" and s > 0:
            before.append(end(s - 1, where[(s - 1, "F", i)]))
        if kind == "B":
            before.append(end(s, where[(s, "F", i)]) if s == p - 1 else end(s + 1, where[(s + 1, "B", i)]))
        return max(before) + dur

    span = max(end(s, len(ops[s]) - 1) for s in range(p))
    shares = [1 - sum(op[2] for op in ops[s]) / span for s in range(p)]
    assert res["replayed"] == pytest.approx(sum(shares) / p, abs=1e-6)
    assert all(m >= r - 1e-6 for m, r in zip(res["measured"]["per_stage"], shares))
    assert res["gaps_added"] >= -1e-9
    assert res["gaps_added"] == pytest.approx(res["measured"]["mean"] - sum(shares) / p, abs=1e-6)  # vs the replay here


def test_replay_of_a_hand_worked_step() -> None:
    """p = 2, m = 1 with a 2 ms gap before stage 1's F0 and a 1 ms gap before stage 0's B0: the trace spans 9 ms,
    each stage computes 3. Replayed back to back (F0, F0, B0, B0) the step takes 6 ms: idle 0.5 on both stages."""
    trace = load_script(SCRIPTS / "pipeline_trace.py")
    Span = trace.plot.Span
    spans = [Span("stage 0", 0, 1, "F0", "forward"), Span("stage 1", 3, 4, "F0", "forward"),
             Span("stage 1", 4, 6, "B0", "backward"), Span("stage 0", 7, 9, "B0", "backward")]
    assert trace.replay(spans, 2)["per_stage"] == pytest.approx([0.5, 0.5])
    assert trace.replay(spans, 2)["span"] == pytest.approx(6.0)
