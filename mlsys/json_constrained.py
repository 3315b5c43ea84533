"""JSON-constrained decoding: a JSON Schema subset compiled to a finite automaton, used as a token mask.

    from mlsys.json_constrained import RECORD_SCHEMA, compile_schema, constrained_generate
    fsm = compile_schema(RECORD_SCHEMA)        # a DFA over the characters of the book's tokenizer
    text = constrained_generate(model, fsm, max_tokens=60, temperature=1.0, generator=g)
    json.loads(text)                           # always parses, and validates against the schema

How it works, in three layers:

1. Schema -> NFA. Each schema node becomes a Thompson fragment (a start and an end state joined by character
   edges and empty "epsilon" edges): literals for punctuation and keys, alternation for enums, loops for
   arrays and free strings. Output is canonical `json.dumps` layout (", " and ": ", keys in schema order, every
   listed property emitted) - the layout the model was trained on, and a valid instance of the schema.
2. NFA -> DFA by subset construction, then `dist[s]`: the fewest characters that take state s to an accepting
   state (a breadth-first search backwards from the accepting states). That is the "min tokens to close".
3. DFA -> token tables (Outlines' index, "Efficient Guided Generation for Large Language Models", Willard &
   Louf 2023, https://arxiv.org/abs/2307.09702): `next_state[s, v]` for every state and token id, -1 where
   the token is illegal, and `cost[s, v] = 1 + dist[next_state[s, v]]`. With `remaining` tokens left, token v
   is allowed iff cost[s, v] <= remaining; <eos> iff s accepts. Allowing only such tokens keeps the invariant
   dist[s] <= remaining, so every token budget >= dist[start] ends in a complete, valid document.

The book's tokenizer is one character per token, so a token is one DFA edge. With a BPE vocabulary the same
table is built by walking each token's string through the DFA from every state; nothing else changes.

Supported subset: object (properties in order, all emitted), array (items, minItems, maxItems), string
(enum, minLength, maxLength), integer (minimum, maximum; non-negative: the alphabet has no "-" or "."),
boolean, null, enum and const anywhere, `{}` = any JSON value nested at most `ANY_DEPTH` deep, and an object
without `properties` = any object (OpenAI's `json_object` mode is `{"type": "object"}`). Not
supported: uniqueItems, patterns, optional-property omission, whitespace other than json.dumps'. Arbitrarily
deep JSON needs a stack (a pushdown automaton); a fixed schema has a fixed depth, so a finite automaton does.

A schema is checked before it is compiled, and a `SchemaError` (a ValueError) says why when it is malformed
(jsonschema's meta-schema check), uses a keyword outside the subset, or admits no document this subset can
write: `required` naming a property that `properties` does not list, minLength > maxLength, minItems >
maxItems, minimum > maximum, an enum or const that contradicts the node's other keywords (enum values that do
are dropped: they could never validate), or the schema `false`
(a last check that dist[start] is finite guards anything else).

    python -m mlsys.json_constrained     # DFA size and min length of the record schema (< 1 s)
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from collections import deque

import jsonschema
import torch

from mlsys.data import ALPHABET, LANGS, PEOPLE, Tokenizer

STRING_CHARS = frozenset(ALPHABET) - {'"'}  # no backslash in the alphabet: no escapes to handle
DIGITS, NONZERO = "0123456789", "123456789"
ANY_DEPTH = 2
INF = 1 << 30
# A schema can ask for an automaton of any size (a string of maxLength 10**9). The server compiles the schemas
# clients send, so compiling is bounded: a schema whose automaton would exceed these is refused (SchemaError).
MAX_NFA_STATES = 60_000  # an integer range of 10,000 values needs about 49,000
MAX_NFA_SIZE = 250_000  # states + edges, estimated from the schema before anything is built (estimated_size)
MAX_SUBSET_WORK = 1_500_000  # NFA edges followed by the subset construction (a few tenths of a second)
# every listed property is emitted, so "required" always holds; other keywords are refused, not ignored
KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "enum",
            "const", "minLength", "maxLength", "minimum", "maximum", "title", "description"}

RECORD_SCHEMA: dict = {  # mlsys.data's record format (its uniqueItems check is outside the subset)
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": sorted(PEOPLE)},
        "age": {"type": "integer", "minimum": 10, "maximum": 99},
        "city": {"type": "string", "enum": sorted({p.city for p in PEOPLE.values()})},
        "langs": {"type": "array", "items": {"type": "string", "enum": list(LANGS)}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "city", "langs"],
}


class SchemaError(ValueError):
    """The schema is malformed, outside the supported subset, or admits no document this subset can write."""


def check_schema(schema) -> None:
    """jsonschema's own meta-schema check (types of keywords, non-negative lengths, ...), as a SchemaError."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(map(str, e.path)) or "the root"
        raise SchemaError(f"not a valid JSON Schema: {e.message} (at {where})") from None


