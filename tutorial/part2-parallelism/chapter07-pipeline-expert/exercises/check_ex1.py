"""Checker for ch07.1 — your 1F1B order against mlsys.pipeline, your bubble against the formula, then a real run."""

from __future__ import annotations

import random

import torch

from mlsys.data import Tokenizer, get_batch, make_corpus
from mlsys.exercises import run_ranks, task
from mlsys.model import GPT, GPTConfig
from mlsys.pipeline import bubble_fraction, measured_bubble, schedule_actions, simulate, split_gpt


def _show(order: list) -> str:
    return " ".join(f"{k}{i}" for k, i in order)


def _one_process(seed: int, num_micro: int, num_stages: int) -> tuple[list[list[str]], dict]:
    """The oracle, here in the checker's process: the same tiny GPT and batch as pipelined_gradients, run whole in
    one process. Returns the parameter names each stage holds (whole-model names) and every parameter's gradient
    (lm_head.weight: the tied matrix's, which both ends' copies must equal)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = GPT(GPTConfig.preset("tiny", n_layer=3))
    tokens = Tokenizer().encode_corpus(make_corpus(100, seed))
    x, y = get_batch(tokens, 2 * num_micro, 16, torch.Generator().manual_seed(seed))
    names = [[st.global_name(n) for n, _ in st.named_parameters()] for st in split_gpt(model, num_stages)]
    model(x, y)[1].backward()
    grads = {n: model.get_parameter("wte.weight" if n == "lm_head.weight" else n).grad.detach()
             for stage in names for n in stage}
    return names, grads


@task("one_f_one_b_order: every stage of p = 1..5 stages, m = 1..8 micro-batches")
def check_order(ex) -> None:
    for p in range(1, 6):
        for m in range(1, 9):
            for s in range(p):
                got = [tuple(a) for a in ex.one_f_one_b_order(s, p, m)]
                want = schedule_actions("1f1b", s, p, m)
                assert got == want, f"p={p}, m={m}, stage {s}: got {_show(got)}, want {_show(want)}"


@task("bubble_from_timeline: ideal timelines give (p-1)/(m+p-1); uneven ones match a reference")
def check_bubble(ex) -> None:
    for schedule in ("gpipe", "1f1b"):
        for p, m in [(2, 1), (2, 4), (3, 3), (4, 8)]:
            got = ex.bubble_from_timeline(simulate(schedule, p, m, t_fwd=1.0, t_bwd=2.0))
            want = bubble_fraction(p, m)
            assert len(got) == p, f"{schedule} p={p}: want one fraction per stage, got {len(got)}"
            assert all(abs(b - want) < 1e-9 for b in got), f"{schedule} p={p} m={m}: got {got}, want {want:.4f} each"
    rng = random.Random(0)
    events = [[{"start": t, "end": t + rng.uniform(0.5, 2.0)} for t in sorted(rng.uniform(0, 20) for _ in range(5))]
              for _ in range(3)]
    got, want = ex.bubble_from_timeline(events), measured_bubble(events)["per_stage"]
    assert all(abs(a - b) < 1e-9 for a, b in zip(got, want)), f"uneven timeline: got {got}, want {want}"


@task("your order runs for real on 3 ranks: gradients equal one process, stage s holds <= 3 - s micro-batches")
def check_real_run(ex) -> None:
    for s in range(3):  # a wrong order could hang the job: run it only once it is right on paper
        got = [tuple(a) for a in ex.one_f_one_b_order(s, 3, 4)]
        assert got == schedule_actions("1f1b", s, 3, 4), "fix one_f_one_b_order first (task 1)"
    results = run_ranks(ex, "pipelined_gradients", [(0, 4)] * 3)
    names, want = _one_process(0, 4, 3)
    for s, r in enumerate(results):
        got = r["grads"]
        missing, extra = sorted(set(names[s]) - set(got)), sorted(set(got) - set(names[s]))
        assert not missing and not extra, (f"stage {s}: gradients missing for {missing[:4]}"
                                           f"{'...' if len(missing) > 4 else ''}, unexpected for {extra[:4]}")
        for name in names[s]:
            assert got[name] is not None, f"stage {s}: {name} has no gradient (backward never reached it?)"
            g = torch.tensor(got[name], dtype=torch.float64)
            assert g.shape == want[name].shape, (f"stage {s}: {name}'s gradient has shape {tuple(g.shape)}, "
                                                 f"want {tuple(want[name].shape)}")
            diff = float((g - want[name].double()).abs().max())
            assert diff < 1e-5, f"stage {s}: {name}'s gradient differs from one process by {diff:.3g}"
        assert r["peak_in_flight"] == 3 - s, f"stage {s} held {r['peak_in_flight']} micro-batches, want {3 - s}"
