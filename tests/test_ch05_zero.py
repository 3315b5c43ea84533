"""Chapter 5, ZeRO: stages 1-3 from scratch against AdamW in one process, measured memory against the 16-bytes-per-
parameter accounting, the bytes sent per step against the ring formulas, and PyTorch's ZeroRedundancyOptimizer and
fully_shard against our stage 1 and stage 3; the ZeRO grid's ranges against a brute-force owner count and the bytes the
run measured, and stage 2's step frames against what each collective writes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import load_script, run, scripts_dir
from mlsys.cli import SelfCheckFailed
from mlsys.collectives import comm_volume
from mlsys.memory import zero_bytes_per_rank
from mlsys.model import GPT, GPTConfig, num_params

CH05 = scripts_dir(5)
zero = load_script(CH05 / "zero.py")
common = load_script(CH05 / "_zero_common.py")
W, LAYERS = 3, 2  # 3 does not divide the unit sizes: the padding is exercised


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("zero") / "zero.json"
    proc = run([CH05 / "zero.py", "-w", str(W), "--layers", str(LAYERS), "--steps", "2", "--json", out,
                "--plot-dir", out.parent], timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out.parent / "zero_memory.png").is_file()
    return json.loads(out.read_text())["results"]


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("zero_torch") / "zero_torch.json"
    proc = run([CH05 / "zero_torch.py", "--smoke", "--json", out], timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())["results"]


def sizes() -> tuple[int, int, int]:
    """(Psi, root numel, block numel) of the tiny GPT the runs train."""
    model = GPT(GPTConfig.preset("tiny", n_layer=LAYERS))
    root = model.wte.weight.numel() + model.wpe.weight.numel() + sum(p.numel() for p in model.ln_f.parameters())
    return num_params(model), root, sum(p.numel() for p in model.h[0].parameters())


def padded(n: int, w: int = W) -> int:
    return math.ceil(n / w) * w


# ----------------------------------------------------------------------------------------------- pure functions
@pytest.mark.parametrize("numel", [1, 2, 7, 12, 29024])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_shard_bounds_tile_the_padded_buffer(numel: int, world_size: int) -> None:
    bounds = [zero.shard_bounds(numel, world_size, r) for r in range(world_size)]
    total = bounds[0][0]
    assert total % world_size == 0 and numel <= total < numel + world_size
    assert [lo for _, lo, _ in bounds] == [r * total // world_size for r in range(world_size)]
    assert all(hi - lo == total // world_size for _, lo, hi in bounds)
    assert bounds[-1][2] == total


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_zero_bytes_per_rank_is_16_bytes_per_param_split_by_stage(precision: str) -> None:
    psi, w = 1000, 4
    per = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}[precision]
    expected = {0: (1, 1, 1), 1: (1, 1, 1 / w), 2: (1, 1 / w, 1 / w), 3: (1 / w, 1 / w, 1 / w)}
    for stage, shares in expected.items():
        got = zero_bytes_per_rank(psi, w, stage, precision)
        want = [b * s * psi for b, s in zip(per, shares)]
        assert [got["params"], got["grads"], got["optimizer"]] == pytest.approx(want)
        assert got["total"] == pytest.approx(sum(want))
    assert zero_bytes_per_rank(psi, 1, 0, precision)["total"] == 16 * psi


def test_flat_unit_views_and_held_bytes_in_process() -> None:
    """FlatUnit re-points the parameters into one padded buffer without changing the model; held_bytes counts a
    view once and a freed buffer as zero (stage 3 keeps only its shard)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_layer=1))
    x = torch.randint(0, model.config.vocab_size, (2, 8))
    before, _ = model(x)
    params = list(model.parameters())
    unit = zero.FlatUnit(params, stage=1, world_size=3, rank=2, dtype=torch.float32)
    after, _ = model(x)
    assert torch.equal(before, after)
    assert all(p.untyped_storage().data_ptr() == unit.full.untyped_storage().data_ptr() for p in params)
    opt = torch.optim.AdamW([unit.master])
    held = zero.held_bytes([unit], opt)
    assert held["params"] == 4 * padded(num_params(model)) and held["grads"] == held["params"]
    assert held["optimizer"] == 0  # the fp32 master IS the shard of the flat buffer; no Adam state before a step

    model3 = GPT(GPTConfig.preset("tiny", n_layer=1))
    unit3 = zero.FlatUnit(list(model3.parameters()), stage=3, world_size=3, rank=1, dtype=torch.bfloat16)
    held3 = zero.held_bytes([unit3], torch.optim.AdamW([unit3.master]))
    s = padded(num_params(model3)) // 3
    assert held3 == {"params": 2 * s, "grads": 2 * s, "optimizer": 4 * s, "total": 8 * s}


