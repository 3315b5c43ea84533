"""mlsys.json_constrained's language, limits and refusals, in the test's own process (mutation testing).

What a compiled schema accepts is checked against JSON Schema's meaning, decided without the compiler: jsonschema
validates the value, the canonical layout is `json.dumps`'s, and the nesting limit of `{}` (any value, at most
`ANY_DEPTH` containers deep counted from the document's root) is counted by walking the value. The limits on
compiling (states, subset-construction work) are checked by counting states and edges by hand on small NFAs with the
limits patched low, and every refusal by its whole message: a server sends that message to its client.
"""

from __future__ import annotations

import json
import os

import jsonschema
import pytest

from mlsys import json_constrained as jc
from mlsys.data import Tokenizer


def containers(value) -> int:
    """How many arrays/objects deep `value` nests (a scalar: 0)."""
    if isinstance(value, list):
        return 1 + max(map(containers, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(containers, value.values()), default=0)
    return 0


VALUES = [0, 7, 12, True, False, None, "", "ab", [], [1], ["x", 2], [[1]], [[]], [[[1]]], {}, {"a": 1},
          {"a": [1]}, {"a": {"b": 1}}, {"a": [[1]]}, {"a": {"b": {"c": 1}}}, [{"a": 1}], [{"a": [1]}]]


def refusal(schema) -> str:
    with pytest.raises(jc.SchemaError) as err:
        jc.SchemaFSM(schema)
    return str(err.value)


# ------------------------------------------------------------------------------------------ the language
@pytest.mark.parametrize("schema, extra", [({}, 0), (True, 0), ({"title": "t", "description": "d"}, 0),
                                           ({"type": "array", "items": {}}, 1), ({"type": "array", "items": True}, 1),
                                           ({"type": "object", "properties": {"a": {}}}, 1)])
def test_any_value_nests_at_most_any_depth_containers_from_the_root(schema, extra) -> None:
    fsm = jc.SchemaFSM(schema)
    for value in VALUES:
        doc = value if extra == 0 else [value] if "items" in schema else {"a": value}
        text = json.dumps(doc)
        assert fsm.accepts_text(text) == (containers(doc) <= jc.ANY_DEPTH), (schema, text)


def test_a_free_object_at_the_depth_limit_is_only_the_empty_object() -> None:
    inner = {"type": "object", "properties": {"b": {"type": "object"}}}  # b's free object sits at depth 0
    fsm = jc.SchemaFSM({"type": "object", "properties": {"a": inner}})
    assert fsm.accepts_text('{"a": {"b": {}}}')
    assert not fsm.accepts_text('{"a": {"b": {"c": 1}}}')


@pytest.mark.parametrize("schema", [{"type": "object"}, {"type": "object", "additionalProperties": True},
                                    {"type": "object", "additionalProperties": False},
                                    {"type": "object", "additionalProperties": False, "required": []}])
def test_objects_without_properties_follow_additional_properties(schema) -> None:
    fsm = jc.SchemaFSM(schema)
    for value in [{}, {"a": 1}, {"a": 1, "b": "x"}, {"a": [1]}]:
        text = json.dumps(value)
        expected = jsonschema.Draft202012Validator(schema).is_valid(value) and containers(value) <= jc.ANY_DEPTH
        assert fsm.accepts_text(text) == expected, (schema, text)


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": 0}, {"type": "string", "maxLength": 1}, {"type": "string", "minLength": 2,
                                                                             "maxLength": 3},
    {"type": "integer", "minimum": 1, "maximum": 3}, {"type": "integer"}, {"type": "integer", "maximum": 0},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 0},
    {"type": "array", "items": {"type": "integer", "maximum": 9}, "minItems": 1, "maxItems": 2},
    {"type": "array", "items": False}, {"type": "boolean"}, {"type": "null"},
])
def test_scalars_and_arrays_accept_what_jsonschema_validates(schema) -> None:
    fsm = jc.SchemaFSM(schema)
    for value in ["", "a", "ab", "abc", "abcd", 0, 1, 3, 4, 10, 123, True, False, None, [], [0], [1, 2], [1, 2, 3],
                  [12], ["a"]]:
        text = json.dumps(value)
        assert fsm.accepts_text(text) == jsonschema.Draft202012Validator(schema).is_valid(value), (schema, text)


