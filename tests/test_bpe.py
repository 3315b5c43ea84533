"""The book's byte-level BPE (mlsys/bpe.py) and incremental detokenization of its tokens.

Oracles: the text itself (round trips), transformers' PreTrainedTokenizerFast.decode of all ids at once and the
tokenizers library's own streaming decoder (DecodeStream), both independent of mlsys.engine.tokenizer; UTF-8
byte counts for the demo line of chapter 8's detokenize.py. The chat path runs a random-init Llama checkpoint
folder that carries the BPE as its tokenizer through mlsys.engine.LLM and the HTTP server.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from conftest import load_script, scripts_dir  # noqa: E402
from mlsys.bpe import NUM_RECORDS, VOCAB_SIZE, bpe_path, build_bpe, load_bpe, train_bpe  # noqa: E402
from mlsys.data import SPECIALS, make_corpus  # noqa: E402
from mlsys.engine.tokenizer import IncrementalDetokenizer  # noqa: E402

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


def no_specials(s: str) -> bool:  # ("<eos>" in a text encodes as the special token, as in transformers)
    return not any(t in s for t in SPECIALS)


TEXT = st.text(max_size=40).filter(no_specials)  # any code point but surrogates (no UTF-8 for those)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(tokenizer.json path, HFTokenizer, transformers' tokenizer on the same file)."""
    path = build_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json")
    oracle = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<bos>", eos_token="<eos>",
                                                  pad_token="<pad>")
    return path, load_bpe(path), oracle


def hf_decode(oracle, ids: list[int]) -> str:
    return oracle.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def streamed(tok, ids: list[int], context=None) -> list[str]:
    detok = IncrementalDetokenizer(tok, [tok.bos_id] if context is None else context)
    return [detok.step([i]) for i in ids]


def decode_stream(tok, ids: list[int]) -> list[str]:
    from tokenizers.decoders import DecodeStream

    ds = DecodeStream(skip_special_tokens=True)
    ds.step(tok.tok, tok.bos_id)
    return [ds.step(tok.tok, i) or "" for i in ids]


# ------------------------------------------------------------------ the tokenizer


def test_load_bpe_builds_the_cached_file_with_the_book_specials(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MLSYS_CACHE", str(tmp_path))
    assert bpe_path() == tmp_path / "weights" / "bpe" / "tokenizer.json" and not bpe_path().exists()
    tok = load_bpe()
    assert bpe_path().exists()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)  # as mlsys.data.Tokenizer numbers them
    assert [tok.token_text(i) for i in (0, 1, 2)] == list(SPECIALS)
    assert 259 < tok.vocab_size <= VOCAB_SIZE  # 3 specials + 256 bytes + merges
    assert tok.encode("ada", bos=True, eos=True)[0] == 1 and tok.encode("ada", eos=True)[-1] == 2


def test_training_is_deterministic(tmp_path) -> None:
    a, b = build_bpe(tmp_path / "a.json"), build_bpe(tmp_path / "b.json")
    assert a.read_bytes() == b.read_bytes()
    assert train_bpe(seed=1).to_str() == train_bpe(seed=1).to_str()


def test_round_trips_the_corpus_with_multi_character_tokens(files) -> None:
    _, tok, _ = files
    corpus = make_corpus(NUM_RECORDS // 4, seed=7)  # records the tokenizer was not trained on
    ids = tok.encode(corpus)
    assert tok.decode(ids) == corpus
    assert len(ids) < len(corpus) / 2  # merges work: well over two characters per token
    assert tok.encode('{"name": "ada"') == [tok.tok.token_to_id(t) for t in ['{"', "name", '":', 'Ġ"', "ada", '"']]


@FUZZ
@given(text=TEXT)
def test_round_trips_any_unicode(files, text) -> None:
    _, tok, oracle = files
    ids = tok.encode(text)
    assert tok.decode(ids) == text == hf_decode(oracle, ids)
    assert ids == oracle.encode(text, add_special_tokens=False)


def test_a_character_the_corpus_never_showed_falls_back_to_bytes(files) -> None:
    _, tok, _ = files
    for ch in "é数🐍":
        ids = tok.encode(ch)
        assert len(ids) == len(ch.encode())  # one token per UTF-8 byte
        assert all(tok.decode([i]) == "\ufffd" for i in ids)  # each alone is part of a character


# ------------------------------------------------------------------ incremental detokenization


@FUZZ
@given(text=st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=40).filter(no_specials))
def test_streamed_text_equals_transformers_decode(files, text) -> None:
    _, tok, oracle = files
    ids = tok.encode(text)
    pieces = streamed(tok, ids)
    assert "".join(pieces) == hf_decode(oracle, ids) == text
    assert pieces == decode_stream(tok, ids)  # the tokenizers library's streaming decoder, step for step


