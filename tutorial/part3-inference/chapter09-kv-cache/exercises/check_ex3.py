"""Checker for ch09.3 — hits without eviction against the engine's own prefix cache (mlsys.engine, random-init
tiny GPT), hits with eviction against a brute-force replay kept as a list, and the LRU-vs-FIFO measurement."""

from __future__ import annotations

import random

from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.exercises import task
from mlsys.model import GPT, GPTConfig


def workload(seed: int, n: int, hot_len: int = 12) -> list[list[int]]:
    """Every other prompt starts with one hot system prompt; the others share shorter, colder prefixes."""
    rng = random.Random(seed)
    hot = [rng.randrange(3, 40) for _ in range(hot_len)]
    cold = [[rng.randrange(3, 40) for _ in range(8)] for _ in range(3)]
    out = []
    for i in range(n):
        head = hot if i % 2 == 0 else rng.choice(cold) + [rng.randrange(3, 40) for _ in range(rng.randint(0, 9))]
        out.append(head + [rng.randrange(3, 40) for _ in range(rng.randint(1, 9))])
    return out


def engine_hits(prompts: list[list[int]], block_size: int) -> list[int]:
    engine = Engine(GPT(GPTConfig.preset("tiny")), config=EngineConfig(
        block_size=block_size, num_blocks=512, max_num_seqs=1, enable_prefix_caching=True))
    return [engine.generate([p], SamplingParams(max_tokens=1))[0].metrics.num_cached_prompt_tokens for p in prompts]


def replay(prompts: list[list[int]], bs: int, capacity: int, policy: str) -> list[int]:
    """Brute force: the cache as a list of [key, time] rows, scanned in full every time."""
    rows: list[list] = []
    out = []
    for now, p in enumerate(prompts):
        keys = [tuple(p[:e]) for e in range(bs, len(p) + 1, bs)]
        cached = {tuple(r[0]) for r in rows}
        n = 0
        for key in keys[: (len(p) - 1) // bs]:
            if key not in cached:
                break
            n += 1
        out.append(n * bs)
        for key in keys:
            row = next((r for r in rows if r[0] == key), None)
            if row is None:
                rows.append([key, now])
            elif policy == "lru":
                row[1] = now
        while len(rows) > capacity:
            rows.sort(key=lambda r: (r[1], -len(r[0])))
            rows.pop(0)
    return out


@task("block_keys: one key per full block, each the whole prefix up to the block's end")
def check_keys(ex) -> None:
    got = [tuple(k) for k in ex.block_keys([5, 6, 7, 8, 9, 10, 11], 3)]
    assert got == [(5, 6, 7), (5, 6, 7, 8, 9, 10)], f"block_keys([5..11], 3) = {got}, want [(5, 6, 7), (5, ..., 10)]"
    assert list(ex.block_keys([1, 2], 4)) == [], "a prompt shorter than a block has no full block"


@task("without eviction, cache_hits equals the tokens the engine's radix cache reuses (block sizes 1, 4, 8)")
def check_engine(ex) -> None:
    prompts = workload(0, 12)
    prompts += [prompts[0][:8], prompts[0][:9], prompts[2] + [7, 7, 7, 7], prompts[3]]  # block edges, full hits
    for bs in (1, 4, 8):
        want = engine_hits(prompts, bs)
        got = list(ex.cache_hits(prompts, bs))
        bad = [i for i in range(len(want)) if got[i] != want[i]]
        assert not bad, (f"block_size {bs}: prompt {bad[0]} (length {len(prompts[bad[0]])}) reuses {got[bad[0]]} "
                         f"tokens, the engine {want[bad[0]]}")


@task("with a capacity, LRU and FIFO equal a brute-force replay of the rules")
def check_eviction(ex) -> None:
    for seed in range(3):
        prompts = workload(seed, 30)
        for policy in ("lru", "fifo"):
            for capacity in (3, 5, 8, 20):
                want = replay(prompts, 4, capacity, policy)
                got = list(ex.cache_hits(prompts, 4, capacity, policy))
                assert got == want, (f"seed {seed}, {policy}, capacity {capacity}: hits {got[:12]}..., "
                                     f"want {want[:12]}...")


@task("measured: with a hot system prompt and a small cache, LRU reuses clearly more tokens than FIFO")
def check_measure(ex) -> None:
    prompts = workload(5, 60)
    lru = sum(ex.cache_hits(prompts, 4, 6, "lru"))
    fifo = sum(ex.cache_hits(prompts, 4, 6, "fifo"))
    unlimited = sum(ex.cache_hits(prompts, 4))
    assert fifo < lru <= unlimited, f"hit tokens: fifo {fifo}, lru {lru}, unlimited {unlimited}"
    assert lru >= 1.3 * fifo, f"LRU {lru} vs FIFO {fifo}: the hot prefix should survive under LRU"