def _satisfies(value, schema: dict) -> bool:
    """Does `value` validate against `schema` (this node's keywords alone)? jsonschema decides."""
    return _validator(schema)(value)


def _validator(schema: dict):
    """`_satisfies` for many values of one node: the validator is built once (an enum of thousands of values)."""
    return jsonschema.validators.validator_for(schema)(schema).is_valid


def estimated_size(schema, depth: int = ANY_DEPTH) -> int:
    """At least as many NFA states plus edges as `build` makes for `schema` (within twice as many, plus a few dozen,
    except for any-value nodes, which count their depth's worst case), by arithmetic on its keywords, without
    building anything: the server refuses a schema over MAX_NFA_SIZE before spending time on it.
    Malformed nodes count as small here; `build` reports what is wrong with them."""
    if not isinstance(schema, dict):
        return 8
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        values = values if isinstance(values, list) else []
        return sum(2 * len(json.dumps(v)) + 4 for v in values) + 4
    kind, size = schema.get("type"), lambda key, default: _count(schema.get(key, default))
    if kind == "object":
        props = schema.get("properties")
        if not isinstance(props, dict):
            return _ANY_SIZE[min(max(depth, 0), ANY_DEPTH)]
        # each property: the literal ', "key": ' (2 per character) and its joins, then its value
        return sum(2 * len(json.dumps(str(k))) + 12 + estimated_size(sub, depth - 1) for k, sub in props.items()) + 8
    if kind == "array":  # without maxItems, _repeat builds minItems copies and one more inside the loop
        if type(schema.get("maxItems")) is int and schema["maxItems"] == 0:
            return 8  # only "[]"
        copies = max(size("maxItems", 1), size("minItems", 1) + ("maxItems" not in schema))
        return copies * (estimated_size(schema.get("items", {}), depth - 1) + 12) + 12
    if kind == "string":
        copies = max(size("maxLength", 1), size("minLength", 1) + ("maxLength" not in schema))
        return copies * (len(STRING_CHARS) + 8) + 12
    if kind in ("integer", "number"):
        lo, hi = schema.get("minimum", 0), schema.get("maximum")
        if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and math.isfinite(hi - lo) and hi >= lo:
            return int(hi - lo + 1) * (2 * len(str(int(hi))) + 4) + 4  # each value a literal, + the alternation
        return 64
    if kind is None and not (set(schema) - {"title", "description"}):
        return _ANY_SIZE[min(max(depth, 0), ANY_DEPTH)]
    if kind == "null":
        return 12  # build() makes 9
    return 32  # boolean (build() makes 26), or a node build() refuses


def _count(x) -> int:
    """A length or item bound as a repeat count (1 if absent, unbounded or malformed; huge stays huge)."""
    return int(x) if isinstance(x, int) and not isinstance(x, bool) and x > 1 else 1


_ANY_SIZE = (600, 3_000, 12_000)  # any JSON value at depth 0, 1, 2: measured on build(), rounded up


def _bounds(lo, hi, what: str) -> tuple[int, int | None]:
    """Integer bounds lo..hi (hi None: unbounded); a SchemaError if the range is empty."""
    if hi is not None and lo > hi:
        raise SchemaError(f"{what}: the lower bound {lo} is above the upper bound {hi}, so no value is valid")
    return lo, hi


