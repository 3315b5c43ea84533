"""Checkpoint folders and the Llama-style decoder against transformers.

Small random-init models are built by `transformers` and written with `save_pretrained` (nothing is downloaded);
mlsys.checkpoint reads the folder, and the logits and greedy tokens must equal transformers' own.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mlsys.checkpoint import CheckpointError, load_pretrained  # noqa: E402
from mlsys.llama import LlamaConfig, rope_frequencies  # noqa: E402
from mlsys.model import generate  # noqa: E402

VOCAB = 101
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
KINDS = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(LLAMA)),
    "llama-mha-bias-tied": ("LlamaConfig", "LlamaForCausalLM",
                            dict(LLAMA, num_key_value_heads=4, attention_bias=True, tie_word_embeddings=True)),
    "llama3-rope-scaling": ("LlamaConfig", "LlamaForCausalLM",
                            dict(LLAMA, num_key_value_heads=1, rope_parameters=dict(
                                rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                high_freq_factor=4.0, original_max_position_embeddings=16))),
    "qwen2-gqa": ("Qwen2Config", "Qwen2ForCausalLM", dict(LLAMA, rope_parameters=dict(rope_type="default",
                                                                                       rope_theta=1e6))),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=2,
                                                   n_head=4, activation_function="gelu_new")),
}


def build_with(kind: str, folder, **overrides) -> torch.nn.Module:
    """`build` of a KINDS entry with some config fields changed (a vocabulary, special ids)."""
    kwargs = KINDS[kind][2]
    return build(kind, folder, config=dict(kwargs, **overrides))


def build(kind: str, folder, config: dict | None = None, **save) -> torch.nn.Module:
    config_name, model_name, kwargs = KINDS[kind]
    kwargs = config if config is not None else kwargs
    torch.manual_seed(0)
    hf = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs)).eval()
    with torch.no_grad():  # biases are zero at init: give them values, or a missing bias would go unnoticed
        for name, p in hf.named_parameters():
            if name.endswith(".bias") or "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(folder, **save)
    # generate() would otherwise stop at, or with min_new_tokens suppress, the config's <eos> (Llama: id 2);
    # the comparisons below are of plain greedy tokens, eos or not (the engine runs with ignore_eos)
    hf.generation_config.eos_token_id = None
    return hf


@pytest.fixture(scope="module", params=sorted(KINDS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, folder)
    ours, _ = load_pretrained(folder)
    return request.param, hf, ours


def test_logits_equal_transformers(pair) -> None:
    kind, hf, ours = pair
    ids = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    got, _ = ours(ids)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_cached_decoding_gives_the_greedy_tokens_of_transformers_generate(pair) -> None:
    kind, hf, ours = pair
    prompt = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                               pad_token_id=0)
    assert torch.equal(generate(ours, prompt, 24), expected)
    assert torch.equal(generate(ours, prompt, 24, use_cache=False), expected)  # the cache changes nothing


def test_gqa_cache_holds_only_the_kv_heads(tmp_path) -> None:
    build("llama-gqa", tmp_path)
    model, config = load_pretrained(tmp_path)
    cache = model.new_kv_cache(batch_size=1, max_len=10)
    assert cache[0].k.shape == (1, config.num_key_value_heads, 10, config.head_dim) == (1, 2, 10, 16)


def test_llama3_frequencies_follow_the_published_rule() -> None:
    """Llama 3's RoPE scaling, checked frequency by frequency against its definition: wavelengths below
    original/high_freq_factor kept, above original/low_freq_factor divided by factor, a blend in between."""
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    c = LlamaConfig(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, rope_theta=500000.0,
                    rope_scaling=scaling)
    plain = LlamaConfig(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, rope_theta=500000.0)
    scaled, base = rope_frequencies(c), rope_frequencies(plain)
    wavelength = 2 * torch.pi / base
    short, long = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    assert torch.equal(scaled[short], base[short])
    torch.testing.assert_close(scaled[long], base[long] / 8)
    mid = ~short & ~long
    assert ((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8)).all()


def test_a_sharded_checkpoint_loads_the_same(tmp_path) -> None:
    hf = build("llama-gqa", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ours, _ = load_pretrained(tmp_path)
    ids = torch.arange(30)[None] % VOCAB
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], hf(ids).logits, atol=2e-5, rtol=1e-4)


def test_bf16_weights_load_and_decode(tmp_path) -> None:
    build("qwen2-gqa", tmp_path)
    model, _ = load_pretrained(tmp_path, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    out = generate(model, torch.tensor([[1, 2, 3]]), 5)
    assert out.shape == (1, 8)


@pytest.mark.parametrize("damage, message", [
    ("no-config", "no config.json"),
    ("bad-json", "not valid JSON"),
    ("unsupported", "architecture 'MistralForCausalLM' is not supported; supported: GPT2LMHeadModel, "
                    "LlamaForCausalLM, Qwen2ForCausalLM"),
    ("no-weights", "no model.safetensors"),
    ("missing-shard", "listed in the index but missing"),
    ("broken-weights", "not a readable safetensors file"),
    ("wrong-shape", "the weights do not fit the config"),
    ("missing-field", "needs the field 'hidden_size'"),
    ("not-a-folder", "not a folder"),
    ("gelu-act", "hidden_act 'gelu' is not supported"),
    ("string-int", "num_hidden_layers must be a positive integer, got '2'"),
    ("float-int", "hidden_size must be a positive integer, got 64.0"),
    ("bool-int", "num_attention_heads must be a positive integer, got True"),
    ("string-float", "rms_norm_eps must be a positive number, got '1e-5'"),
    ("string-bool", "tie_word_embeddings must be true or false, got 'false'"),
    ("int-weights", "has dtype torch.int32 (only floating-point weights"),
    ("bool-weights", "has dtype torch.bool (only floating-point weights"),
])
def test_a_broken_folder_is_one_line_naming_the_problem(tmp_path, damage, message) -> None:
    folder = tmp_path / "ckpt"
    build("llama-gqa", folder, max_shard_size="40KB" if damage == "missing-shard" else "1GB")
    config = json.loads((folder / "config.json").read_text())
    if damage == "no-config":
        (folder / "config.json").unlink()
    elif damage == "bad-json":
        (folder / "config.json").write_text("{not json")
    elif damage == "unsupported":
        (folder / "config.json").write_text(json.dumps(dict(config, architectures=["MistralForCausalLM"])))
    elif damage == "no-weights":
        (folder / "model.safetensors").unlink()
    elif damage == "missing-shard":
        next(folder.glob("model-*.safetensors")).unlink()
    elif damage == "broken-weights":
        (folder / "model.safetensors").write_bytes(b"\x00" * 100)
    elif damage == "wrong-shape":
        (folder / "config.json").write_text(json.dumps(dict(config, intermediate_size=80)))
    elif damage == "missing-field":
        del config["hidden_size"]
        (folder / "config.json").write_text(json.dumps(config))
    elif damage == "not-a-folder":
        folder = folder / "config.json"
    elif damage in ("gelu-act", "string-int", "float-int", "bool-int", "string-float", "string-bool"):
        key, value = {"gelu-act": ("hidden_act", "gelu"), "string-int": ("num_hidden_layers", "2"),
                      "float-int": ("hidden_size", 64.0), "bool-int": ("num_attention_heads", True),
                      "string-float": ("rms_norm_eps", "1e-5"),
                      "string-bool": ("tie_word_embeddings", "false")}[damage]
        (folder / "config.json").write_text(json.dumps(dict(config, **{key: value})))
    elif damage in ("int-weights", "bool-weights"):
        from safetensors.torch import load_file, save_file

        state = load_file(folder / "model.safetensors")
        name = "model.layers.0.mlp.up_proj.weight"
        state[name] = state[name].to(torch.int32 if damage == "int-weights" else torch.bool)
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_pretrained(folder)
    assert message in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------ through the serving engine
ENGINE_SETTINGS = {
    "paged": dict(block_size=4),
    "prefix-cache": dict(block_size=4, enable_prefix_caching=True),
    "chunked-prefill": dict(block_size=4, max_num_batched_tokens=7),
    "preemption": dict(block_size=4, num_blocks=12, max_num_seqs=4, max_model_len=40),  # 4 x up to 10 blocks
    "static": dict(block_size=8, scheduling="static", max_num_seqs=2),
}


@pytest.fixture(scope="module", params=["llama-gqa", "qwen2-gqa", "llama3-rope-scaling"])
def served(request, tmp_path_factory):
    """A checkpoint whose vocabulary is the book's character tokenizer's, and transformers' greedy tokens for
    four prompts that share a prefix (the prefix cache has something to reuse)."""
    from mlsys.data import Tokenizer

    kind = request.param
    folder = tmp_path_factory.mktemp(kind + "-engine")
    hf = build_with(kind, folder, vocab_size=Tokenizer().vocab_size)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, Tokenizer().vocab_size, (9,), generator=g).tolist()
    prompts = [shared + torch.randint(3, Tokenizer().vocab_size, (n,), generator=g).tolist() for n in (1, 4, 7, 12)]
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=17, do_sample=False,
                              pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    model, _ = load_pretrained(folder)
    return model, prompts, expected


@pytest.mark.parametrize("setting", sorted(ENGINE_SETTINGS) + ["overlap", "cuda-graph-path"])
def test_the_engine_serves_a_checkpoint_with_transformers_greedy_tokens(served, setting) -> None:
    from mlsys.engine import Engine, EngineConfig, SamplingParams
    from mlsys.engine.overlap import OverlapEngine

    model, prompts, expected = served
    if setting == "overlap":  # chapter 10: the next step's schedule while this one computes
        engine = OverlapEngine(model, config=EngineConfig(block_size=4))
    elif setting == "cuda-graph-path":  # chapter 10's static decode path (uncaptured on a CPU)
        engine = Engine(model, config=EngineConfig(block_size=4, cuda_graph_sizes=[1, 2, 4]))
    else:
        engine = Engine(model, config=EngineConfig(**ENGINE_SETTINGS[setting]))
    params = SamplingParams(max_tokens=17, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    if setting == "prefix-cache":
        outs = engine.generate(prompts, params)  # again: every prompt's shared blocks are now cached
        assert [o.token_ids for o in outs] == expected
        assert sum(o.metrics.num_cached_prompt_tokens for o in outs) >= 4 * 8
    if setting == "cuda-graph-path":
        assert engine.runner.num_graph_steps > 0  # decode steps went through the static buffers
    if setting == "preemption":
        assert engine.scheduler.num_preemptions > 0  # the tokens above came through recomputation
    if setting == "chunked-prefill":
        assert engine.counters["num_steps"] > 4 * 2  # prompts of 10..21 tokens in chunks of at most 7
    assert engine.block_manager.pool.num_available == engine.config.num_blocks  # nothing leaked


def test_the_kv_pool_is_sized_by_kv_heads(served) -> None:
    from mlsys.engine import Engine, EngineConfig

    model, _, _ = served
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=40))
    c = model.config
    assert engine.runner.k_cache.shape == (c.num_hidden_layers, 40, 4, c.num_key_value_heads, c.head_dim)
    assert engine.runner.kv_cache_bytes == 2 * c.num_hidden_layers * 40 * 4 * c.num_key_value_heads * c.head_dim * 4


# ------------------------------------------------------------------------ vLLM's interface
def byte_level_bpe(folder, vocab_size: int) -> None:
    """A small byte-level BPE trained on a few lines with `tokenizers`, saved as the folder's tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = ["the cat sat on the mat", "naïve café — déjà vu", "数据并行 and 张量并行", "emoji 🙂 and more 🙂"] * 20
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    tok.save(str(folder / "tokenizer.json"))


