"""Chapter 11 oracles, JSON-constrained decoding: the automaton on hand cases, min-tokens-to-close against a
brute-force search and against the NFA's own distances, the table mask against the scanning mask, and every
decoded output (real model and an untrained one, many seeds, every budget from the shortest document up)
parsing with json.loads and validating with jsonschema."""

from __future__ import annotations

import json
import random
from collections import deque

import jsonschema
import pytest
import torch

from mlsys.data import LANGS, PEOPLE, Tokenizer, format_record, sample_record
from mlsys.json_constrained import (
    INF,
    RECORD_SCHEMA,
    SchemaError,
    SchemaFSM,
    compile_schema,
    constrained_generate,
    min_tokens_to_close,
    step_nfa,
)
from mlsys.model import GPT, GPTConfig
from mlsys.weights import load_pretrained

SMALL_SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}}}
SCHEMAS = {"record": RECORD_SCHEMA, "small": SMALL_SCHEMA, "any": {},
           "enum-array": {"type": "array", "items": {"enum": ["a", 7, None, True]}, "minItems": 2, "maxItems": 4}}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def record_fsm() -> SchemaFSM:
    return compile_schema(RECORD_SCHEMA)


# ------------------------------------------------------------------------------------------ hand cases
def test_record_fsm_hand_cases(record_fsm: SchemaFSM) -> None:
    rng = random.Random(0)
    for _ in range(50):  # every record of the training grammar is in the language
        assert record_fsm.accepts_text(format_record(sample_record(rng)))
    good = '{"name": "ada", "age": 34, "city": "london", "langs": ["c", "go"]}'
    assert record_fsm.accepts_text(good)
    for bad in [good.replace('": ', '":'),  # other spacing: outside the canonical layout
                good.replace('"ada"', '"bob"'), good.replace("34", "9"), good.replace("34", "100"),
                good.replace('["c", "go"]', "[]"), good.replace('["c", "go"]', '["c", "go", "ml", "lua"]'),
                good.replace('"age": 34, ', ""), good[:-1], good + " "]:
        assert not record_fsm.accepts_text(bad), bad
    shortest = {"name": min(PEOPLE, key=len), "age": 10, "city": min({p.city for p in PEOPLE.values()}, key=len),
                "langs": [min(LANGS, key=len)]}
    assert record_fsm.min_length == len(json.dumps(shortest))
    # after '{"name": "b' only the b-names continue; with exactly enough budget, the shortest one
    s = record_fsm.walk('{"name": "b')
    allowed = {record_fsm.tok.itos[v] for v in record_fsm.mask(s, 100).nonzero().flatten()}
    assert allowed == {n[1] for n in PEOPLE if n.startswith("b")}
    tight = {record_fsm.tok.itos[v] for v in record_fsm.mask(s, record_fsm.dist[s]).nonzero().flatten()}
    assert tight == {"j"}  # "barbara" or "bjarne": with no budget to spare, only the shorter name fits


@pytest.mark.parametrize("schema, shortest", [
    ({"type": "boolean"}, "true"), ({"type": "null"}, "null"), ({"type": "integer"}, "0"),
    ({"type": "string"}, '""'), ({"type": "string", "minLength": 3}, '"aaa"'), ({"type": "array"}, "[]"),
    ({"enum": ["ab", "c", 12]}, "12"), ({"const": "x"}, '"x"'), ({}, "0"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[0, 0]"),
    ({"type": "object", "properties": {"a": {"type": "null"}}}, '{"a": null}'),
])
def test_min_length_hand_cases(schema: dict, shortest: str) -> None:
    fsm = compile_schema(schema)
    assert fsm.min_length == len(shortest)
    assert fsm.accepts_text(shortest)


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "integer"}, ["0", "7", "120"], ["01", "", "1 "]),
    ({"type": "integer", "minimum": 3, "maximum": 12}, ["3", "9", "12"], ["2", "13", "03"]),
    ({"type": "string", "maxLength": 2}, ['""', '"a"', '"a "'], ['"abc"', "a"]),
    ({"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, ["[]", "[true]", "[true, false]"],
     ["[true, true, true]", "[true,false]", "[, true]", "[true, ]"]),
    ({}, ['{}', '[]', '{"a": [1, null]}', '[[], "x"]', '[{"b": true}]'],
     ['{"a"}', "[1,]", "{1: 2}", "[[[1]]]", '{"a": [{"b": 1}]}']),  # depth 3 is past ANY_DEPTH = 2
])
def test_language_hand_cases(schema: dict, good: list[str], bad: list[str]) -> None:
    fsm = compile_schema(schema)
    for text in good:
        assert fsm.accepts_text(text), text
        jsonschema.validate(json.loads(text), schema)
    for text in bad:
        assert not fsm.accepts_text(text), text


