"""mlsys.engine.sampler row by row, in the test's own process (mutation testing).

Oracles, none of them the sampler's own code:
- greedy rows: numpy's argmax;
- sampling rows: a draw by torch.multinomial from a torch.Generator seeded like the request, over probabilities
  computed with numpy (softmax of logits / T, the top-k and the top-p nucleus cut by sorting by hand); and rows
  whose filter leaves one token (top_k = 1, a tiny top_p) must give that token whatever the seed;
- log-probabilities: numpy's log-softmax of the same filtered logits;
- structured masks: brute force over the schema's finite language (each allowed next character is one that some
  document of the language continues with, within the remaining budget; <eos> only after a whole document).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlsys.data import Tokenizer
from mlsys.engine.request import SamplingParams, Sequence
from mlsys.engine.sampler import apply_structured_masks, sample, sampled_logprobs
from mlsys.json_constrained import compile_schema

V = 12


def seq(**params) -> Sequence:
    return Sequence("r", [1, 2], SamplingParams(**params))


def logits_rows(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(size=(rows, V)).astype(np.float32))


def filtered_probs(row: np.ndarray, temperature: float, top_k: int | None = None, top_p: float = 1.0) -> np.ndarray:
    """softmax(row / T) over the top k, then over the fewest most likely tokens whose probability reaches top_p."""
    x = row.astype(np.float64) / temperature
    keep = np.ones(V, dtype=bool)
    order = np.argsort(-x, kind="stable")
    if top_k is not None:
        keep[order[top_k:]] = False
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        cum, nucleus = 0.0, np.zeros(V, dtype=bool)
        for t in order:
            if cum >= top_p:
                break
            nucleus[t], cum = True, cum + p[t]
        p = np.where(nucleus, p, 0.0)
        p /= p.sum()
    return p


def draw(probs: np.ndarray, generator: torch.Generator) -> int:
    return int(torch.multinomial(torch.tensor(probs, dtype=torch.float32), 1, generator=generator))


# ------------------------------------------------------------------------------------------ sample
def test_greedy_rows_take_the_argmax() -> None:
    logits = logits_rows(5)
    assert sample(logits, [seq() for _ in range(5)]) == np.argmax(logits.numpy(), axis=1).tolist()


def test_seeded_rows_draw_from_their_own_generator_step_after_step() -> None:
    logits = logits_rows(4, seed=1)
    seqs = [seq(temperature=0.7, seed=11), seq(), seq(temperature=1.5, seed=12), seq(temperature=0.4, seed=13)]
    gens = {i: torch.Generator().manual_seed(s) for i, s in ((0, 11), (2, 12), (3, 13))}
    temps = {0: 0.7, 2: 1.5, 3: 0.4}
    for _ in range(6):  # each step advances each row's generator by exactly one draw
        got = sample(logits, seqs)
        assert got[1] == int(np.argmax(logits[1].numpy()))
        for i, gen in gens.items():
            assert got[i] == draw(filtered_probs(logits[i].numpy(), temps[i]), gen), i


def test_a_row_filtered_to_one_token_gives_it_whatever_the_seed() -> None:
    logits = torch.from_numpy(np.linspace(1.0, 0.4, V, dtype=np.float32))[None].repeat(24, 1)  # nearly flat
    for params in ({"top_k": 1}, {"top_p": 0.01}):
        got = sample(logits, [seq(temperature=1.0, seed=s, **params) for s in range(24)])
        assert got == [0] * 24, params  # unfiltered, this flat a row would draw other tokens
    got = sample(logits, [seq(temperature=1.0, seed=s) for s in range(24)])
    assert len(set(got)) > 3  # the same rows unfiltered: spread


def test_top_k_and_top_p_rows_against_a_hand_filter() -> None:
    logits = logits_rows(3, seed=4)
    cases = [dict(temperature=0.9, top_k=3, seed=5), dict(temperature=1.2, top_p=0.6, seed=6),
             dict(temperature=0.8, top_k=5, top_p=0.7, seed=7)]
    seqs = [seq(**c) for c in cases]
    gens = [torch.Generator().manual_seed(c["seed"]) for c in cases]
    for _ in range(8):
        got = sample(logits, seqs)
        for i, c in enumerate(cases):
            p = filtered_probs(logits[i].numpy(), c["temperature"], c.get("top_k"), c.get("top_p", 1.0))
            assert p[got[i]] > 0  # inside the filter
            assert got[i] == draw(p, gens[i])


def test_an_unseeded_row_uses_the_global_generator() -> None:
    logits = logits_rows(2, seed=2)
    torch.manual_seed(9)
    got = sample(logits, [seq(temperature=1.0), seq(temperature=1.0)])
    torch.manual_seed(9)
    want = [draw(filtered_probs(logits[i].numpy(), 1.0), torch.default_generator) for i in range(2)]
    assert got == want


# ------------------------------------------------------------------------------------------ sampled_logprobs
def test_logprobs_only_for_the_rows_that_asked() -> None:
    logits = logits_rows(4, seed=3)
    seqs = [seq(), seq(logprobs=True), seq(temperature=0.5, top_k=4, logprobs=True, top_logprobs=3),
            seq(temperature=2.0, top_p=0.5, logprobs=True, top_logprobs=V + 5)]
    ids = [0, 5, int(np.argmax(logits[2].numpy())), int(np.argmax(logits[3].numpy()))]
    out, top = sampled_logprobs(logits, seqs, ids)
    assert out[0] is None and top[0] is None  # did not ask
    x = logits[1].numpy().astype(np.float64)
    raw = x - x.max() - np.log(np.exp(x - x.max()).sum())  # a greedy row: the raw log-softmax
    assert out[1] == pytest.approx(raw[5], abs=1e-5) and top[1] is None  # no top_logprobs asked
    for i, (t, k, p) in ((2, (0.5, 4, 1.0)), (3, (2.0, None, 0.5))):
        with np.errstate(divide="ignore"):
            logp = np.log(filtered_probs(logits[i].numpy(), t, k, p))
        assert out[i] == pytest.approx(logp[ids[i]], abs=1e-5)
        finite = np.isfinite(logp)
        listed = sorted(np.flatnonzero(finite), key=lambda v: -logp[v])[: seqs[i].params.top_logprobs]
        assert set(top[i]) == set(listed)  # the most likely, never a filtered-out token
        for v in listed:
            assert top[i][v] == pytest.approx(logp[v], abs=1e-5)
    assert len(top[2]) == 3 and len(top[3]) == int(finite.sum())


# ------------------------------------------------------------------------------------------ structured masks
LANGUAGES = {"bool": ({"type": "boolean"}, ["true", "false"]),
             "enum": ({"enum": ["ab", "abcd", 7]}, ['"ab"', '"abcd"', "7"]),
             "null": ({"type": "null"}, ["null"])}


def allowed_by_brute_force(words: list[str], prefix: str, remaining: int, tok: Tokenizer) -> set[int]:
    ok = {tok.stoi[w[len(prefix)]] for w in words
          if w.startswith(prefix) and len(w) > len(prefix) and len(w) - len(prefix) <= remaining}
    return ok | ({tok.eos_id} if prefix in words else set())


def test_each_schema_row_keeps_what_its_language_allows() -> None:
    fsms = {name: compile_schema(schema) for name, (schema, _) in LANGUAGES.items()}
    tok = fsms["bool"].tok
    width = tok.vocab_size + 3  # a checkpoint's embedding padded past the tokenizer: never allowed
    rows = [("bool", "", 4), (None, "", 0), ("enum", '"ab', 1), ("bool", "fa", 3), ("enum", '"ab', 3),
            ("enum", '"ab"', 5), ("bool", "", 5), ("enum", "", 2), ("null", "nu", 2)]  # null: a schema of one row
    seqs, remaining = [], []
    for name, prefix, budget in rows:
        s = seq()
        if name is not None:
            s.fsm, s.fsm_state = fsms[name], fsms[name].walk(prefix)
        seqs.append(s)
        remaining.append(budget)
    logits = torch.zeros(len(rows), width)
    out = apply_structured_masks(logits, seqs, remaining)
    assert out is not logits and (logits == 0).all()  # a masked copy
    for r, (name, prefix, budget) in enumerate(rows):
        kept = set(torch.isfinite(out[r]).nonzero().flatten().tolist())
        if name is None:
            assert kept == set(range(width))  # a free row: untouched
        else:
            assert kept == allowed_by_brute_force(LANGUAGES[name][1], prefix, budget, tok), (name, prefix, budget)
            assert (out[r, list(kept)] == 0).all()


def test_no_schema_in_the_batch_returns_the_logits_themselves() -> None:
    logits = logits_rows(2)
    assert apply_structured_masks(logits, [seq(), seq()], [3, 3]) is logits
