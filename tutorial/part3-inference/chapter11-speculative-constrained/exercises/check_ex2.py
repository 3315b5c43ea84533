"""Checker for ch11.2 — your min-tokens-to-close and budget mask against mlsys.json_constrained's automata."""

from __future__ import annotations

import json
import random

from mlsys.exercises import task
from mlsys.json_constrained import RECORD_SCHEMA, compile_schema

INF = 1 << 30
SCHEMAS = [RECORD_SCHEMA, {}, {"type": "array", "items": {"type": "integer", "maximum": 99}, "maxItems": 3}]


@task("min_tokens_to_close on a hand-drawn graph (a shortcut, a dead end, an unreachable state)")
def check_tiny(ex) -> None:
    #  0 -a-> 1 -b-> 2 (accept);  0 -c-> 2;  3 -d-> 0;  4 has no edges
    trans = [{"a": 1, "c": 2}, {"b": 2}, {}, {"d": 0}, {}]
    got = list(ex.min_tokens_to_close(trans, {2}))
    assert got == [1, 1, 0, 2, INF], f"got {got}, want [1, 1, 0, 2, INF]"


@task("min_tokens_to_close equals the library's on the record, any-JSON and array schemas")
def check_schemas(ex) -> None:
    for schema in SCHEMAS:
        fsm = compile_schema(schema)
        got = list(ex.min_tokens_to_close(fsm.trans, fsm.accepting))
        bad = [s for s in range(len(fsm.trans)) if got[s] != fsm.dist[s]]
        assert not bad, (f"schema {json.dumps(schema)[:60]}...: state {bad[0]} got {got[bad[0]]}, "
                         f"want {fsm.dist[bad[0]]} ({len(bad)} states differ)")


@task("allowed(...) equals the token-table mask at every state of random walks, every budget")
def check_allowed(ex) -> None:
    rng = random.Random(0)
    for schema in SCHEMAS:
        fsm = compile_schema(schema)
        for _ in range(5):
            state, remaining = fsm.start, fsm.min_length + rng.randint(0, 10)
            while True:
                want = {fsm.tok.itos[v] for v in fsm.mask(state, remaining).nonzero().flatten().tolist()}
                got = set(ex.allowed(fsm.trans, fsm.dist, fsm.accepting, state, remaining))
                assert got == want, f"state {state}, remaining {remaining}: got {sorted(got)}, want {sorted(want)}"
                chars = sorted(want - {"<eos>"})
                if not chars:
                    break
                c = rng.choice(chars)
                state, remaining = fsm.trans[state][c], remaining - 1