# ------------------------------------------------------------------------------------ schema -> NFA
class NFA:
    """States are ints; edges[s] is a list of (char or None for epsilon, destination)."""

    def __init__(self) -> None:
        self.edges: list[list[tuple[str | None, int]]] = []
        self.work = 0  # edges followed by closure() and step_nfa(): what the subset construction costs

    def state(self) -> int:
        if len(self.edges) >= MAX_NFA_STATES:
            raise SchemaError(f"the schema is too large for this decoder (its automaton needs more than "
                              f"{MAX_NFA_STATES} states); lower maxLength, maxItems or the ranges")
        self.edges.append([])
        return len(self.edges) - 1

    def edge(self, src: int, dst: int, char: str | None = None) -> None:
        self.edges[src].append((char, dst))

    # fragments are (start, end) pairs; every call builds fresh states, so a fragment is used exactly once
    def chars(self, charset) -> tuple[int, int]:
        s, e = self.state(), self.state()
        for c in sorted(charset):
            self.edge(s, e, c)
        return s, e

    def literal(self, text: str) -> tuple[int, int]:
        s = cur = self.state()
        for c in text:
            nxt = self.state()
            self.edge(cur, nxt, c)
            cur = nxt
        return s, cur

    def seq(self, *frags) -> tuple[int, int]:
        for (_, e), (s, _) in zip(frags, frags[1:]):
            self.edge(e, s)
        return frags[0][0], frags[-1][1]

    def alt(self, *frags) -> tuple[int, int]:
        s, e = self.state(), self.state()
        for fs, fe in frags:
            self.edge(s, fs)
            self.edge(fe, e)
        return s, e

    def optional(self, frag) -> tuple[int, int]:
        """frag or nothing. Fresh end states, so a loop's back edge cannot be combined with the skip."""
        s, e = self.state(), self.state()
        self.edge(s, frag[0])
        self.edge(frag[1], e)
        self.edge(s, e)
        return s, e

    def loop(self, frag, sep: str = "") -> tuple[int, int]:
        """frag (sep frag)*: one or more, separated; the back edge reuses the same states."""
        s, e = frag
        back = self.literal(sep)
        self.edge(e, back[0])
        self.edge(back[1], s)
        return s, e


def _check_alphabet(text: str) -> str:
    bad = set(text) - set(ALPHABET)
    if bad:
        raise SchemaError(f"{text!r} uses {sorted(bad)}, which the tokenizer cannot write")
    return text


def _repeat(nfa: NFA, make, lo: int, hi: int | None, sep: str = "") -> tuple[int, int]:
    """lo..hi copies of make() joined by sep (hi None: unbounded); lo >= 1. Each copy is built fresh."""

    def sep_item() -> tuple[int, int]:
        return nfa.seq(nfa.literal(sep), make())

    parts = [make()] + [sep_item() for _ in range(lo - 1)]
    if hi is None:
        parts.append(nfa.optional(nfa.loop(sep_item())))  # (sep item)*
        return nfa.seq(*parts)
    # up to hi - lo optional copies, each with an epsilon exit to one shared end state: after any copy the
    # document may go on or leave. (A chain of separate optionals would make every exit pass through all the
    # later ones: epsilon closures of length hi, and a subset construction quadratic in maxLength.)
    body, end = nfa.seq(*parts), nfa.state()
    cur = body[1]
    for _ in range(hi - lo):
        nfa.edge(cur, end)
        item = sep_item()
        nfa.edge(cur, item[0])
        cur = item[1]
    nfa.edge(cur, end)
    return body[0], end