def test_llm_generate_with_a_folder_and_its_tokenizer(tmp_path) -> None:
    from tokenizers import Tokenizer

    from mlsys.engine import LLM, SamplingParams

    hf = build_with("qwen2-gqa", tmp_path, vocab_size=400)
    byte_level_bpe(tmp_path, 400)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    llm = LLM(model=str(tmp_path), block_size=4, enable_prefix_caching=True)
    prompts = ["the cat", "déjà", {"prompt_token_ids": [5, 6, 7]}]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else tok.encode(prompt).ids
        assert out.prompt_token_ids == ids and out.prompt == (None if isinstance(prompt, dict) else prompt)
        with torch.no_grad():
            x = torch.tensor([ids])
            expected = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                                   pad_token_id=0)[0, len(ids):].tolist()
        completion = out.outputs[0]
        assert completion.token_ids == expected and completion.finish_reason == "length"
        if "\ufffd" not in tok.decode(expected):  # random weights: the tokens may not be whole characters
            assert completion.text == tok.decode(expected)


def test_streamed_text_of_subword_tokens_is_the_text() -> None:
    """Byte-level BPE tokens may split a character (é, 数, 🙂 are 2 to 4 bytes): fed one token at a time, the
    incremental detokenizer holds text back until each character is whole, and the pieces add up to the text."""
    import tempfile
    from pathlib import Path

    from mlsys.engine.tokenizer import HFTokenizer, IncrementalDetokenizer

    with tempfile.TemporaryDirectory() as folder:
        byte_level_bpe(Path(folder), 300)
        tok = HFTokenizer(Path(folder) / "tokenizer.json", bos_id=0, eos_id=1)
    text = "naïve café, 数据并行 🙂 déjà"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some token really is part of a character
    detok, pieces = IncrementalDetokenizer(tok, [0]), []
    for i in ids:
        piece = detok.step([i])
        assert "\ufffd" not in piece
        pieces.append(piece)
    assert "".join(pieces) == text == detok.text