@FUZZ
@given(data=st.data())
def test_random_ids_stream_like_decode_stream(files, data) -> None:
    """What a random model samples: ids that need not form valid UTF-8 (lone continuation bytes, a lead byte
    followed by ASCII). Each step releases what DecodeStream releases, and the pieces add up to decode(all ids)
    unless the ids end inside a character (then both streams still hold that tail back)."""
    _, tok, oracle = files
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    pieces, whole = streamed(tok, ids), hf_decode(oracle, ids)
    assert pieces == decode_stream(tok, ids)
    if not whole.endswith("\ufffd"):
        assert "".join(pieces) == whole
    else:
        assert whole.startswith("".join(pieces))


def test_a_text_ending_in_a_real_replacement_character_is_held_back_like_decode_stream(files) -> None:
    """U+FFFD is also what an incomplete character decodes to, so a stream cannot tell a real one at the very end
    from half a character: both streaming decoders hold it back (a known limit of the technique)."""
    _, tok, _ = files
    ids = tok.encode("ok \ufffd")
    assert "".join(streamed(tok, ids)) == "".join(decode_stream(tok, ids)) == "ok "
    ids = tok.encode("ok \ufffd!")
    assert "".join(streamed(tok, ids)) == "ok \ufffd!"  # released as soon as anything follows


def test_detokenize_demo_line_counts_bytes(files) -> None:
    """detokenize.py's counts on its unicode line, against UTF-8 itself: each character outside the corpus is one
    token per byte, every one of them partial, and the stream waits len(bytes) - 1 steps per such character."""
    _, tok, _ = files
    script = load_script(scripts_dir(8) / "detokenize.py")
    text = script.UNICODE_TEXT
    result = script.analyse(tok, "unicode", text)
    row, foreign = result["row"], [c for c in text if ord(c) > 127]
    assert row["multi_char_tokens"] >= 1 and row["partial_tokens"] >= 1
    assert row["partial_tokens"] == sum(len(c.encode()) for c in foreign)
    assert row["held_back_steps"] == sum(len(c.encode()) - 1 for c in foreign)
    one_by_one = "".join(tok.decode([i]) for i in result["ids"])  # each token decoded alone, here, not the script's
    assert one_by_one != text and "\ufffd" in one_by_one
    assert "".join(result["pieces"]) == text
    # the bytes column: GPT-2's symbol map is the library's byte alphabet, and the bytes add up to the text
    from tokenizers import pre_tokenizers

    symbols = script.byte_symbols()
    assert sorted(symbols.values()) == list(range(256))
    assert set(symbols) == set(pre_tokenizers.ByteLevel.alphabet())
    assert b"".join(script.token_bytes(tok, i, symbols) for i in result["ids"]) == text.encode()


# ------------------------------------------------------------------ a checkpoint folder that uses it

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPTS = ['{"name": "ada", ', "naïve café: ", "日本語 🐍 "]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, files):
    """A random-init Llama saved by transformers, with the BPE as its tokenizer and a chat template."""
    path, tok, _ = files
    out = tmp_path_factory.mktemp("tiny-bpe-llama")
    config = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    shutil.copy(path, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))
    return out


@pytest.fixture(scope="module")
def llm(folder):
    from mlsys.engine import LLM

    return LLM(model=str(folder), block_size=8)