def test_the_integer_trie_reaches_exactly_10000_values() -> None:
    fsm = jc.SchemaFSM({"type": "integer", "minimum": 0, "maximum": 10_000})  # hi - lo == 10,000: still a trie
    assert fsm.accepts_text("10000") and fsm.accepts_text("0") and not fsm.accepts_text("10001")
    assert refusal({"type": "integer", "minimum": 0, "maximum": 10_001}) == (
        "integer bounds are supported for ranges of at most 10,000 values")
    assert refusal({"type": "integer", "minimum": 1}) == (
        "integer bounds are supported for ranges of at most 10,000 values")


# ------------------------------------------------------------------------------------------ refusals, word for word
@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "properties": {"a": False}}, "the schema `false` admits no value"),
    ({"type": "string", "pattern": "a"}, "keywords outside the supported subset: ['pattern']"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]},
     "required names ['b'], which properties does not list (this subset writes exactly the listed properties)"),
    ({"type": "array", "minItems": 3, "maxItems": 2},
     "minItems/maxItems: the lower bound 3 is above the upper bound 2, so no value is valid"),
    ({"type": "string", "minLength": 3, "maxLength": 2},
     "minLength/maxLength: the lower bound 3 is above the upper bound 2, so no value is valid"),
    ({"type": "integer", "minimum": 3, "maximum": 2},
     "minimum/maximum (integers): the lower bound 3 is above the upper bound 2, so no value is valid"),
    ({"type": "integer", "minimum": -1}, "negative numbers need '-', which is not in the tokenizer's alphabet"),
    ({"minimum": 3}, "schema node outside the supported subset: {'minimum': 3}"),
    ({"const": "é"}, "'\"\\\\u00e9\"' uses ['\\\\'], which the tokenizer cannot write"),
    ({"type": "string", "maxLength": -1}, "not a valid JSON Schema: -1 is less than the minimum of 0 (at maxLength)"),
    ({"type": "array", "items": {"maxLength": -1}},
     "not a valid JSON Schema: -1 is less than the minimum of 0 (at items/maxLength)"),
    ([], "not a valid JSON Schema: [] is not of type 'object', 'boolean' (at the root)"),
])
def test_each_refusal_says_why(schema, message) -> None:
    assert refusal(schema) == message


def test_a_schema_estimated_too_large_is_refused_before_anything_is_built(monkeypatch) -> None:
    schema = {"type": "string", "maxLength": 10**6}
    size = (10**6) * (len(jc.STRING_CHARS) + 8) + 12  # the estimate's arithmetic for one string node
    monkeypatch.setattr(jc, "build", lambda *a: pytest.fail("build ran on a schema refused by its estimate"))
    assert refusal(schema) == (
        f"the schema is too large for this decoder (its automaton would need about {size:,} states and edges, "
        f"more than {jc.MAX_NFA_SIZE:,}); lower maxLength, maxItems, the ranges or the enums")


def test_a_schema_whose_subset_construction_is_too_long_is_refused() -> None:
    schema = {"type": "array", "items": {"type": "string", "maxLength": 200}, "maxItems": 3}
    assert jc.estimated_size(schema) <= jc.MAX_NFA_SIZE  # it passes the estimate and the state limit...
    assert refusal(schema) == ("the schema is too large for this decoder (compiling it would take too long); "
                               "lower maxLength, maxItems or the ranges")  # ...but not the work limit


