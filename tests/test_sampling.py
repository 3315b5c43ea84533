"""Nucleus (top-p) sampling against transformers' TopPLogitsWarper, in the sampler, the engine and the server."""

from __future__ import annotations

import pytest
import torch

from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.model import filter_logits

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import TopPLogitsWarper  # noqa: E402


def hf_filter(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    return TopPLogitsWarper(top_p)(None, logits / temperature)


@pytest.mark.parametrize("top_p", [1e-9, 0.1, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_the_nucleus_is_transformers_nucleus(top_p, temperature) -> None:
    logits = torch.randn(32, 53, generator=torch.Generator().manual_seed(int(top_p * 1000) + int(10 * temperature)))
    ours, theirs = filter_logits(logits, temperature, top_p=top_p), hf_filter(logits, temperature, top_p)
    assert torch.equal(ours.isinf(), theirs.isinf())
    kept = ~ours.isinf()
    torch.testing.assert_close(ours[kept], theirs[kept])
    assert kept.sum(1).min() >= 1


def test_top_p_one_and_none_change_nothing() -> None:
    logits = torch.randn(4, 20)
    assert torch.equal(filter_logits(logits, 1.0, top_p=1.0), logits)
    assert torch.equal(filter_logits(logits, 2.0, top_p=None), logits / 2.0)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan")])
def test_sampling_params_reject_top_p_outside_0_1(bad) -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=bad)


def test_the_engine_samples_inside_the_nucleus_with_its_logprob(small_model) -> None:
    """Every sampled token lies in transformers' nucleus of a plain forward's logits, and its reported log-prob is
    the log-softmax over that nucleus."""
    engine = Engine(small_model, config=EngineConfig(block_size=8))
    prompts = ['{"name": "ada", ', '{"city": "', '{"name": "grace", "age": ']
    params = [SamplingParams(max_tokens=24, temperature=1.3, top_p=p, seed=i, logprobs=True, ignore_eos=True)
              for i, p in enumerate((0.3, 0.6, 0.9))]
    outs = engine.generate(prompts, params)
    for out, sp in zip(outs, params):
        p, o = out.prompt_token_ids, out.token_ids
        with torch.no_grad():
            logits, _ = small_model(torch.tensor([p + o]))
        rows = hf_filter(logits[0, len(p) - 1 : -1].double(), sp.temperature, sp.top_p)  # row j predicts o[j]
        picked = rows[torch.arange(len(o)), torch.tensor(o)]
        assert not picked.isinf().any(), "a token outside the nucleus was sampled"
        want = torch.log_softmax(rows, -1)[torch.arange(len(o)), torch.tensor(o)]
        assert out.logprobs == pytest.approx(want.tolist(), abs=1e-5)
    # a narrow nucleus leaves fewer choices: more steps where only one token was possible
    narrow = SamplingParams(max_tokens=24, temperature=1.3, top_p=1e-6, seed=0, ignore_eos=True)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts[:1], narrow)[0].token_ids == engine.generate(prompts[:1], greedy)[0].token_ids
