"""mlsys.engine.scheduler on hand-worked steps: the token budget split between running and waiting sequences
(chunked prefill), the seat limit, preemption of the newest running sequence when blocks run out (its blocks
freed, its computed tokens reset, first in line again), and static batching. Every expected number is worked out
by hand in the comments from the rules in the module docstring (vLLM v1 style)."""

from __future__ import annotations

import pytest

from mlsys.engine.block_manager import BlockManager
from mlsys.engine.request import SamplingParams, Sequence, SequenceStatus
from mlsys.engine.scheduler import Scheduler


def make(name: str, prompt_len: int) -> Sequence:
    return Sequence(name, list(range(1, prompt_len + 1)), SamplingParams())


def run_step(out) -> None:
    """What the engine does after a step: the scheduled tokens are now computed; a finished prefill samples one."""
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(7)


def test_budget_is_split_oldest_first_with_chunked_prefill() -> None:
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b, c = make("a", 8), make("b", 6), make("c", 3)
    for q in (a, b, c):
        s.add(q)
    out = s.schedule()  # a takes 8 of 10, b the remaining 2 (a chunk of its 6), c gets nothing (budget 0)
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 8), ("b", 2)]
    assert out.num_batched_tokens == 10 and out.num_prefill_tokens == 10 and out.preempted == []
    assert s.running == [a, b] and list(s.waiting) == [c] and a.status == SequenceStatus.RUNNING
    assert len(a.block_table) == 2 and len(b.block_table) == 1  # ceil(8/4), ceil(2/4)
    run_step(out)
    out = s.schedule()  # a decodes 1, b finishes its prompt with 4, c prefills 3: 8 of 10
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 1), ("b", 4), ("c", 3)]
    assert out.num_batched_tokens == 8 and out.num_prefill_tokens == 7  # a's one token is a decode
    run_step(out)
    s.finish(b)
    assert s.running == [a, c] and b.block_table == []
    s.finish(c)
    assert s.running == [a]


def test_seat_limit_and_fork_seats() -> None:
    s = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    a, b, c = make("a", 3), make("b", 3), make("c", 3)
    for q in (a, b, c):
        s.add(q)
    out = s.schedule()
    assert [q.request_id for q, _ in out.scheduled] == ["a", "b"] and list(s.waiting) == [c]
    s2 = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    d, e = make("d", 3), make("e", 3)
    d.forks = [make("d1", 3)]  # n=2: d needs two seats
    s2.add(e)
    s2.add(d)
    out = s2.schedule()  # e takes one seat; d needs 2 more of the 1 left
    assert [q.request_id for q, _ in out.scheduled] == ["e"] and list(s2.waiting) == [d]


def test_the_newest_running_sequence_is_preempted_and_goes_first_in_line() -> None:
    bm = BlockManager(4, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = make("a", 8), make("b", 8), make("c", 2)
    for q in (a, b, c):
        s.add(q)
    out = s.schedule()  # a and b take 2 blocks each: the pool of 4 is full, c cannot be admitted
    assert [q.request_id for q, _ in out.scheduled] == ["a", "b"] and list(s.waiting) == [c]
    assert c.num_computed_tokens == 0 and c.block_table == []
    run_step(out)  # both wrote 8 tokens and sampled one: the 9th position needs a third block each
    out = s.schedule()  # a needs a block: b (newest) is preempted and freed; a gets it; nobody is admitted
    assert out.preempted == [b] and [(q.request_id, n) for q, n in out.scheduled] == [("a", 1)]
    assert b.num_computed_tokens == 0 and b.block_table == [] and b.status == SequenceStatus.WAITING
    assert list(s.waiting) == [b, c] and s.running == [a]
    assert s.num_preemptions == 1 and b.metrics.num_preemptions == 1
    assert bm.pool.num_free == 1 and len(a.block_table) == 3
    bm.check_invariants([a])
    # the victim keeps its tokens: re-admitted, it prefills prompt + output (9) in one go
    s.finish(a)
    out = s.schedule()
    assert [(q.request_id, n) for q, n in out.scheduled] == [("b", 9), ("c", 2)]


def test_a_sequence_that_cannot_get_its_blocks_preempts_itself() -> None:
    bm = BlockManager(2, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a = make("a", 8)
    s.add(a)
    run_step(s.schedule())  # 8 tokens fill both blocks; the 9th needs a third, which does not exist
    out = s.schedule()
    assert out.preempted == [a] and out.scheduled == [] and s.running == [] and list(s.waiting) == [a]
    assert bm.pool.num_free == 2 and out.num_batched_tokens == 0


def test_static_batching_admits_only_into_an_empty_engine() -> None:
    s = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100, scheduling="static")
    a, b, c = make("a", 3), make("b", 3), make("c", 3)
    for q in (a, b):
        s.add(q)
    run_step(s.schedule())
    s.add(c)
    s.finish(a)  # a seat is free, but b still runs: static batching waits for the whole batch
    out = s.schedule()
    assert [q.request_id for q, _ in out.scheduled] == ["b"] and list(s.waiting) == [c]
    s.finish(b)
    assert [q.request_id for q, _ in s.schedule().scheduled] == ["c"]
    with pytest.raises(ValueError, match="'continuous' or 'static'.*'fifo'"):
        Scheduler(BlockManager(4, 4), 1, 1, scheduling="fifo")


def test_the_budget_is_spent_to_its_last_token_and_not_beyond() -> None:
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=3)
    a, b, c = make("a", 1), make("b", 1), make("c", 1)
    for q in (a, b, c):
        s.add(q)
    run_step(s.schedule())  # three one-token prompts fill the budget of 3 exactly
    d = make("d", 5)
    s.add(d)
    s.finish(c)
    out = s.schedule()  # a and b decode (2 of 3): the last token of budget goes to d, a chunk of one
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 1), ("b", 1), ("d", 1)]
    run_step(out)
    s.add(make("e", 2))
    out = s.schedule()  # a, b, d take all 3: e is not admitted, and nothing is scheduled with 0 tokens
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 1), ("b", 1), ("d", 1)]
    assert [q.request_id for q in s.waiting] == ["e"]


def test_a_one_token_prompt_chunk_is_prefill_not_decode() -> None:
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=4)
    a = make("a", 5)
    s.add(a)
    run_step(s.schedule())  # 4 of a's 5 prompt tokens
    out = s.schedule()  # its last prompt token: one token, but prefill (nothing sampled yet)
    assert out.scheduled == [(a, 1)] and out.num_prefill_tokens == 1
    run_step(out)
    assert s.schedule().num_prefill_tokens == 0  # now one token after a sampled one: a decode


def test_prefix_lookups_count_every_admitted_prompt_token() -> None:
    bm = BlockManager(100, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    for name, n in (("a", 6), ("b", 3)):
        s.add(make(name, n))
    s.schedule()
    assert bm.prefix_query_tokens == 6 + 3


def test_running_sequences_past_the_budget_are_not_scheduled_at_all() -> None:
    """Static batching admits a whole batch whatever the budget: with a budget of 4 and three prompts of 5, a
    prefills 4; next step a's last token and 3 of b's exhaust the budget, and c is left out (not scheduled with 0)."""
    s = Scheduler(BlockManager(100, 4), max_num_seqs=3, max_num_batched_tokens=4, scheduling="static")
    a, b, c = make("a", 5), make("b", 5), make("c", 5)
    for q in (a, b, c):
        s.add(q)
    out = s.schedule()
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 4)] and s.running == [a, b, c]
    run_step(out)
    out = s.schedule()
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 1), ("b", 3)]