def test_the_nfa_state_limit_counts_states(monkeypatch) -> None:
    monkeypatch.setattr(jc, "MAX_NFA_STATES", 4)
    nfa = jc.NFA()
    nfa.literal("abc")  # 4 states: the limit, reached, not exceeded
    assert len(nfa.edges) == 4
    with pytest.raises(jc.SchemaError) as err:
        nfa.state()
    assert str(err.value) == ("the schema is too large for this decoder (its automaton needs more than 4 states); "
                              "lower maxLength, maxItems or the ranges")


def test_work_counts_the_edges_followed() -> None:
    nfa = jc.NFA()
    s, e = nfa.literal("a")  # s -a-> e
    t = nfa.state()
    nfa.edge(e, t)  # e -eps-> t
    assert nfa.work == 0
    assert jc.closure(nfa, {e}) == {e, t} and nfa.work == 1  # e's one edge, then t's none
    assert jc.step_nfa(nfa, frozenset({s}), "a") == {e, t}
    assert nfa.work == 1 + 1 + 1  # step: s's one edge; closure of {e}: e's one edge


def test_the_tables_mark_illegal_tokens_with_minus_one() -> None:
    tok = Tokenizer()
    fsm = jc.SchemaFSM({"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, tok)
    for s, edges in enumerate(fsm.trans):
        expected = [edges.get(tok.itos[v], -1) if len(tok.itos[v]) == 1 else -1 for v in range(tok.vocab_size)]
        assert fsm.next_state[s].tolist() == expected == fsm.next_state_list[s]


def test_the_automaton_records_the_process_that_compiled_it() -> None:
    assert jc.SchemaFSM({"type": "null"}).compiled_in == os.getpid()


@pytest.mark.parametrize("schema", [jc.RECORD_SCHEMA, {"type": "array", "items": {"type": "string", "maxLength": 3},
                                                       "maxItems": 3}])
def test_the_scanning_mask_agrees_with_the_tables_at_every_budget(schema) -> None:
    """mask_by_scanning (NFA, nfa_dist) and mask (DFA tables, dist) along a walk, budgets 0..12 around each
    state's distance to the end: the NFA's 0-1 BFS and the DFA's BFS must give the same allowed tokens."""
    fsm = jc.SchemaFSM(schema)
    text = json.dumps({"name": "ana", "age": 31, "city": "x", "langs": []}) if schema is jc.RECORD_SCHEMA \
        else '["ab", "", "c"]'
    state, nfa_states = fsm.start, fsm.nfa_start
    for char in text:
        for remaining in range(fsm.dist[state] - 2, fsm.dist[state] + 3):
            assert fsm.mask(state, remaining).tolist() == fsm.mask_by_scanning(nfa_states, remaining).tolist()
        if char not in fsm.trans[state]:
            break
        state, nfa_states = fsm.trans[state][char], jc.step_nfa(fsm.nfa, nfa_states, char)


def test_a_schema_exactly_at_the_size_estimate_limit_compiles(monkeypatch) -> None:
    schema = {"type": "string", "maxLength": 3}
    monkeypatch.setattr(jc, "MAX_NFA_SIZE", jc.estimated_size(schema))  # at the limit: allowed
    assert jc.SchemaFSM(schema).accepts_text('"abc"')
    monkeypatch.setattr(jc, "MAX_NFA_SIZE", jc.estimated_size(schema) - 1)  # one over it: refused
    assert refusal(schema).startswith("the schema is too large for this decoder (its automaton would need about")


def test_a_compile_exactly_at_the_work_limit_goes_on(monkeypatch) -> None:
    """{"const": 1} is the literal "1": the start state's one edge is the work done (by the start's closure) when
    the subset construction checks its budget before its one step; at a budget of 1 it may take that step."""
    monkeypatch.setattr(jc, "MAX_SUBSET_WORK", 1)
    assert jc.SchemaFSM({"const": 1}).accepts_text("1")
    monkeypatch.setattr(jc, "MAX_SUBSET_WORK", 0)
    assert refusal({"const": 1}).startswith("the schema is too large for this decoder (compiling it would take")
