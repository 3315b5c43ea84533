"""mlsys.json_constrained's schema cache and size estimates, in the test's own process (mutation testing).

The chapter tests compile schemas and decode; the cache a server puts in front of the compiler (`SchemaCache`:
one compile per schema, refusals remembered, bounded in bytes, least recently used out, at most `max_compiling`
compiles at once, optionally in worker processes) was only exercised by the server tests, which mutation testing
does not run. Here each rule is checked against what it promises, counted by hand: which `get` calls compile
(`compiles`), which return the very object of an earlier call, which raise. Compiles that must stay in flight
are held by a stand-in for SchemaFSM that waits on an event; the worker-process pool is a stand-in executor that
runs each job in this process (with concurrent.futures' own Future), so no process is started.

Sizes: `SchemaFSM.nbytes` against tracemalloc (what the automaton really holds), `estimated_size` against the
states and edges `build` really makes.
"""

from __future__ import annotations

import concurrent.futures
import gc
import pickle
import threading
import tracemalloc
from concurrent.futures.process import BrokenProcessPool

import pytest

from mlsys import json_constrained as jc
from mlsys.data import ALPHABET, SPECIALS, Tokenizer

BOOL, NULL = {"type": "boolean"}, {"type": "null"}
EMPTY_RANGE = {"type": "integer", "minimum": 7, "maximum": 3}  # refused: no integer is in 7..3


class ReversedTokenizer(Tokenizer):
    """The book's tokenizer with the alphabet's ids in reverse order: tables built with it differ from the default's."""

    def __init__(self) -> None:
        super().__init__()
        self.itos = list(SPECIALS) + list(reversed(ALPHABET))
        self.stoi = {s: i for i, s in enumerate(self.itos)}


def nested_arrays(depth: int) -> dict:
    schema: dict = NULL
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    return schema


# ------------------------------------------------------------------------------------------ one compile per schema
def test_the_same_schema_compiles_once_whatever_its_key_order() -> None:
    cache = jc.SchemaCache()
    assert cache.compiles == 0 and cache.nbytes == 0
    a = cache.get({"type": "string", "maxLength": 2})
    b = cache.get({"maxLength": 2, "type": "string"})  # the same schema, keys in another order
    assert b is a and cache.compiles == 1
    assert a.accepts_text('"ab"') and not a.accepts_text('"abc"')
    c = cache.get(BOOL)
    assert c is not a and cache.compiles == 2
    assert cache.nbytes == a.nbytes() + c.nbytes()  # every automaton held, counted once


def test_a_refusal_is_remembered_with_its_message() -> None:
    cache = jc.SchemaCache()
    with pytest.raises(jc.SchemaError) as first:
        cache.get(EMPTY_RANGE)
    assert "lower bound 7 is above the upper bound 3" in str(first.value)
    with pytest.raises(jc.SchemaError) as second:
        cache.get(dict(reversed(EMPTY_RANGE.items())))
    assert str(second.value) == str(first.value) and cache.compiles == 1  # not compiled again
    assert cache.get(BOOL).accepts_text("true") and cache.compiles == 2
    assert cache.nbytes == cache.get(BOOL).nbytes()  # a refusal holds no automaton


def test_only_the_newest_refusals_are_remembered() -> None:
    cache = jc.SchemaCache(max_refusals=2)
    bad = [dict(EMPTY_RANGE, title=str(i)) for i in range(3)]
    for schema in bad:
        with pytest.raises(jc.SchemaError):
            cache.get(schema)
    assert cache.compiles == 3
    for schema in (bad[2], bad[1]):  # the two newest: remembered
        with pytest.raises(jc.SchemaError):
            cache.get(schema)
    assert cache.compiles == 3
    with pytest.raises(jc.SchemaError):
        cache.get(bad[0])  # the oldest was forgotten: compiled (and refused) again
    assert cache.compiles == 4


def test_the_default_cache_remembers_1024_refusals() -> None:
    cache = jc.SchemaCache()
    bad = [{"type": "string", "minLength": 3, "maxLength": 1, "title": str(i)} for i in range(1025)]
    for schema in bad:
        with pytest.raises(jc.SchemaError):
            cache.get(schema)
    with pytest.raises(jc.SchemaError):
        cache.get(bad[1])  # the 1024 newest are held
    assert cache.compiles == 1025
    with pytest.raises(jc.SchemaError):
        cache.get(bad[0])  # the 1025th back is not
    assert cache.compiles == 1026