# --8<-- [start:compile]
def build(nfa: NFA, schema: dict | bool, depth: int = ANY_DEPTH) -> tuple[int, int]:
    """The NFA fragment of one schema node (canonical json.dumps layout)."""
    if schema is True:
        schema = {}
    if schema is False:
        raise SchemaError("the schema `false` admits no value")
    if set(schema) - KEYWORDS:
        raise SchemaError(f"keywords outside the supported subset: {sorted(set(schema) - KEYWORDS)}")
    if "const" in schema:
        if not _satisfies(schema["const"], schema):
            raise SchemaError(f"const {schema['const']!r} contradicts the other keywords of {schema}")
        return nfa.literal(_check_alphabet(json.dumps(schema["const"])))
    if "enum" in schema:  # alternation of literals; subset construction turns it into a trie
        # each value against the other keywords (validating the enum too would compare every pair: quadratic)
        valid = _validator({k: v for k, v in schema.items() if k != "enum"})
        values = [v for v in schema["enum"] if valid(v)]  # e.g. strings under type: integer
        if not values:
            raise SchemaError(f"no value of the enum satisfies the other keywords of {schema}")
        return nfa.alt(*(nfa.literal(_check_alphabet(json.dumps(v))) for v in values))
    kind = schema.get("type")
    if kind == "object":
        if "properties" not in schema and schema.get("additionalProperties", True) is not False:
            return _free_object(nfa, depth)  # {"type": "object"}: any object (OpenAI's json_object mode)
        props = schema.get("properties", {})
        unlisted = [k for k in schema.get("required", []) if k not in props]
        if unlisted:
            raise SchemaError(f"required names {unlisted}, which properties does not list (this subset writes "
                              "exactly the listed properties)")
        parts = [nfa.literal("{")]
        for i, (key, sub) in enumerate(props.items()):  # '{"key": value, "key2": value}'
            parts += [nfa.literal(("," + " " if i else "") + _check_alphabet(json.dumps(key)) + ": "),
                      build(nfa, sub, depth - 1)]
        return nfa.seq(*parts, nfa.literal("}"))
    if kind == "array":
        lo, hi = _bounds(schema.get("minItems", 0), schema.get("maxItems"), "minItems/maxItems")
        if hi == 0 or (schema.get("items") is False and lo == 0):  # `items: false`: only the empty array
            return nfa.literal("[]")
        items = _repeat(nfa, lambda: build(nfa, schema.get("items", {}), depth - 1), max(lo, 1), hi, ", ")
        items = nfa.optional(items) if lo == 0 else items
        return nfa.seq(nfa.literal("["), items, nfa.literal("]"))
    if kind == "string":
        lo, hi = _bounds(schema.get("minLength", 0), schema.get("maxLength"), "minLength/maxLength")
        if hi == 0:
            return nfa.literal('""')
        body = _repeat(nfa, lambda: nfa.chars(STRING_CHARS), max(lo, 1), hi)
        body = nfa.optional(body) if lo == 0 else body
        return nfa.seq(nfa.literal('"'), body, nfa.literal('"'))
    if kind in ("integer", "number"):  # only integers are written: the alphabet has no "."
        lo = math.ceil(schema.get("minimum", 0))
        hi = math.floor(schema["maximum"]) if "maximum" in schema else None
        if lo < 0:
            raise SchemaError("negative numbers need '-', which is not in the tokenizer's alphabet")
        lo, hi = _bounds(lo, hi, "minimum/maximum (integers)")
        if hi is not None and hi - lo <= 10_000:  # a small range: every value, as a trie
            return nfa.alt(*(nfa.literal(str(v)) for v in range(lo, hi + 1)))
        if lo > 0 or hi is not None:
            raise SchemaError("integer bounds are supported for ranges of at most 10,000 values")
        return nfa.alt(nfa.literal("0"), nfa.seq(nfa.chars(NONZERO), nfa.optional(nfa.loop(nfa.chars(DIGITS)))))
    if kind == "boolean":
        return nfa.alt(nfa.literal("true"), nfa.literal("false"))
    if kind == "null":
        return nfa.literal("null")
    if kind is None and not (set(schema) - {"title", "description"}):
        return _any(nfa, depth)
    raise SchemaError(f"schema node outside the supported subset: {schema}")