def test_unsupported_schemas_fail_loudly() -> None:
    for schema in ({"type": "integer", "minimum": -3}, {"type": "string", "pattern": "a+"}, {"enum": ["A"]}):
        with pytest.raises(ValueError):
            compile_schema(schema)


@pytest.mark.parametrize("schema, why", [
    ({"type": "object", "properties": {"a": {"type": "null"}}, "required": ["a", "b"]}, "properties does not list"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength/maxLength"),
    ({"type": "array", "items": {"type": "null"}, "minItems": 3, "maxItems": 1}, "minItems/maxItems"),
    ({"type": "integer", "enum": ["a", "b"]}, "no value of the enum"),
    ({"type": "integer", "minimum": 5, "maximum": 3}, "minimum/maximum"),
    ({"type": "integer", "maximum": -1}, "minimum/maximum"),
    ({"const": 3, "type": "string"}, "contradicts"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 4, "maxLength": 1}}}, "minLength"),
    ({"type": "array", "items": False, "minItems": 1}, "admits no value"),
    ({"type": "string", "minLength": -1}, "not a valid JSON Schema"),  # jsonschema's meta-schema check
    ({"type": "strng"}, "not a valid JSON Schema"),
    ({"type": "object", "required": "a"}, "not a valid JSON Schema"),
])
def test_schemas_without_a_valid_output_are_refused(schema: dict, why: str) -> None:
    """Each of these compiled before and produced text that jsonschema rejects (or min_length 2^30)."""
    with pytest.raises(SchemaError, match=why):
        compile_schema(schema)


def test_enum_values_that_contradict_the_type_are_dropped() -> None:
    fsm = compile_schema({"type": "integer", "enum": ["a", 3, 17, True]})
    assert fsm.accepts_text("3") and fsm.accepts_text("17")
    assert not fsm.accepts_text('"a"') and not fsm.accepts_text("true")
    assert compile_schema({"type": "array", "items": False}).accepts_text("[]")


# ------------------------------------------------------------------------------------------ property test
WORDS = ["a", "ok", "zed", "x1", "no way"]


def random_schema(rng: random.Random, depth: int = 2) -> dict:
    """A random schema of the supported subset that has at least one valid document."""
    kinds = ["boolean", "null", "integer", "string", "enum", "const"] + (["array", "object"] if depth > 0 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.choice([None, 0, 3, 95])  # a lower bound above 0 needs an upper one (a finite trie)
        hi = None if not lo and rng.random() < 0.3 else (lo or 0) + rng.randint(0, 120)
        return {"type": "integer", **({"minimum": lo} if lo is not None else {}),
                **({"maximum": hi} if hi is not None else {})}
    if kind == "string":
        s: dict = {"type": "string"}
        if rng.random() < 0.5:
            s["minLength"] = rng.randint(0, 3)
        if rng.random() < 0.5:
            s["maxLength"] = s.get("minLength", 0) + rng.randint(0, 4)
        if rng.random() < 0.3:  # an enum under string bounds: only the values that fit are kept
            s["enum"] = rng.sample(WORDS, 3) + [7]
            if not any(isinstance(w, str) and s.get("minLength", 0) <= len(w) <= s.get("maxLength", 99)
                       for w in s["enum"]):
                del s["enum"]
        return s
    if kind == "enum":
        return {"enum": rng.sample([*WORDS, 0, 42, True, False, None, [1, "a"], {"k": 2}], 3)}
    if kind == "const":
        return {"const": rng.choice([*WORDS, 5, None, [True, 3]])}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth - 1), "minItems": lo,
                **({"maxItems": lo + rng.randint(0, 2)} if rng.random() < 0.7 else {})}
    if kind == "object":
        keys = rng.sample(["id", "tag", "n", "ok", "sub"], rng.randint(1, 3))
        return {"type": "object", "properties": {k: random_schema(rng, depth - 1) for k in keys},
                "required": rng.sample(keys, rng.randint(0, len(keys)))}
    return {"type": kind}