def test_a_schema_nested_too_deeply_is_refused_in_words() -> None:
    cache = jc.SchemaCache()
    deep = nested_arrays(400)  # json.dumps writes it; compiling it recurses past Python's limit
    for _ in range(2):
        with pytest.raises(jc.SchemaError) as err:
            cache.get(deep)
        assert str(err.value) == "the schema is nested too deeply"
    assert cache.compiles == 1


# ------------------------------------------------------------------------------------------ bounded in bytes
def test_least_recently_used_out_when_over_the_byte_bound() -> None:
    sizes = {name: jc.SchemaFSM(s).nbytes() for name, s in (("bool", BOOL), ("null", NULL))}
    cache = jc.SchemaCache(max_bytes=sizes["bool"] + sizes["null"])  # exactly two fit
    a, b = cache.get(BOOL), cache.get(NULL)
    assert cache.nbytes == sizes["bool"] + sizes["null"] and cache.compiles == 2  # at the bound: both kept
    assert cache.get(BOOL) is a and cache.get(NULL) is b and cache.compiles == 2
    assert cache.get(BOOL) is a  # bool is now the most recently used, null the least
    c = cache.get({"const": 1})  # one more: null goes
    assert cache.compiles == 3 and cache.nbytes == sizes["bool"] + c.nbytes()
    assert cache.get(BOOL) is a and cache.compiles == 3
    assert cache.get(NULL) is not b and cache.compiles == 4  # null compiled again


def test_the_newest_automaton_stays_even_alone_over_the_bound() -> None:
    cache = jc.SchemaCache(max_bytes=1)
    a = cache.get(BOOL)
    assert cache.get(BOOL) is a and cache.compiles == 1 and cache.nbytes == a.nbytes()
    b = cache.get(NULL)  # the older one leaves, the newest stays
    assert cache.nbytes == b.nbytes() and cache.get(NULL) is b and cache.compiles == 2
    assert cache.get(BOOL) is not a and cache.compiles == 3


# ------------------------------------------------------------------------------------------ compiles in flight
class Held:
    """Stands in for SchemaFSM: schemas titled "held" wait for `release` before compiling."""

    def __init__(self) -> None:
        self.release, self.entered, self.real = threading.Event(), threading.Semaphore(0), jc.SchemaFSM

    def __call__(self, schema, tokenizer=None):
        if schema.get("title") == "held":
            self.entered.release()
            assert self.release.wait(10)
        return self.real(schema, tokenizer)


def start(cache: jc.SchemaCache, schema: dict, results: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(cache.get(schema)))
    thread.start()
    return thread


@pytest.fixture
def held(monkeypatch) -> Held:
    stub = Held()
    monkeypatch.setattr(jc, "SchemaFSM", stub)
    yield stub
    stub.release.set()


def test_at_most_two_compiles_at_once_by_default(held: Held) -> None:
    cache, results = jc.SchemaCache(), []
    slow = [{"type": "string", "maxLength": n, "title": "held"} for n in (3, 4)]
    threads = [start(cache, s, results) for s in slow]
    for _ in slow:
        assert held.entered.acquire(timeout=10)
    with pytest.raises(jc.SchemaBusy):
        cache.get(BOOL)  # a third schema while two compile: refused at once
    assert cache.compiles == 2
    assert cache.get(BOOL, limit=False).accepts_text("true")  # the engine's own call compiles anyway
    held.release.set()
    for t in threads:
        t.join(10)
    assert len(results) == 2 and cache.compiles == 3
    assert cache.get(BOOL).accepts_text("false") and cache.compiles == 3  # nothing in flight: no refusal


def test_one_compile_in_flight_refuses_a_second_with_max_compiling_one(held: Held) -> None:
    cache, results = jc.SchemaCache(max_compiling=1), []
    slow = {"type": "string", "maxLength": 3, "title": "held"}
    first = start(cache, slow, results)
    assert held.entered.acquire(timeout=10)
    with pytest.raises(jc.SchemaBusy, match="1 other schemas are being compiled"):
        cache.get(BOOL)
    same = start(cache, slow, results)  # the same schema: waits for the compile in flight, does not start its own
    held.release.set()
    first.join(10)
    same.join(10)
    assert len(results) == 2 and results[0] is results[1] and cache.compiles == 1
    assert cache.get(BOOL).accepts_text("true") and cache.compiles == 2