def _any(nfa: NFA, depth: int) -> tuple[int, int]:
    """Any JSON value over the alphabet (strings, non-negative integers, true/false/null), depth-limited."""
    scalars = [build(nfa, {"type": t}) for t in ("string", "integer", "boolean", "null")]
    if depth <= 0:
        return nfa.alt(*scalars)
    arr = nfa.seq(nfa.literal("["), nfa.optional(nfa.loop(_any(nfa, depth - 1), ", ")), nfa.literal("]"))
    return nfa.alt(*scalars, _free_object(nfa, depth), arr)


def _free_object(nfa: NFA, depth: int) -> tuple[int, int]:
    """An object with any keys, its values any JSON value (depth-limited)."""
    if depth <= 0:
        return nfa.literal("{}")
    pair = nfa.seq(build(nfa, {"type": "string"}), nfa.literal(": "), _any(nfa, depth - 1))
    return nfa.seq(nfa.literal("{"), nfa.optional(nfa.loop(pair, ", ")), nfa.literal("}"))
# --8<-- [end:compile]


# ------------------------------------------------------------------------------------ NFA -> DFA -> tables
def closure(nfa: NFA, states) -> frozenset[int]:
    """Every state reachable from `states` by epsilon edges alone."""
    seen, todo = set(states), list(states)
    while todo:
        edges = nfa.edges[todo.pop()]
        nfa.work += len(edges)
        for char, dst in edges:
            if char is None and dst not in seen:
                seen.add(dst)
                todo.append(dst)
    return frozenset(seen)


def step_nfa(nfa: NFA, states: frozenset[int], char: str) -> frozenset[int]:
    nfa.work += sum(len(nfa.edges[s]) for s in states)
    return closure(nfa, {dst for s in states for c, dst in nfa.edges[s] if c == char})


# --8<-- [start:min_to_close]
def min_tokens_to_close(trans: list[dict[str, int]], accepting: set[int]) -> list[int]:
    """dist[s]: fewest characters from DFA state s to an accepting state (INF if none).

    Breadth-first search on the reversed edges, starting from all accepting states at distance 0."""
    rev: list[list[int]] = [[] for _ in trans]
    for s, edges in enumerate(trans):
        for dst in edges.values():
            rev[dst].append(s)
    dist = [INF] * len(trans)
    queue = deque(accepting)
    for s in accepting:
        dist[s] = 0
    while queue:
        s = queue.popleft()
        for prev in rev[s]:
            if dist[prev] == INF:
                dist[prev] = dist[s] + 1
                queue.append(prev)
    return dist
# --8<-- [end:min_to_close]


