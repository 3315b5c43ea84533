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


# ------------------------------------------------------------------------ stop strings
def run_streamed(engine, prompt, params) -> tuple[list[str], object]:
    rid = engine.add_request(prompt, params)
    pieces, final = [], None
    while final is None:
        for out in engine.step():
            if out.request_id == rid:
                pieces.append(out.new_text)
                final = out if out.finished else None
    return pieces, final


@pytest.mark.parametrize("engine_kind", ["plain", "overlap"])
def test_stop_strings_end_the_text_where_they_first_appear(small_model, engine_kind) -> None:
    from mlsys.engine.overlap import OverlapEngine

    make = OverlapEngine if engine_kind == "overlap" else Engine
    engine = make(small_model, config=EngineConfig(block_size=8))
    tok = engine.tokenizer
    prompt = '{"name": "ada", '
    base = engine.generate([prompt], SamplingParams(max_tokens=60, ignore_eos=True))[0]
    full, ids = base.text, base.token_ids
    for stops in ([full[20:23]], [full[30:32], full[12:16]], ["never in it \u00e9"], [full[5:6], full[4:9]]):
        pieces, out = run_streamed(engine, prompt, SamplingParams(max_tokens=60, ignore_eos=True, stop=stops))
        if not any(s in full for s in stops):
            assert out.finish_reason == "length" and out.text == full and out.token_ids == ids
            continue
        # oracle: the fewest tokens whose decoded text contains a stop string, and that text up to the first one
        k = next(k for k in range(1, len(ids) + 1) if any(s in tok.decode(ids[:k]) for s in stops))
        text = tok.decode(ids[:k])
        cut = min(i for i in (text.find(s) for s in stops) if i >= 0)
        assert out.finish_reason == "stop" and out.token_ids == ids[:k]
        assert out.text == text[:cut] == "".join(pieces)
        sent = ""
        for piece in pieces:  # no stop string is ever streamed, not even in part beyond what the text keeps
            sent += piece
            assert not any(s in sent for s in stops) and full.startswith(sent)


def test_stop_strings_cut_inside_a_subword_token(tmp_path) -> None:
    """With byte-level BPE a stop string may end in the middle of a token: the text is cut there."""
    from test_checkpoint import build_with, byte_level_bpe

    from mlsys.engine import LLM

    build_with("llama-gqa", tmp_path, vocab_size=300)
    byte_level_bpe(tmp_path, 300)
    llm = LLM(model=str(tmp_path), block_size=4)
    base = llm.generate("the cat", SamplingParams(max_tokens=40, ignore_eos=True))[0].outputs[0]
    text = base.text
    assert len(text) > 12
    stop = text[7:10]
    out = llm.generate("the cat", SamplingParams(max_tokens=40, ignore_eos=True, stop=stop))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]