def test_llm_without_a_tokenizer_takes_token_ids_only(tmp_path) -> None:
    from mlsys.engine import LLM, SamplingParams

    build("llama-gqa", tmp_path)
    llm = LLM(model=str(tmp_path), block_size=8)
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="no tokenizer.json: give prompts as token ids"):
        llm.generate("text")
    with pytest.raises(CheckpointError, match="neither a book model"):
        LLM(model=str(tmp_path / "nowhere"))


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.timeout(120)
def test_chat_with_a_checkpoint_template_renders_as_transformers_does(tmp_path) -> None:
    """The server renders a checkpoint's chat template; transformers' apply_chat_template on the same tokenizer is
    the oracle for the prompt's token ids, and the answer is the engine's greedy completion of those ids."""
    import openai

    from mlsys.engine import LLM, SamplingParams
    from mlsys.server import ServerThread, create_app

    build_with("llama-gqa", tmp_path, vocab_size=300, bos_token_id=0, eos_token_id=1)
    byte_level_bpe(tmp_path, 300)  # "<s>" is id 0, "</s>" id 1
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat"}]
    oracle = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>",
                                                  eos_token="</s>", chat_template=CHAT_TEMPLATE)
    rendered = oracle.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
    llm = LLM(model=str(tmp_path), block_size=4)
    want = llm.generate({"prompt_token_ids": list(ids)}, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    with ServerThread(create_app(llm.engine, "tiny-chat", chat_template=CHAT_TEMPLATE)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8, temperature=0,
                                              logprobs=True, extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens == len(ids) and ids[0] == 0  # the template's <s>
    assert chat.choices[0].message.content == want.outputs[0].text
    # log-prob bytes are each token's raw bytes: joined, they are the bytes of the whole answer as `tokenizers`
    # decodes all its ids at once (a token alone may be half a character, which decoding it alone cannot show)
    ids_out = want.outputs[0].token_ids
    raw = b"".join(bytes(t.bytes) for t in chat.choices[0].logprobs.content) if chat.choices[0].logprobs else b""
    assert raw.decode("utf-8", "replace") == oracle.decode(ids_out) and len(chat.choices[0].logprobs.content) == 8


@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_tokenizer", [True, False], ids=["tokenizer", "ids-only"])
def test_serve_py_serves_a_checkpoint_folder(tmp_path, with_tokenizer) -> None:
    from conftest import run, scripts_dir

    build_with("qwen2-gqa", tmp_path / "tiny-qwen", vocab_size=300)
    if with_tokenizer:
        byte_level_bpe(tmp_path / "tiny-qwen", 300)
    out = tmp_path / "r.json"
    proc = run([scripts_dir(8) / "serve.py", "--model", tmp_path / "tiny-qwen", "--smoke", "--json", out],
               timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "serving tiny-qwen on http://127.0.0.1:" in proc.stdout
    result = json.loads(out.read_text())["results"]
    assert result["plain_text"] == result["expected_text"] and result["usage"]["completion_tokens"] == 8
    assert (result["expected_text"] != "") == with_tokenizer
    if with_tokenizer:
        bad = run([scripts_dir(8) / "serve.py", "--model", tmp_path / "nowhere"], timeout=60)
        assert bad.returncode == 2 and "neither 'small', 'draft' nor a checkpoint folder" in bad.stderr
        (tmp_path / "broken").mkdir()
        (tmp_path / "broken" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
        bad = run([scripts_dir(8) / "serve.py", "--model", tmp_path / "broken"], timeout=60)
        assert bad.returncode == 2 and "needs the field 'vocab_size'" in bad.stderr, bad.stderr[-1000:]
        assert "Traceback" not in bad.stderr


def test_every_eos_id_of_config_and_generation_config_stops_as_transformers_does(tmp_path) -> None:
    """A folder whose config.json lists two eos ids and whose generation_config.json names a third (Llama 3.1
    Instruct lists three): transformers' generate stops at whichever comes first, and so must the engine. The
    ids are chosen from the greedy continuation itself, so that each one really is generated."""
    from mlsys.engine import LLM, SamplingParams

    hf = build("llama-gqa", tmp_path)
    prompt = [5, 9, 17, 33]
    x = torch.tensor([prompt])
    with torch.no_grad():
        free = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    first_new = [t for i, t in enumerate(free) if t not in free[:i]]   # ids in order of first appearance
    assert len(first_new) >= 4, free
    in_config, in_generation = [first_new[3], 100], first_new[2]      # stop at the third distinct id's first place
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, eos_token_id=in_config)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": in_generation}))
    hf.generation_config.eos_token_id = [*in_config, in_generation]
    with torch.no_grad():
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert len(want) < len(free) and want[-1] == in_generation          # transformers stopped early, on it
    out = LLM(model=str(tmp_path), block_size=4).generate([{"prompt_token_ids": prompt}],
                                                          SamplingParams(max_tokens=16))[0].outputs[0]
    assert out.token_ids == want and out.finish_reason == "stop"


@pytest.mark.parametrize("damage, message", [
    ("tokenizer", "not a readable tokenizer.json"),
    ("generation-json", "generation_config.json: not valid JSON"),
    ("eos-type", "eos_token_id must be a token id or a list of them, got '2'"),
])
def test_a_broken_tokenizer_or_generation_config_is_one_line(tmp_path, damage, message) -> None:
    from mlsys.engine import LLM

    build("llama-gqa", tmp_path)
    if damage == "tokenizer":
        (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 42}')
    elif damage == "generation-json":
        (tmp_path / "generation_config.json").write_text("{oops")
    else:
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps(dict(config, eos_token_id="2")))
    with pytest.raises(CheckpointError) as err:
        LLM(model=str(tmp_path), block_size=4)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.timeout(120)
def test_a_folder_saved_by_transformers_chats_with_its_own_template_or_not_at_all(tmp_path) -> None:
    """transformers' save_pretrained writes the template to chat_template.jinja: the server must render it as
    apply_chat_template does (the oracle). The same folder without a template gets a 400 for chat, naming why,
    while completions still work: the book's template is never used for a folder's model."""
    import openai

    from mlsys.chat import NoChatTemplate, chat_template_for
    from mlsys.engine import LLM, SamplingParams
    from mlsys.server import ServerThread, create_app

    build_with("llama-gqa", tmp_path, vocab_size=300, bos_token_id=0, eos_token_id=1)
    byte_level_bpe(tmp_path, 300)
    saved = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>",
                                                 eos_token="</s>", chat_template=CHAT_TEMPLATE)
    saved.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    tpl_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "chat_template" not in tpl_config                       # the case the review found: only the .jinja
    messages = [{"role": "user", "content": "the cat sat"}]
    ids = list(transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    llm = LLM(model=str(tmp_path), block_size=4)
    want = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0]
    with ServerThread(create_app(llm.engine, "jinja", chat_template=chat_template_for(tmp_path))) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(model="jinja", messages=messages, max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens == len(ids) and chat.choices[0].message.content == want.text

    (tmp_path / "chat_template.jinja").unlink()
    refused = chat_template_for(tmp_path)
    assert isinstance(refused, NoChatTemplate)
    with ServerThread(create_app(llm.engine, "bare", chat_template=refused)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="bare", messages=messages, max_tokens=4)
        text = client.completions.create(model="bare", prompt="the cat", max_tokens=4, temperature=0)
    assert text.choices[0].text is not None and text.usage.completion_tokens >= 1


def test_the_kv_pool_is_sized_from_a_memory_budget_and_a_long_model_is_refused_naming_the_flags() -> None:
    """A Llama-3-8B-shaped config (32 layers, 8 K/V heads of 128, 131,072 positions), built on the meta device
    (no memory): one full-length fp32 sequence needs 2 x 32 x 8 x 128 x 4 bytes = 256 KiB per token, 32 GiB in
    all, more than the default 4 GiB budget, so the engine refuses it and says how many tokens would fit
    (4 GiB / 256 KiB = 16,384). With max_model_len 8,192 the pool takes as many blocks as the budget holds."""
    from mlsys.engine import EngineConfig
    from mlsys.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072)
    with torch.device("meta"):
        model = Llama(cfg)
    per_token = 2 * 32 * 8 * 128 * 4
    with pytest.raises(ValueError) as err:
        EngineConfig().resolve(model)
    message = str(err.value)
    assert "max_model_len" in message and "kv_cache_memory_bytes" in message and "\n" not in message
    assert f"at most {(4 << 30) // per_token} tokens fit" in message
    c = EngineConfig(max_model_len=8192).resolve(model)
    assert c.num_blocks == (4 << 30) // (per_token * 16)           # the budget, not 32 sequences of 8,192
    c = EngineConfig(max_model_len=8192, kv_cache_memory_bytes=1 << 40).resolve(model)
    assert c.num_blocks == 32 * 8192 // 16                         # a budget that holds all 32 sequences
    with pytest.raises(ValueError, match="lower max_model_len"):
        EngineConfig(max_model_len=8192, kv_cache_memory_bytes=per_token * 8191).resolve(model)


def test_logprob_bytes_are_each_tokens_raw_bytes(tmp_path) -> None:
    """A byte-level BPE splits é, 数 and 🙂 across tokens: a token decoded alone shows U+FFFD, so its log-prob
    `bytes` must come from the token itself. Oracle: the text's own UTF-8, which the tokens' bytes must spell
    out exactly, one non-empty piece per token (the decode of one token would put EF BF BD in their place)."""
    from mlsys.engine.request import RequestMetrics, RequestOutput
    from mlsys.engine.tokenizer import HFTokenizer
    from mlsys.protocol import logprobs_of

    byte_level_bpe(tmp_path, 300)
    tok = HFTokenizer(tmp_path / "tokenizer.json", bos_id=0, eos_id=1)
    text = "naïve café, 数据并行 🙂 déjà"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)          # some token really is part of a character
    out = RequestOutput("r", [0], ids, ids, text, text, True, "length", RequestMetrics(0.0),
                        logprobs=[-1.0] * len(ids))
    got = [bytes(entry["bytes"]) for entry in logprobs_of(out, tok, chat=True)["content"]]
    assert b"".join(got) == text.encode("utf-8") and all(got)


