"""The GPT against its oracles: itself without a cache, and Hugging Face GPT-2.

    PYTHONPATH=. .venv/bin/python -m pytest tests/test_model.py -q    # ~5 s, mostly importing transformers
"""

import pytest
import torch

from mlsys import weights
from mlsys.data import Tokenizer, load_splits
from mlsys.model import GPT, GPTConfig, from_hf_state_dict, generate, num_params, to_hf_model, to_hf_state_dict
from mlsys.train import lr_at, train

ATOL = 1e-5  # float32 on CPU


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny")).eval()


def prompt(batch_size=2, length=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, Tokenizer().vocab_size, (batch_size, length), generator=gen)


def test_presets_and_param_counts():
    sizes = {name: num_params(GPT(GPTConfig.preset(name))) for name in ("tiny", "small", "draft")}
    assert sizes["tiny"] < sizes["draft"] < sizes["small"] < 1_000_000
    cfg = GPTConfig.preset("small")
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size) == (4, 4, 128, 256, 47)
    assert GPTConfig.preset("tiny", vocab_size=99, dropout=0.1).vocab_size == 99
    with pytest.raises(ValueError):
        GPTConfig.preset("huge")


def test_kv_cache_prefill_then_decode_matches_full_forward(tiny):
    idx = prompt()  # (2, 40)
    full, _ = tiny(idx)  # (2, 40, V)
    cache = tiny.new_kv_cache(batch_size=2, max_len=40)
    chunks = [tiny(idx[:, :13], kv_cache=cache)[0]]  # prefill 13 positions
    chunks.append(tiny(idx[:, 13:20], kv_cache=cache, start_pos=13)[0])  # a 7-token chunk
    for t in range(20, 40):  # decode one token at a time
        chunks.append(tiny(idx[:, t : t + 1], kv_cache=cache, start_pos=t)[0])
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=ATOL, rtol=0)


def test_generate_with_and_without_cache_agree(tiny):
    idx = prompt(length=5)
    assert torch.equal(generate(tiny, idx, 30), generate(tiny, idx, 30, use_cache=False))
    sampled = [
        generate(tiny, idx, 30, 1.0, top_k=10, generator=torch.Generator().manual_seed(1), use_cache=c)
        for c in (True, False)
    ]
    assert torch.equal(*sampled)
    with pytest.raises(ValueError, match="block_size"):
        generate(tiny, idx, 60)


def test_generate_stops_at_eos(tiny):
    eos = int(tiny(prompt(1, 3))[0][0, -1].argmax())  # whatever greedy picks next
    out = generate(tiny, prompt(1, 3), 20, eos_id=eos)
    assert out.shape == (1, 4) and out[0, -1] == eos


def test_matches_hf_gpt2_logits_and_greedy_generation(tiny):
    pytest.importorskip("transformers")
    hf = to_hf_model(tiny)
    idx = prompt()
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, tiny(idx)[0], atol=ATOL, rtol=0)
    hf.generation_config.eos_token_id = None  # let HF run the full length, as ours does
    hf.generation_config.pad_token_id = Tokenizer().pad_id
    ours = generate(tiny, idx[:, :5], 30)
    theirs = hf.generate(idx[:, :5], max_new_tokens=30, do_sample=False)
    assert torch.equal(ours, theirs)


def test_hf_state_dict_round_trips_both_ways(tiny):
    pytest.importorskip("transformers")
    from transformers import GPT2LMHeadModel

    from mlsys.model import hf_config

    back = from_hf_state_dict(tiny.config, to_hf_state_dict(tiny)).eval()
    idx = prompt()
    torch.testing.assert_close(back(idx)[0], tiny(idx)[0], atol=0, rtol=0)
    torch.manual_seed(1)
    hf = GPT2LMHeadModel(hf_config(tiny.config)).eval()  # HF's own random init
    ours = from_hf_state_dict(tiny.config, hf.state_dict()).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf(idx).logits, atol=ATOL, rtol=0)


def test_lr_schedule_warms_up_then_decays():
    lrs = [lr_at(s, 100, 1.0, 10, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_short_training_run_lowers_loss_and_is_deterministic():
    data = load_splits(num_records=300, seed=0)
    cfg = GPTConfig.preset("tiny")
    runs = [train(cfg, steps=40, batch_size=8, lr=1e-2, seed=0, data=data, progress=False) for _ in range(2)]
    losses = runs[0]["train_loss"]
    assert losses[0] > 3.5  # about ln(47) at init
    assert sum(losses[-5:]) / 5 < 2.5 and runs[0]["final_val_loss"] < 2.5
    assert losses == runs[1]["train_loss"]  # same seed, same numbers


def test_weights_trained_on_first_use_then_loaded(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLSYS_CACHE", str(tmp_path))
    monkeypatch.setitem(weights.RECIPES, "draft", weights.Recipe(steps=2, batch_size=2, lr=1e-3))
    first = weights.load_pretrained("draft")  # cache empty: trains for 2 steps, saves
    assert "training 'draft'" in capsys.readouterr().err
    path = tmp_path / "weights" / "draft.pt"
    assert [p.name for p in path.parent.iterdir()] == ["draft.pt"]  # no temp file left behind
    second = weights.load_pretrained("draft")  # now just loads
    assert capsys.readouterr().err == ""
    assert not second.training
    for (k, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), k
    _, meta = weights.load_checkpoint(path)
    assert meta["steps"] == 2 and meta["torch_version"] == torch.__version__
    assert {"seed", "final_train_loss", "final_val_loss"} <= meta.keys()