class SchemaFSM:
    """The compiled automaton of one schema, with its token tables."""

    def __init__(self, schema: dict, tokenizer: Tokenizer | None = None):
        self.schema, self.tok = schema, tokenizer or Tokenizer()
        self.compiled_in = os.getpid()  # the process that built it (a server compiles in worker processes)
        check_schema(schema)
        if estimated_size(schema) > MAX_NFA_SIZE:
            raise SchemaError(f"the schema is too large for this decoder (its automaton would need about "
                              f"{estimated_size(schema):,} states and edges, more than {MAX_NFA_SIZE:,}); lower "
                              "maxLength, maxItems, the ranges or the enums")
        self.nfa = NFA()
        start, self.nfa_accept = build(self.nfa, schema)
        self.nfa_start = closure(self.nfa, {start})
        self._determinize()
        self.dist = min_tokens_to_close(self.trans, self.accepting)
        # A guard: build() raises for a node with no value (an empty enum, `false`, an empty range), and every
        # fragment it returns has a path from its start to its end, so today dist[0] is always finite.
        if self.dist[0] >= INF:
            raise SchemaError(f"no document satisfies the schema within the supported subset: {schema}")
        self.nfa_dist = self._nfa_distances()
        self._tables()

    def _determinize(self) -> None:
        """Subset construction: DFA state i is the set of NFA states self.subsets[i]."""
        index = {self.nfa_start: 0}
        self.subsets, self.trans = [self.nfa_start], [{}]
        queue = deque([self.nfa_start])
        while queue:
            cur = queue.popleft()
            for char in sorted({c for s in cur for c, _ in self.nfa.edges[s] if c is not None}):
                if self.nfa.work > MAX_SUBSET_WORK:
                    raise SchemaError("the schema is too large for this decoder (compiling it would take too "
                                      "long); lower maxLength, maxItems or the ranges")
                nxt = step_nfa(self.nfa, cur, char)
                if nxt not in index:
                    index[nxt] = len(self.subsets)
                    self.subsets.append(nxt)
                    self.trans.append({})
                    queue.append(nxt)
                self.trans[index[cur]][char] = index[nxt]
        self.accepting = {i for i, sub in enumerate(self.subsets) if self.nfa_accept in sub}

    # --8<-- [start:tables]
    def _tables(self) -> None:
        """next_state (S, V) long, -1 = illegal; cost (S, V) = 1 + dist[next] (INF if illegal);
        accepts (S,) bool. Built once per schema; decoding then only indexes rows."""
        S, V = len(self.trans), self.tok.vocab_size
        self.next_state = torch.full((S, V), -1, dtype=torch.long)
        for s, edges in enumerate(self.trans):
            for char, dst in edges.items():
                self.next_state[s, self.tok.stoi[char]] = dst
        dist = torch.tensor(self.dist + [INF], dtype=torch.long)  # index -1 -> the INF sentinel
        self.cost = torch.where(self.next_state >= 0, 1 + dist[self.next_state], INF)  # (S, V)
        self.accepts = torch.tensor([s in self.accepting for s in range(S)])
        self.next_state_list = self.next_state.tolist()  # the same table as lists: a cheap lookup per token

    def mask(self, state: int, remaining: int) -> torch.Tensor:
        """(V,) bool: tokens allowed in `state` with `remaining` tokens of budget left."""
        allowed = self.cost[state] <= remaining  # legal AND can still close in time
        allowed[self.tok.eos_id] = bool(self.accepts[state])
        return allowed
    # --8<-- [end:tables]

    @property
    def start(self) -> int:
        return 0

    @property
    def min_length(self) -> int:
        """The shortest valid document, in tokens: the smallest budget that can close."""
        return self.dist[0]

    def mask_by_scanning(self, nfa_states: frozenset[int], remaining: int) -> torch.Tensor:
        """The same mask with no tables: try every token on the NFA, as an interpreting parser would."""
        allowed = torch.zeros(self.tok.vocab_size, dtype=torch.bool)
        for v, text in enumerate(self.tok.itos):
            if v == self.tok.eos_id:
                allowed[v] = self.nfa_accept in nfa_states
            elif len(text) == 1:  # a character token (the specials <pad>, <bos> are never allowed)
                nxt = step_nfa(self.nfa, nfa_states, text)
                allowed[v] = bool(nxt) and 1 + min(self.nfa_dist[s] for s in nxt) <= remaining
        return allowed

    def _nfa_distances(self) -> list[int]:
        """Fewest characters from each NFA state to the accepting one: 0-1 BFS on reversed edges
        (epsilon edges cost 0, character edges 1). Per NFA state, not per token."""
        rev: list[list[tuple[int, int]]] = [[] for _ in self.nfa.edges]
        for s, edges in enumerate(self.nfa.edges):
            for char, dst in edges:
                rev[dst].append((s, 0 if char is None else 1))
        dist = [INF] * len(self.nfa.edges)
        dist[self.nfa_accept] = 0
        queue = deque([self.nfa_accept])
        while queue:
            s = queue.popleft()
            for prev, w in rev[s]:
                if dist[s] + w < dist[prev]:
                    dist[prev] = dist[s] + w
                    queue.appendleft(prev) if w == 0 else queue.append(prev)
        return dist

    def nbytes(self) -> int:
        """How much memory this automaton holds (tables, lists, the NFA and the subsets), estimated from above with
        CPython 3.11's object sizes, for a cache bounded in bytes. Tests compare it with tracemalloc."""
        S, V = self.next_state.shape
        tables = 2 * self.next_state.nbytes + S  # next_state, cost, accepts
        rows = S * (56 + 8 * V) + 32 * sum(x > 256 for row in self.next_state_list for x in row)  # the list copy
        nfa = 64 * len(self.nfa.edges) + 104 * sum(map(len, self.nfa.edges))  # lists, (char, dst) tuples, ints
        subsets = 216 * S + 48 * sum(map(len, self.subsets))
        trans = 232 * S + 24 * sum(map(len, self.trans))
        return int(tables + rows + nfa + subsets + trans)

    def walk(self, text: str) -> int:
        """The DFA state after `text` from the start (KeyError if the text leaves the language)."""
        state = self.start
        for char in text:
            state = self.trans[state][char]
        return state

    def accepts_text(self, text: str) -> bool:
        try:
            return self.walk(text) in self.accepting
        except KeyError:
            return False