def generated(llm, prompts=PROMPTS, max_tokens: int = 24):
    from mlsys.engine import SamplingParams

    return [o.outputs[0] for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]


def cut_inside_a_character(llm, oracle) -> tuple[str, int]:
    """(prompt, k): the engine's greedy ids for the prompt, stopped after k tokens, end inside a character. Found
    from one longer greedy run (greedy ids for max_tokens=k are the first k of a longer run)."""
    for prompt, out in zip(PROMPTS, generated(llm)):
        for k in range(len(out.token_ids), 0, -1):
            if hf_decode(oracle, out.token_ids[:k]).endswith("\ufffd"):
                return prompt, k
    raise AssertionError("no greedy run passes through a partial character")


@pytest.mark.timeout(120)
def test_llm_text_is_transformers_decode_of_its_ids(llm, files) -> None:
    """The engine's text, built piece by piece by its detokenizer, equals decoding all generated ids at once; a
    random model's ids are bytes in any order, so the stream passes through partial characters."""
    _, _, oracle = files
    assert llm.get_tokenizer().encode(PROMPTS[0]) == oracle.encode(PROMPTS[0], add_special_tokens=False)
    partial = 0
    for out in generated(llm):
        whole = hf_decode(oracle, out.token_ids)
        partial += sum(oracle.decode([i]).endswith("\ufffd") for i in out.token_ids)
        assert out.text == whole  # also when the ids end inside a character: the next test makes sure of one
    assert partial > 0  # the hard case was exercised


@pytest.mark.timeout(120)
def test_a_request_that_ends_inside_a_character_keeps_its_tail(llm, files) -> None:
    """max_tokens cuts the answer inside a character: the bytes held back are released at the finish (as U+FFFD,
    as decoding all the ids shows them), not lost."""
    _, _, oracle = files
    prompt, k = cut_inside_a_character(llm, oracle)
    (out,) = generated(llm, [prompt], k)
    whole = hf_decode(oracle, out.token_ids)
    assert whole.endswith("\ufffd") and out.text == whole


@pytest.mark.timeout(120)
def test_chat_stream_adds_up_to_the_plain_answer(folder, llm) -> None:
    """/v1/chat/completions on the folder: the prompt is the template rendered as transformers renders it, and the
    streamed deltas, concatenated, are the non-streamed content."""
    import openai

    from mlsys.chat import template_of
    from mlsys.engine import SamplingParams
    from mlsys.server import ServerThread, create_app

    oracle = transformers.AutoTokenizer.from_pretrained(str(folder))  # the folder as transformers reads it
    assert oracle.chat_template == template_of(folder) == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "naïve café 🐍"}]
    rendered = oracle.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert ids[0] == 1  # the template's <bos> is the special token, not five characters
    want = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=16, ignore_eos=True))[0].outputs[0]
    with ServerThread(create_app(llm.engine, "tiny-bpe", chat_template=template_of(folder))) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        ask = dict(model="tiny-bpe", messages=messages, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        plain = client.chat.completions.create(**ask)
        chunks = list(client.chat.completions.create(**ask, stream=True))
    content = plain.choices[0].message.content
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert plain.usage.prompt_tokens == len(ids)
    assert "".join(deltas) == content == want.text
    # a delta never ends inside a character, except the last one when max_tokens cut a character short
    assert not any(d.endswith("\ufffd") for d in deltas[:-1])


@pytest.mark.timeout(120)
def test_a_prompt_with_a_lone_surrogate_is_a_400(llm) -> None:
    import httpx

    from mlsys.server import ServerThread, create_app

    bodies = {"/v1/completions": '{"model": "t", "prompt": "ab\\ud800", "max_tokens": 4}',
              "/v1/chat/completions": '{"model": "t", "messages": [{"role": "user", "content": "x\\udc00"}], '
                                      '"max_tokens": 4}'}
    with ServerThread(create_app(llm.engine, "t")) as server:
        codes = [httpx.post(server.url + path, content=body, headers={"content-type": "application/json"},
                            timeout=30).status_code for path, body in bodies.items()]
    assert codes == [400, 400]