def random_documents(fsm: SchemaFSM, rng: random.Random, budget: int, n: int) -> list[str]:
    """n documents written by choosing uniformly among the tokens the mask allows: every path the mask opens."""
    docs = []
    for _ in range(n):
        state, out, remaining = fsm.start, [], budget
        while True:
            allowed = fsm.mask(state, remaining).nonzero().flatten().tolist()
            assert allowed, "the mask left no token"
            v = rng.choice(allowed)
            if v == fsm.tok.eos_id:
                break
            out.append(v)
            state, remaining = int(fsm.next_state[state, v]), remaining - 1
        docs.append(fsm.tok.decode(out))
    return docs


def test_property_every_masked_output_validates(tiny_model: GPT) -> None:
    """Random schemas of the subset; for each, random walks through the mask at several budgets and decoding
    with a random model at temperature 2: every document parses and jsonschema accepts it."""
    rng = random.Random(0)
    checked = 0
    for i in range(60):
        schema = random_schema(rng)
        jsonschema.validators.validator_for(schema).check_schema(schema)
        fsm = compile_schema(schema)
        lo = fsm.min_length
        for budget in (lo, lo + 3, lo + 15):
            for text in random_documents(fsm, rng, budget, 8):
                assert len(text) <= budget
                jsonschema.validate(json.loads(text), schema)
                checked += 1
        if i % 4 == 0 and lo + 8 < tiny_model.config.block_size - 2:
            g = torch.Generator().manual_seed(i)
            text = constrained_generate(tiny_model, fsm, lo + 8, temperature=2.0, generator=g)
            jsonschema.validate(json.loads(text), schema)
    assert checked == 60 * 3 * 8


# ------------------------------------------------------------------------------------------ min tokens to close
@pytest.mark.parametrize("name", ["small", "enum-array", "any"])
def test_min_tokens_to_close_against_forward_search(name: str) -> None:
    """dist[s] equals a plain breadth-first search forward from s, state by state, and the NFA's 0-1 BFS."""
    fsm = compile_schema(SCHEMAS[name])
    for s in range(len(fsm.trans)):
        seen, queue, found = {s}, deque([(s, 0)]), INF
        while queue:
            cur, d = queue.popleft()
            if cur in fsm.accepting:
                found = d
                break
            for nxt in fsm.trans[cur].values():
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append((nxt, d + 1))
        assert fsm.dist[s] == found
        assert fsm.dist[s] == min(fsm.nfa_dist[n] for n in fsm.subsets[s])


def test_min_tokens_to_close_tiny_graph() -> None:
    #  0 -a-> 1 -b-> 2 (accept);  0 -c-> 2;  3 -d-> 0;  4 (dead end)
    trans = [{"a": 1, "c": 2}, {"b": 2}, {}, {"d": 0}, {}]
    assert min_tokens_to_close(trans, {2}) == [1, 1, 0, 2, INF]


# ------------------------------------------------------------------------------------------ masks
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_table_mask_equals_scanning_mask(name: str) -> None:
    fsm = compile_schema(SCHEMAS[name])
    rng = random.Random(0)
    for _ in range(6):  # random walks through the language, every budget along the way
        state, nfa_states, remaining = fsm.start, fsm.nfa_start, fsm.min_length + rng.randint(0, 20)
        while True:
            a, b = fsm.mask(state, remaining), fsm.mask_by_scanning(nfa_states, remaining)
            assert torch.equal(a, b)
            choices = [v for v in a.nonzero().flatten().tolist() if v != fsm.tok.eos_id]
            if not choices:
                assert a[fsm.tok.eos_id]
                break
            ch = fsm.tok.itos[rng.choice(choices)]
            state, nfa_states, remaining = fsm.trans[state][ch], step_nfa(fsm.nfa, nfa_states, ch), remaining - 1


