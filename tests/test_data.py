"""The synthetic corpus, its tokenizer, batching and data-parallel sharding.

    PYTHONPATH=. .venv/bin/python -m pytest tests/test_data.py -q     # ~1 s
"""

import pytest
import torch

from mlsys.data import (
    Tokenizer,
    get_batch,
    is_consistent_record,
    is_valid_record,
    load_splits,
    make_corpus,
    shard,
)

GOOD = '{"name": "ada", "age": 34, "city": "london", "langs": ["c", "go"]}'


def test_corpus_is_deterministic_per_seed():
    assert make_corpus(200, seed=3) == make_corpus(200, seed=3)
    assert make_corpus(200, seed=3) != make_corpus(200, seed=4)
    assert make_corpus(10, seed=0).count("\n") == 10


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_generated_record_is_valid_and_consistent(seed):
    lines = make_corpus(500, seed).splitlines()
    assert all(is_valid_record(line) for line in lines)
    assert all(is_consistent_record(line) for line in lines)


@pytest.mark.parametrize(
    "line",
    [
        GOOD[:-1],  # truncated
        GOOD.replace('"age": 34', '"age": "34"'),  # age is a string
        GOOD.replace('"age": 34', '"age": true'),  # bool is not an int here
        GOOD.replace('"age": 34', '"age": 3'),  # outside 10..99
        GOOD.replace("ada", "bob"),  # unknown name
        GOOD.replace("london", "paris"),  # unknown city
        GOOD.replace('["c", "go"]', "[]"),  # no langs
        GOOD.replace('["c", "go"]', '["c", "c"]'),  # repeated lang
        GOOD.replace('["c", "go"]', '["c", "go", "lua", "ml"]'),  # too many
        '{"age": 34, "name": "ada", "city": "london", "langs": ["c"]}',  # key order
        GOOD[:-1] + ', "x": 1}',  # extra key
        "[1, 2]",
        "",
    ],
)
def test_is_valid_record_rejects_schema_errors(line):
    assert not is_valid_record(line)


def test_consistency_checks_the_learned_facts():
    assert is_valid_record(GOOD) and is_consistent_record(GOOD)
    for bad in [
        GOOD.replace("london", "boston"),  # ada lives in london
        GOOD.replace("34", "54"),  # ada's ages are in the 30s
        GOOD.replace('["c", "go"]', '["go", "c"]'),  # langs are sorted
    ]:
        assert is_valid_record(bad) and not is_consistent_record(bad)


def test_tokenizer_round_trip_and_stable_ids():
    tok = Tokenizer()
    assert tok.vocab_size == 47
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.encode('{"a0') == [9, 4, 21, 11]  # pinned: checkpoints depend on these ids
    for line in make_corpus(50, seed=0).splitlines():
        ids = tok.encode(line, bos=True, eos=True)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert tok.decode(ids) == line
        assert tok.decode(torch.tensor(ids)) == line
    assert tok.decode([1, 21, 2], skip_special=False) == "<bos>a<eos>"
    with pytest.raises(ValueError, match="alphabet"):
        tok.encode("Ada")


def test_encode_corpus_frames_each_record():
    tok = Tokenizer()
    text = make_corpus(5, seed=0)
    stream = tok.encode_corpus(text)
    assert (stream == tok.bos_id).sum() == 5 and (stream == tok.eos_id).sum() == 5
    records = tok.decode(stream, skip_special=False).replace("<bos>", "").split("<eos>")
    assert records[:-1] == text.splitlines()


def test_splits_and_batches():
    train, val = load_splits(num_records=200, seed=0)
    assert train.dtype == val.dtype == torch.long
    assert len(train) > 8 * len(val) > 0
    x, y = get_batch(train, 4, 32, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted left by one
    x2, _ = get_batch(train, 4, 32, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)  # the generator alone decides the batch
    with pytest.raises(ValueError):
        get_batch(train[:10], 1, 32)


@pytest.mark.parametrize("n", [0, 1, 7, 100, 103])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_shards_cover_every_token_once(n, world_size):
    tokens = torch.arange(n)
    shards = [shard(tokens, r, world_size) for r in range(world_size)]
    assert torch.equal(torch.cat(shards), tokens)  # contiguous, in order, no gaps or overlaps
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        shard(tokens, world_size, world_size)