@pytest.mark.parametrize("adds_bos", [True, False], ids=["llama-style", "qwen2-style"])
def test_a_completions_prompt_gets_bos_only_when_the_tokenizer_adds_it(tmp_path, adds_bos) -> None:
    """A Llama tokenizer's post-processor puts <s> in front of every text, Qwen2's adds nothing: the engine
    encodes a text prompt as transformers' tokenizer does (the oracle), instead of always prepending BOS."""
    from tokenizers import Tokenizer, processors

    from mlsys.engine import LLM, SamplingParams

    build_with("llama-gqa", tmp_path, vocab_size=300, bos_token_id=0, eos_token_id=1)
    byte_level_bpe(tmp_path, 300)
    if adds_bos:
        tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
        tok.save(str(tmp_path / "tokenizer.json"))
    want = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))("the cat")
    out = LLM(model=str(tmp_path), block_size=4).generate("the cat", SamplingParams(max_tokens=2))[0]
    assert out.prompt_token_ids == list(want["input_ids"]) and (out.prompt_token_ids[0] == 0) == adds_bos


@pytest.mark.timeout(120)
def test_structured_output_is_refused_for_a_folder_with_a_bpe_tokenizer_or_none(tmp_path) -> None:
    """Chapter 11's automaton steps over the book's one-character tokens: a checkpoint folder, with a BPE
    tokenizer.json or with none, cannot compile a schema (the server answers that ValueError with a 400), as
    chapters 8 and 11 say; the book's own model can."""
    from mlsys.engine import LLM

    build_with("llama-gqa", tmp_path / "bpe", vocab_size=300, bos_token_id=0, eos_token_id=1)
    byte_level_bpe(tmp_path / "bpe", 300)
    build("llama-gqa", tmp_path / "ids")
    for folder in ("bpe", "ids"):
        llm = LLM(model=str(tmp_path / folder), block_size=4)
        with pytest.raises(ValueError, match="needs the book's character tokenizer"):
            llm.engine.compile_schema({"type": "object"})
    assert LLM(model="draft").engine.compile_schema({"type": "object"}).min_length > 0