def test_waiters_on_a_refused_compile_get_its_refusal(held: Held) -> None:
    cache, errors = jc.SchemaCache(), []
    bad = dict(EMPTY_RANGE, title="held")

    def ask() -> None:
        try:
            cache.get(bad)
        except jc.SchemaError as err:
            errors.append(str(err))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    threads[0].start()
    assert held.entered.acquire(timeout=10)
    for t in threads[1:]:
        t.start()
    held.release.set()
    for t in threads:
        t.join(10)
    assert len(errors) == 3 and len(set(errors)) == 1 and "lower bound 7" in errors[0] and cache.compiles == 1


# ------------------------------------------------------------------------------------------ worker processes
class InlinePool:
    """Stands in for ProcessPoolExecutor: runs each job here, on pickled copies of its arguments (as a worker
    process would receive them), and records how it was made and shut down."""

    made: list[InlinePool] = []
    fail_submit: BaseException | None = None
    break_result = False

    def __init__(self, max_workers=None, mp_context=None) -> None:
        self.max_workers, self.mp_context, self.shutdowns, self.jobs = max_workers, mp_context, [], 0
        InlinePool.made.append(self)

    def submit(self, fn, *args):
        if InlinePool.fail_submit is not None:
            raise InlinePool.fail_submit
        self.jobs += 1
        future = concurrent.futures.Future()
        if InlinePool.break_result:
            future.set_exception(BrokenProcessPool("a worker died"))
        else:
            future.set_result(pickle.loads(pickle.dumps(fn(*pickle.loads(pickle.dumps(args))))))
        return future

    def shutdown(self, wait=True, *, cancel_futures=False) -> None:
        self.shutdowns.append((wait, cancel_futures))


@pytest.fixture
def pool(monkeypatch) -> type[InlinePool]:
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", InlinePool)
    monkeypatch.setattr(InlinePool, "made", [])
    monkeypatch.setattr(InlinePool, "fail_submit", None)
    monkeypatch.setattr(InlinePool, "break_result", False)
    return InlinePool


def test_in_processes_compiles_in_one_pool_of_max_compiling_workers(pool) -> None:
    tok = ReversedTokenizer()
    cache = jc.SchemaCache(tokenizer=tok, max_compiling=3, in_processes=True)
    a, b = cache.get(BOOL), cache.get(NULL)
    assert len(pool.made) == 1 and pool.made[0].jobs == 2 and pool.made[0].max_workers == 3
    ctx = pool.made[0].mp_context
    assert ctx is not None and ctx.get_start_method() == "forkserver"  # never fork a threaded server
    # built with the cache's tokenizer: its ids, not the default's
    assert a.tok.itos == tok.itos and a.next_state[0, tok.stoi["t"]] >= 0 and a.next_state[0, tok.stoi["f"]] >= 0
    assert b.walk("null") in b.accepting and a.accepts_text("false")
    default = jc.SchemaFSM(BOOL)
    assert not (a.next_state == default.next_state).all()  # the ids differ from the default tokenizer's
    cache.close()
    assert pool.made[0].shutdowns == [(True, True)]  # wait for the workers, cancel queued compiles
    cache.close()  # nothing left to stop
    assert pool.made[0].shutdowns == [(True, True)]


def test_threads_by_default_and_for_schemas_refused_from_their_keywords(pool) -> None:
    assert jc.SchemaCache().get(BOOL).accepts_text("true") and pool.made == []  # default: no pool
    tok = ReversedTokenizer()
    assert jc.SchemaCache(tokenizer=tok).get(BOOL).tok is tok  # compiled here, with the cache's tokenizer
    jc.SchemaCache().close()  # no pool to stop
    cache = jc.SchemaCache(in_processes=True)
    huge = {"type": "string", "maxLength": 10**6}
    with pytest.raises(jc.SchemaError, match="too large"):
        cache.get(huge)
    assert pool.made == []  # refused here at once, without a worker