# ----------------------------------------------------------------------------------------------- the script
@pytest.mark.timeout(120)
def test_every_fp32_stage_equals_adamw_in_one_process(zero_run: dict) -> None:
    runs = zero_run["runs"]
    assert set(runs) == {f"stage{s}_{p}" for s in range(4) for p in ("fp32", "mixed")}
    for s in range(4):
        # at these settings no gradient sits at rounding level: the strict bound holds for every weight
        assert runs[f"stage{s}_fp32"]["max_abs_diff_vs_adamw"] <= common.ORACLE_STEP_FRACTION * 1e-3
        # mixed: against the same bf16 recipe in one process, all but 1% of the weights within the bf16 bound
        assert runs[f"stage{s}_mixed"]["share_beyond_mixed_bound"] <= common.MIXED_ROUNDING_SHARE
        assert runs[f"stage{s}_fp32"]["losses"] == pytest.approx(zero_run["reference_losses"], abs=1e-4)


@pytest.mark.timeout(120)
def test_measured_memory_matches_the_formula_within_10_percent(zero_run: dict) -> None:
    psi, root, block = sizes()
    assert zero_run["num_params"] == psi
    rows = zero_run["memory"]
    assert len(rows) == 4 * 2 * 4  # 4 stages x 2 precisions x (params, grads, optimizer, total)
    for row in rows:
        formula = zero_bytes_per_rank(psi, W, row["stage"], row["precision"])[row["kind"]]
        assert row["formula_B"] == round(formula)
        assert row["measured_B"] / formula == pytest.approx(1.0, abs=0.10), row
    # exact expectations from the padded sizes (W=3 divides none of the units)
    by = {(r["stage"], r["precision"], r["kind"]): r for r in rows}
    flat = padded(psi)
    assert by[(1, "fp32", "optimizer")]["measured_B"] == 8 * flat // W + 4  # m, v of the shard + AdamW's step
    assert by[(2, "mixed", "grads")]["measured_B"] == 2 * flat // W
    shards = padded(root) // W + LAYERS * padded(block) // W
    assert by[(3, "fp32", "params")]["measured_B"] == 4 * shards
    # stage 3's transient peak: the shards, the gathered root, and one gathered block at a time
    assert by[(3, "fp32", "params")]["peak_B"] == 4 * (shards + padded(root) + padded(block))
    # stage 2's peak gradient: the full gradient exists until its reduce-scatter, beside the persistent shard
    assert by[(2, "fp32", "grads")]["peak_B"] == 4 * (flat + flat // W)


@pytest.mark.timeout(120)
def test_bytes_sent_per_step_follow_the_ring_formulas(zero_run: dict) -> None:
    psi, root, block = sizes()
    runs = zero_run["runs"]
    for precision, b in (("fp32", 4), ("mixed", 2)):
        flat = padded(psi) * b  # stages 1-3 pad to a multiple of W; stage 0 shards nothing and does not pad
        ddp = comm_volume("all_reduce", psi * b, W)["sent"]
        assert runs[f"stage0_{precision}"]["sent_bytes_per_step"] == pytest.approx(ddp)
        for s in (1, 2):  # reduce-scatter + all-gather: the all-reduce's volume (up to the padding)
            rs_ag = comm_volume("reduce_scatter", flat, W)["sent"] + comm_volume("all_gather", flat, W)["sent"]
            assert runs[f"stage{s}_{precision}"]["sent_bytes_per_step"] == pytest.approx(rs_ag)
            assert rs_ag == pytest.approx(ddp, rel=1e-3)
        units = [padded(root) * b] + [padded(block) * b] * LAYERS
        blocks_only = units[1:]
        stage3 = (sum(comm_volume("all_gather", n, W)["sent"] for n in units)  # forward
                  + sum(comm_volume("all_gather", n, W)["sent"] for n in blocks_only)  # backward (root stays)
                  + sum(comm_volume("reduce_scatter", n, W)["sent"] for n in units))
        assert runs[f"stage3_{precision}"]["sent_bytes_per_step"] == pytest.approx(stage3)
        assert 1.3 < stage3 / ddp <= 1.5


# ----------------------------------------------------------------------------------------------- PyTorch's own
@pytest.mark.timeout(120)
def test_pytorch_zero_optimizer_and_fully_shard_match_adamw(torch_run: dict) -> None:
    psi, w = torch_run["num_params"], torch_run["world_size"]
    for name, stage in (("ZeroRedundancyOptimizer", 1), ("fully_shard", 3)):
        out = torch_run[name]
        assert out["ran"], out.get("error")
        assert out["sharded_like_stage"] == stage
        assert out["max_abs_diff_vs_adamw"] <= common.ORACLE_STEP_FRACTION * 1e-3
        formula = zero_bytes_per_rank(psi, w, stage, "fp32")
        assert len(out["per_rank"]) == w
        assert sum(r["optimizer"] for r in out["per_rank"]) == pytest.approx(w * formula["optimizer"], rel=0.02)
        for r in out["per_rank"]:
            assert r["params"] == pytest.approx(formula["params"], rel=0.10)
            assert r["grads"] == pytest.approx(formula["grads"], rel=0.10)


def test_adamw_oracle_tolerates_rounding_flips_but_not_a_wrong_shard() -> None:
    """The fp32 check: a few weights whose rounding-level gradient Adam turned into a full step pass; a shard that
    moved (what a ZeRO bug does: a wrong slice, a missing reduction) fails, even by less than one step."""
    class Args:
        lr, steps = 1e-3, 4

    want = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    flipped = want.clone()
    flipped[:50] += 1.5 * Args.lr  # 0.05% of the weights took a rounding-driven step the other way
    common.expect_adamw_equal("flips", flipped, want, Args)
    wrong_shard = want.clone()
    wrong_shard[25_000:50_000] += 0.2 * Args.lr  # one of four shards off by a fifth of a step
    with pytest.raises(SelfCheckFailed, match="of weights differ"):
        common.expect_adamw_equal("shard", wrong_shard, want, Args)


@pytest.mark.timeout(60)
def test_mixed_oracle_passes_the_bf16_recipe_and_fails_without_the_gradient_reduction() -> None:
    """The mixed-precision check against its one-process oracle (the real ZeRO runs pass it: the test above).
    Planted bug: rank 0 steps on
    its own gradient only (a ZeRO with no gradient all-reduce / reduce-scatter) -- it must fail, although its
    distance from the old fp32-AdamW tolerance (1e-2) would have passed."""
    from mlsys.data import load_splits

    class Args:
        seed, layers, batch_size, seq_len, lr, steps = 0, 2, 4, 32, 1e-3, 3

    tokens, _ = load_splits(num_records=600, seed=0)
    want = common.reference_mixed(tokens, W, Args)
    assert common.expect_mixed_equal("oracle vs itself", want, want, W, Args) == 0.0
    planted = common.reference_mixed(tokens, W, Args, ranks=[0])
    assert (planted - want).abs().max().item() < 1e-2  # the old check could not see it
    with pytest.raises(SelfCheckFailed, match="one-process bf16 oracle"):
        common.expect_mixed_equal("no gradient reduction", planted, want, W, Args)


def test_memory_summary_has_one_row_per_stage_and_adds_up(zero_run: dict) -> None:
    """The printed table and the stacked bars: one row per (precision, stage), the kinds adding up to the total."""
    summary = common.memory_summary(zero_run["memory"])
    assert [(r["precision"], r["stage"]) for r in summary] == [(p, s) for p in ("fp32", "mixed") for s in range(4)]
    for r in summary:
        assert r["params_B"] + r["grads_B"] + r["optimizer_B"] == r["total_B"] <= r["peak_B"]
    mixed = {r["stage"]: r for r in summary if r["precision"] == "mixed"}
    assert mixed[1]["optimizer_B"] < mixed[0]["optimizer_B"] and mixed[2]["grads_B"] < mixed[1]["grads_B"]
    assert mixed[3]["params_B"] < mixed[2]["params_B"]


# ----------------------------------------------------------------------------------------------- the ZeRO grid
def _elements(ranges) -> int:
    return sum(b - a for a, b in ranges)


@pytest.mark.timeout(120)
def test_zero_grid_owners_by_brute_force_count(zero_run: dict) -> None:
    """The grid's ranges, element by element: a sharded kind has every real element of every unit held by exactly
    one rank (a brute-force count over the flat vector, unit sizes from the model itself), a replicated kind has
    it on every rank; and what the grid drew is what the ranks recorded."""
    psi, root, block = sizes()
    sharded = {0: set(), 1: {"optimizer"}, 2: {"optimizer", "grads"}, 3: {"optimizer", "grads", "params"}}
    for stage in range(4):
        layouts = zero_run["runs"][f"stage{stage}_fp32"]["layout"]
        assert len(layouts) == W
        real = [psi] if stage < 3 else [root] + [block] * LAYERS
        units = layouts[0]["units"]
        assert [b - a for a, b in units] == [padded(n, W if stage else 1) for n in real]  # stage 0: no padding
        for kind in ("params", "grads", "optimizer"):
            count = [0] * units[-1][1]
            for layout in layouts:
                for a, b in layout[kind]["held"]:
                    for i in range(a, b):
                        count[i] += 1
            want = 1 if kind in sharded[stage] else W
            for (a, _), n in zip(units, real):
                assert set(count[a:a + n]) == {want}, (stage, kind)
        drawn = [b for b in zero_run["grid_boxes"] if b["stage"] == stage]
        recorded = [(r, k, a, b) for r, lay in enumerate(layouts) for k in ("params", "grads", "optimizer")
                    for a, b in lay[k]["held"]]
        assert sorted((b["rank"], b["kind"], b["start"], b["end"]) for b in drawn) == sorted(recorded)
        assert all(b["own"] == (b["kind"] in sharded[stage]) for b in drawn)


@pytest.mark.timeout(120)
def test_zero_grid_ranges_add_up_to_the_bytes_the_run_measured(zero_run: dict) -> None:
    """Independent of the grid's arithmetic: rank 0's recorded ranges, times the bytes of an element, are the
    bytes held_bytes found in its storages (plus one 4-byte AdamW step counter per unit)."""
    per = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}  # the fp32 master shares the shard's storage: counted once
    for name, result in zero_run["runs"].items():
        layout, held = result["layout"][0], result["held"]
        p_b, g_b, o_b = per[name.split("_")[1]]
        assert held["params"] == p_b * _elements(layout["params"]["held"]), name
        assert held["grads"] == g_b * _elements(layout["grads"]["held"]), name
        assert held["optimizer"] == o_b * _elements(layout["optimizer"]["held"]) + 4 * len(layout["units"]), name