@pytest.mark.timeout(120)
def test_generation_config_sets_the_sampling_defaults_of_requests_that_leave_them_out(tmp_path) -> None:
    """vLLM reads a folder's generation_config.json for the sampling defaults of a request that names none: here
    temperature 0.7 and top_k 5. Oracle: the engine sampling with exactly those values and the request's seed; a
    request that names its own temperature keeps it (greedy here: the engine's greedy tokens)."""
    import openai

    from mlsys.engine import LLM, SamplingParams
    from mlsys.engine.llm import generation_defaults
    from mlsys.server import ServerThread, create_app

    build_with("llama-gqa", tmp_path, vocab_size=300)
    byte_level_bpe(tmp_path, 300)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7,
                                                                 "top_k": 5, "top_p": "high"}))
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.7, "top_k": 5}   # a bad field is left out
    llm = LLM(model=str(tmp_path), block_size=4)
    sampled = llm.generate("the cat", SamplingParams(max_tokens=10, temperature=0.7, top_k=5, seed=11,
                                                     ignore_eos=True))[0].outputs[0].text
    greedy = llm.generate("the cat", SamplingParams(max_tokens=10, ignore_eos=True))[0].outputs[0].text
    assert sampled != greedy                     # the two requests below can tell the defaults apart
    app = create_app(llm.engine, "gen", sampling_defaults=generation_defaults(str(tmp_path)))
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        common = dict(model="gen", prompt="the cat", max_tokens=10, extra_body={"ignore_eos": True})
        assert client.completions.create(seed=11, **common).choices[0].text == sampled
        assert client.completions.create(temperature=0, **common).choices[0].text == greedy
    assert llm.default_sampling_params.temperature == 0.7 and llm.default_sampling_params.top_k == 5