def test_in_threads_when_no_process_can_start(pool, capsys) -> None:
    pool.fail_submit = OSError("no processes here")
    tok = ReversedTokenizer()
    cache = jc.SchemaCache(tokenizer=tok, in_processes=True)
    fsm = cache.get(BOOL)
    assert fsm.accepts_text("true") and fsm.tok is tok and not cache.in_processes
    err = capsys.readouterr().err
    assert "[mlsys] schema worker processes unavailable (no processes here); compiling in threads" in err
    pool.fail_submit = None
    cache.get(NULL)
    assert pool.made[0].jobs == 0  # later schemas compile in threads too


def test_a_dead_worker_pool_is_replaced_and_the_request_told_to_retry(pool) -> None:
    cache = jc.SchemaCache(in_processes=True)
    pool.break_result = True
    with pytest.raises(jc.SchemaBusy) as err:
        cache.get(BOOL)
    assert str(err.value) == "the schema compiler restarted; retry"
    assert len(pool.made) == 1 and len(pool.made[0].shutdowns) == 1
    pool.break_result = False
    assert cache.get(BOOL).accepts_text("true")  # not a refusal: compiled on retry...
    assert len(pool.made) == 2 and pool.made[1].jobs == 1  # ... by a new pool


# ------------------------------------------------------------------------------------------ sizes
@pytest.mark.parametrize("schema", [{"type": "integer", "minimum": 0, "maximum": 400}, jc.RECORD_SCHEMA, {}])
def test_nbytes_bounds_the_memory_tracemalloc_sees(schema) -> None:
    """What the automaton holds, measured: its Python objects (tracemalloc sees every allocation made while it is
    built and still alive) plus its tensors' storage (torch allocates outside Python's allocator, which tracemalloc
    does not see). nbytes may overestimate that, by at most 15%, and never fall below it."""
    tok = Tokenizer()
    gc.collect()
    tracemalloc.start()
    try:
        fsm = jc.SchemaFSM(schema, tok)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    held += sum(t.untyped_storage().nbytes() for t in (fsm.next_state, fsm.cost, fsm.accepts))
    assert held <= fsm.nbytes() <= 1.15 * held, (held, fsm.nbytes())


def built_size(schema, depth: int = jc.ANY_DEPTH) -> int:
    nfa = jc.NFA()
    jc.build(nfa, schema, depth)
    return len(nfa.edges) + sum(map(len, nfa.edges))


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": 60}, {"type": "string", "minLength": 60}, {"type": "string", "minLength": 60,
                                                                                 "maxLength": 2},
    {"type": "integer", "minimum": 0, "maximum": 900}, {"type": "integer", "minimum": 5, "maximum": 99},
    {"type": "array", "items": NULL, "maxItems": 40}, {"type": "array", "items": BOOL, "minItems": 30},
    {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    {"enum": ["abcdefgh", 123456, None, "xy"]}, {"const": "abcdefghijklmnop"},
    {"type": "number", "minimum": 0, "maximum": 900}, {"type": "integer", "maximum": 500},
    {"type": "integer", "minimum": 900, "maximum": 999}, {"type": "integer", "minimum": 500000, "maximum": 500000},
    {"type": "object", "properties": {"a" * 30: NULL, "b" * 30: NULL}}, {"type": "string", "maxLength": 2},
    {"type": "object", "properties": {"abcdefgh": {"type": "string", "maxLength": 30}, "k": {"type": "null"}}},
    jc.RECORD_SCHEMA, {"type": "string"}, {"type": "string", "minLength": 5}, {"type": "integer"}, BOOL, NULL,
    {"type": "array", "items": BOOL}, {"type": "array", "items": {"type": "string"}, "minItems": 3},
    {"type": "array", "items": {"type": "integer", "maximum": 50}, "maxItems": 0}, {"type": "string", "maxLength": 0},
])
def test_estimated_size_follows_what_build_makes(schema) -> None:
    """An upper bound of the states and edges build() makes (the server trusts it to refuse early), and within
    twice that plus a few dozen (so it refuses only what is really large)."""
    actual = built_size(schema) if schema.get("minLength", 0) <= schema.get("maxLength", 10**9) else None
    estimate = jc.estimated_size(schema)
    if actual is None:  # refused by build; the estimate still scales with the larger bound
        actual = built_size({"type": "string", "minLength": 60})
    assert actual <= estimate <= 2 * actual + 64, (estimate, actual)