@pytest.mark.timeout(120)
def test_zero_step_frames_change_only_what_each_collective_writes(zero_run: dict) -> None:
    """Stage 2's recorded moments: the reduce-scatter changes only the rank's own gradient slice, the update only
    its own slice of the parameters, and the all-gather only the others' slices -- which together are the whole."""
    phases = zero_run["runs"]["stage2_fp32"]["phases"]
    psi = sizes()[0]
    S = padded(psi) // W
    for r, moments in enumerate(phases):
        by = dict((name, snap) for name, snap in moments)
        assert list(by) == ["start", "backward", "reduce-scatter", "update", "all-gather"]
        mine = set(range(r * S, (r + 1) * S))
        changed = {m: {i for a, b in by[m]["params"]["changed"] for i in range(a, b)} for m in by}
        grads_rs = {i for a, b in by["reduce-scatter"]["grads"]["changed"] for i in range(a, b)}
        assert grads_rs and grads_rs <= mine
        assert changed["update"] and changed["update"] <= mine
        assert changed["all-gather"].isdisjoint(mine)
        assert len((changed["update"] | changed["all-gather"]) & set(range(psi))) > 0.99 * psi
        assert not changed["backward"] and not changed["reduce-scatter"]


@pytest.mark.parametrize("world_size", range(1, 10))
def test_zero_grid_never_draws_a_rank_shard_in_the_full_copy_grey(world_size: int) -> None:
    """The grid's title says grey is a full copy and a colour is a rank's own shard: at every world size the script
    accepts (1..8, and one more), each rank's shard gets its own colour, none of them a grey (red, green and blue
    within a few hundredths of each other), and full copies are grey."""
    from matplotlib.colors import to_rgb

    from mlsys import plot

    n = 8
    layouts = [{"units": [(0, n * world_size)],
                "params": {"held": [(0, n * world_size)], "changed": []},  # a full copy
                "grads": {"held": [], "changed": []},
                "optimizer": {"held": [(r * n, r * n + n // 2)], "changed": []}}  # part of rank r's slice
               for r in range(world_size)]
    plt = plot.pyplot()
    fig, ax = plt.subplots()
    drawn = common.draw_rank_rows(ax, layouts)
    plt.close(fig)

    def grey(c) -> bool:
        rgb = to_rgb(c)
        return max(rgb) - min(rgb) < 0.05

    own = {b["rank"]: to_rgb(b["colour"]) for b in drawn if b["own"]}
    assert sorted(own) == list(range(world_size))
    assert len(set(own.values())) == world_size  # one colour per rank
    assert not any(grey(c) for c in own.values()), own
    assert all(grey(b["colour"]) for b in drawn if not b["own"])


@pytest.mark.parametrize("world_size, steps", [(4, 4), (2, 1), (8, 3)])
def test_mixed_bound_is_w_minus_1_bf16_roundings_per_step(world_size: int, steps: int) -> None:
    """The lesson works the bf16 bound out as lr x (W - 1) x 2^-8 x steps (bf16 keeps 8 significant bits)."""
    assert common.mixed_step_fraction(world_size, steps) == pytest.approx((world_size - 1) * 2.0 ** -8 * steps)