def compile_schema(schema: dict) -> SchemaFSM:
    return SchemaFSM(schema)


class SchemaBusy(RuntimeError):
    """Too many other schemas are being compiled right now: try again shortly (a server answers 429)."""


class SchemaCache:
    """Compiled automata by schema, for a server that compiles whatever schemas its clients send.

    - bounded in bytes (SchemaFSM.nbytes), least recently used first out: a few large schemas cannot fill memory;
    - refusals are remembered too (the message, by schema text), so resending a schema that failed costs nothing;
    - one compile per schema at a time: threads asking for a schema being compiled wait for that compile's
      result instead of starting their own (twelve copies of one expensive schema cost one compile);
    - at most `max_compiling` different schemas compile at once; one more raises SchemaBusy at once, so a burst
      of new schemas cannot take every thread (or the GIL) from the requests that need none.
    `get` returns the automaton or raises SchemaError (or SchemaBusy). Thread-safe."""

    def __init__(self, tokenizer: Tokenizer | None = None, max_bytes: int = 256 << 20,
                 max_refusals: int = 1024, max_compiling: int = 2, in_processes: bool = False) -> None:
        self.tok, self.max_bytes, self.max_refusals = tokenizer, max_bytes, max_refusals
        self.max_compiling, self.in_processes = max_compiling, in_processes
        self._pool = None  # with in_processes: max_compiling worker processes, started on the first compile
        self._fsms: dict[str, tuple[SchemaFSM, int]] = {}  # key -> (automaton, bytes); most recent last
        self._refused: dict[str, str] = {}  # key -> the SchemaError's message; most recent last
        self._building: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.compiles = 0  # automata built (or attempted): what the cache saved is the calls minus these

    def get(self, schema: dict, limit: bool = True) -> SchemaFSM:
        """The automaton of `schema`; limit=False compiles even past max_compiling (the engine's own thread, for a
        request already admitted whose automaton has since left the cache)."""
        key = json.dumps(schema, sort_keys=True)
        while True:
            with self._lock:
                if key in self._refused:
                    raise SchemaError(self._refused[key])
                if key in self._fsms:
                    self._fsms[key] = self._fsms.pop(key)  # most recently used last
                    return self._fsms[key][0]
                building = self._building.get(key)
                if building is None and limit and len(self._building) >= self.max_compiling:
                    raise SchemaBusy(f"{len(self._building)} other schemas are being compiled; retry shortly")
                if building is None:
                    self._building[key] = threading.Event()
                    self.compiles += 1
                    break
            building.wait()  # another thread compiles this schema: take its result (or refusal) when it is done
        try:
            fsm = self._compile(schema)
        except (SchemaError, RecursionError) as err:
            message = str(err) if isinstance(err, SchemaError) else "the schema is nested too deeply"
            with self._lock:
                self._refused[key] = message
                while len(self._refused) > self.max_refusals:
                    self._refused.pop(next(iter(self._refused)))
            raise SchemaError(message) from None
        finally:
            with self._lock:
                self._building.pop(key).set()
        size = fsm.nbytes()
        with self._lock:
            self._fsms[key] = (fsm, size)
            self.nbytes += size
            while self.nbytes > self.max_bytes and len(self._fsms) > 1:  # the newest stays, even if alone too big
                _, old = self._fsms.pop(next(iter(self._fsms)))
                self.nbytes -= old
        return fsm

    def _compile(self, schema: dict) -> SchemaFSM:
        """In this thread, or with in_processes in a worker process: compiling is pure Python, and a thread of
        the server's own process would hold the GIL against the engine thread, whose every torch call must win it
        back (a compile of a few tenths of a second slowed a 4-token request 70-fold). The automaton comes back
        pickled; a worker process that died is replaced, and the request told to retry."""
        if not self.in_processes or estimated_size(schema) > MAX_NFA_SIZE:  # a refusal from keywords: here, at once
            return SchemaFSM(schema, self.tok)
        from concurrent.futures import ProcessPoolExecutor
        from concurrent.futures.process import BrokenProcessPool

        with self._lock:
            if self._pool is None:
                import multiprocessing as mp

                self._pool = ProcessPoolExecutor(self.max_compiling, mp_context=mp.get_context("forkserver"))
            pool = self._pool
        try:
            future = pool.submit(_compile_in_worker, schema, self.tok)
        except (RuntimeError, OSError) as err:  # no process can start here: compile in this thread instead
            print(f"[mlsys] schema worker processes unavailable ({err}); compiling in threads", file=sys.stderr)
            self.in_processes = False
            return SchemaFSM(schema, self.tok)
        try:
            return future.result()
        except BrokenProcessPool:
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise SchemaBusy("the schema compiler restarted; retry") from None

    def close(self) -> None:
        """Stop the worker processes, if any (a server's shutdown)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _compile_in_worker(schema: dict, tok: Tokenizer | None) -> SchemaFSM:
    return SchemaFSM(schema, tok)


# --8<-- [start:decode]
@torch.no_grad()
def constrained_generate(model, fsm: SchemaFSM, max_tokens: int, prompt: list[int] | None = None,
                         temperature: float = 0.0, generator: torch.Generator | None = None,
                         use_tables: bool = True) -> str:
    """Decode at most max_tokens tokens of JSON text (then <eos>, not counted), masked by the schema's FSM."""
    if max_tokens < fsm.min_length:
        raise ValueError(f"max_tokens={max_tokens} is below the shortest valid document ({fsm.min_length})")
    tok = fsm.tok
    prompt = prompt or [tok.bos_id]
    cache = model.new_kv_cache(1, len(prompt) + max_tokens + 1)
    logits, _ = model(torch.tensor([prompt]), kv_cache=cache)  # prefill: (1, T0, V)
    state, nfa_states, out = fsm.start, fsm.nfa_start, []
    for remaining in range(max_tokens, -1, -1):  # tokens of JSON text still allowed
        allowed = fsm.mask(state, remaining) if use_tables else fsm.mask_by_scanning(nfa_states, remaining)
        masked = logits[0, -1].masked_fill(~allowed, float("-inf"))  # (V,)
        if temperature == 0.0:
            nxt = int(masked.argmax())
        else:
            nxt = int(torch.multinomial(torch.softmax(masked / temperature, -1), 1, generator=generator))
        if nxt == tok.eos_id:
            break
        out.append(nxt)
        state = int(fsm.next_state[state, nxt])
        if remaining == 1:  # budget spent; the mask guaranteed that state accepts
            break
        if not use_tables:
            nfa_states = step_nfa(fsm.nfa, nfa_states, tok.itos[nxt])
        logits, _ = model(torch.tensor([[nxt]]), kv_cache=cache, start_pos=len(prompt) + len(out) - 1)
    return tok.decode(out)
# --8<-- [end:decode]


if __name__ == "__main__":
    fsm = compile_schema(RECORD_SCHEMA)
    print(f"record schema: {len(fsm.nfa.edges)} NFA states -> {len(fsm.trans)} DFA states, "
          f"shortest document {fsm.min_length} tokens")