@pytest.mark.parametrize("schema", [{"enum": ["abcdefghijkl", 123456789, "xyzxyzxyzxyz"]}, {"enum": ["abcdefghij"]},
                                    {"const": "abcdefghijklmnop"}, {"const": [1234567, "abcdefgh"]}])
def test_estimated_size_of_literals_is_from_above_and_close(schema) -> None:
    """Enums and consts: an upper bound, and a close one."""
    actual = built_size(schema)  # a literal of n characters: n + 1 states and n edges, plus the alternation's
    assert actual <= jc.estimated_size(schema) <= 1.4 * actual, (jc.estimated_size(schema), actual)


@pytest.mark.parametrize("schema", [{"type": "integer", "minimum": 0, "maximum": 900},
                                    {"type": "integer", "minimum": 10, "maximum": 99}])
def test_estimated_size_of_integer_ranges_is_close(schema) -> None:
    actual = built_size(schema)  # one literal per value, as a trie
    assert actual <= jc.estimated_size(schema) <= 1.3 * actual, (jc.estimated_size(schema), actual)


@pytest.mark.parametrize("schema", [{"type": "array", "maxItems": 3}, {"type": "array", "items": {}, "minItems": 2},
                                    {"type": "object", "properties": {"a": {}, "b": {"type": "object"}}}, {}])
def test_estimated_size_of_any_values_is_from_above(schema) -> None:
    """{} (any value, depth-limited) counts as its measured size at its depth, rounded up: never below build's."""
    assert built_size(schema) <= jc.estimated_size(schema), (jc.estimated_size(schema), built_size(schema))


def test_estimated_size_of_any_value_by_depth() -> None:
    for depth, any_size in enumerate((600, 3_000, 12_000)):
        assert jc.estimated_size({}, depth) == any_size
        assert jc.estimated_size({"title": "t", "description": "d"}, depth) == any_size
        assert jc.estimated_size({"type": "object"}, depth) == any_size
        assert built_size({}, depth) <= any_size  # measured on build(), rounded up
    assert jc.estimated_size({}, -1) == 600 and jc.estimated_size({}, 7) == 12_000
    nested = {"type": "object", "properties": {"a": {}}}  # {} one level down counts as depth 1
    assert jc.estimated_size(nested) == 2 * len('"a"') + 12 + 3_000 + 8  # the key literal, its joins, {} at depth 1


def test_estimated_size_of_malformed_and_unbounded_nodes_is_small() -> None:
    for schema in (True, None, 3, {"type": "integer"}, {"type": "integer", "minimum": 3},
                   {"type": "integer", "maximum": True}, {"type": "string", "maxLength": True},
                   {"type": "array", "items": NULL, "maxItems": -4}, {"enum": "x"}, {"enum": "x" * 1000}, {"enum": 5},
                   {"type": "string", "maxLength": "abc"}, {"type": "integer", "minimum": -1e308, "maximum": 1e308},
                   {"minimum": 3},
                   {"type": "string", "pattern": "a"}, {"type": "integer", "minimum": 9, "maximum": 3}):
        assert jc.estimated_size(schema) <= 256, schema


# ------------------------------------------------------------------------------------------ the scanning mask
def test_the_scanning_mask_applies_like_the_table_mask() -> None:
    """mask_by_scanning (the table-free reference the chapter compares against) must be usable exactly where the
    decoder uses the table mask: as a boolean mask over the vocabulary, `logits.masked_fill(~allowed, -inf)`.
    Checked on the first state of the record schema, against the tokens a hand-written rule allows there: only
    '{' opens a JSON object."""
    import torch

    fsm = jc.SchemaFSM(jc.RECORD_SCHEMA)
    allowed = fsm.mask_by_scanning(fsm.nfa_start, remaining=10_000)
    table = fsm.mask(fsm.start, 10_000)
    logits = torch.zeros(fsm.tok.vocab_size)
    masked = logits.masked_fill(~allowed, float("-inf"))  # raises unless the mask is boolean
    assert torch.equal(masked, logits.masked_fill(~table, float("-inf")))
    assert [fsm.tok.itos[v] for v in torch.nonzero(allowed).flatten().tolist()] == ["{"]