def test_budget_below_the_shortest_document_is_refused(record_fsm: SchemaFSM) -> None:
    model = GPT(GPTConfig.preset("tiny")).eval()
    with pytest.raises(ValueError, match="shortest valid document"):
        constrained_generate(model, record_fsm, record_fsm.min_length - 1)


# ------------------------------------------------------------------------------------------ decoding
def check_all_valid(model, fsm: SchemaFSM, budgets, seeds, temperature: float = 1.0) -> int:
    n = 0
    for budget in budgets:
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            text = constrained_generate(model, fsm, budget, temperature=temperature, generator=g)
            assert len(text) <= budget, (budget, text)
            jsonschema.validate(json.loads(text), fsm.schema)
            n += 1
    return n


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_untrained_model_every_budget_valid(name: str) -> None:
    """An untrained model's logits go anywhere: the mask alone must keep every output valid."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("small")).eval()
    fsm = compile_schema(SCHEMAS[name])
    lo = fsm.min_length
    budgets = [lo, lo + 1, lo + 4, lo + 17]
    assert check_all_valid(model, fsm, budgets, range(5), temperature=2.0) == 5 * len(budgets)


@pytest.mark.timeout(150)
def test_trained_model_many_seeds_and_budgets(record_fsm: SchemaFSM) -> None:
    model = load_pretrained("small")
    lo = record_fsm.min_length
    check_all_valid(model, record_fsm, [lo, lo + 1, lo + 4, 70, 100], range(10))
    check_all_valid(model, compile_schema({}), [1, 2, 3, 30], range(10))
    check_all_valid(model, record_fsm, [lo, 80], [0], temperature=0.0)  # greedy too


# ------------------------------------------------------------------------------------------ the drawn automaton
def test_drawn_automaton_matches_the_language_one_character_at_a_time(small_model, tmp_path) -> None:
    """automaton.png: every drawn state and edge against the schema's language itself, written out by hand: the
    enum's documents are json.dumps of its values. From each drawn state (reached by its prefix), every
    character of the alphabet is tried: an edge is drawn exactly when prefix + character still starts some
    document. The highlighted path is a real output, a document of the language, and follows drawn edges."""
    from types import SimpleNamespace

    from conftest import load_script, scripts_dir

    script = load_script(scripts_dir(11) / "constrained_decoding.py")
    drawn = script.draw_automaton(small_model, SimpleNamespace(plot_dir=str(tmp_path)))
    language = {json.dumps(v) for v in script.TOY_SCHEMA["enum"]}
    prefixes = {w[:i] for w in language for i in range(len(w) + 1)}
    nodes = {n["state"]: n for n in drawn["nodes"]}
    assert sorted(n["prefix"] for n in drawn["nodes"]) == sorted(prefixes)  # one state per live prefix (a trie)
    edges = {(src, char): dst for src, dst, char in drawn["edges"]}
    assert len(edges) == len(drawn["edges"])
    alphabet = [t for t in Tokenizer().itos if len(t) == 1]
    for s, node in nodes.items():
        p = node["prefix"]
        assert node["accepting"] == (p in language), p
        assert node["dist"] == min(len(w) - len(p) for w in language if w.startswith(p)), p
        for char in alphabet:
            alive = any(w.startswith(p + char) for w in language)
            assert ((s, char) in edges) == alive, (p, char)
            if alive:
                assert nodes[edges[(s, char)]]["prefix"] == p + char
    text, path = drawn["text"], drawn["path"]
    assert text in language
    jsonschema.validate(json.loads(text), script.TOY_SCHEMA)
    assert [edges[(a, c)] for a, c in zip(path, text)] == path[1:] and nodes[path[-1]]["accepting"]
