"""JSON-constrained decoding: a schema's automaton masks the real model's logits, for every token budget.

What it shows (numbered as the output is)
    0. A toy schema (an enum of three names) compiled to its DFA and drawn whole, every state with dist[s] (the
       fewest characters that still close a document), with the path of the real model's masked output
       (automaton.png).
    1. The record schema (mlsys.json_constrained.RECORD_SCHEMA) compiled to an NFA, then a DFA; the shortest
       valid document, i.e. the smallest budget that can close; and a walk through a few prefixes printing the
       allowed next characters and the minimum number of tokens still needed to close from there.
    2. Sampling at temperature 1 from the trained 'small' model under several token budgets, with the mask and
       without it (plain sampling, cut at the budget): the share of outputs that parse (json.loads) and that
       validate (jsonschema). With the mask it is 100% for every budget, down to the shortest document; every
       output is checked, the run fails otherwise. The same for the schema-free "any JSON" automaton and for a
       schema the model never saw in training.
    3. The cost of the mask per token: one row lookup in the precomputed token tables against trying every
       token on the NFA (what an interpreting parser does), next to the model's own forward time. Both give the
       same mask (checked on every state the decodes visit).
    Figures: valid share against the budget, with and without the mask (validity_vs_budget.png); the mask
    itself along two real masked outputs, at the tightest budget and at the largest (mask.png).

How to run
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/constrained_decoding.py
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/constrained_decoding.py --num-samples 40

Runtime on 2 cores: about 7 s, 5 s with --smoke.

Try next
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/constrained_decoding.py --temperature 2
        -> a hot sampler that picks unlikely characters: expect the masked outputs still all to validate and
           the unmasked ones to fail more often (the two printed examples, drawn with the same seeds, can match the
           temperature-1 ones: where the model is nearly sure, the same draw picks the same character)
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/constrained_decoding.py --temperature 0
        -> greedy: every sample of a budget is the same document, and it validates
    python tutorial/part3-inference/chapter11-speculative-constrained/scripts/constrained_decoding.py --num-samples 40
        -> five times the samples per budget: the validity curves in the figure get smoother; the run takes
           several times as long as the default run
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import jsonschema
import torch

from mlsys import bench, cli, plot, report
from mlsys.data import Tokenizer, is_consistent_record, is_valid_record
from mlsys.json_constrained import RECORD_SCHEMA, SchemaFSM, constrained_generate, step_nfa
from mlsys.model import generate
from mlsys.weights import load_pretrained

OTHER_SCHEMA: dict = {  # fields the training data never had: the mask forces the format, the model fills it in
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["london", "paris", "tokyo"]},
        "visits": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 2},
    },
    "required": ["city", "visits", "ok", "tags"],
}


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    num_samples: int = 8
    """Samples per budget, each with its own seed."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy)."""

    def validate(self) -> None:
        if self.num_samples < 1:
            raise cli.UsageError(f"--num-samples must be >= 1, got {self.num_samples}")
        if not 0.0 <= self.temperature <= 5.0:
            raise cli.UsageError(f"--temperature must be in 0..5, got {self.temperature}")


TOY_SCHEMA: dict = {"enum": ["ada", "alan", "bob"]}  # small enough to draw every state of its automaton


def automaton_graph(fsm: SchemaFSM) -> dict:
    """Every DFA state with the shortest text that reaches it, dist[s] and whether it accepts; every edge."""
    prefix, order, queue = {fsm.start: ""}, [], [fsm.start]
    while queue:  # breadth-first from the start: prefix[s] is a shortest text leading to s
        s = queue.pop(0)
        order.append(s)
        for char, dst in sorted(fsm.trans[s].items()):
            if dst not in prefix:
                prefix[dst] = prefix[s] + char
                queue.append(dst)
    nodes = [{"state": s, "prefix": prefix[s], "dist": fsm.dist[s], "accepting": s in fsm.accepting} for s in order]
    edges = [[s, dst, char] for s in order for char, dst in sorted(fsm.trans[s].items())]
    return {"nodes": nodes, "edges": edges}


def draw_automaton(model, args: Settings) -> dict:
    """The toy schema's whole DFA, with the path of one real greedy masked output after '{"name": ' highlighted.
    Returns what it drew (nodes, edges, the generated text and the states it went through)."""
    plt = plot.pyplot()
    fsm = SchemaFSM(TOY_SCHEMA)
    tok = fsm.tok
    text = constrained_generate(model, fsm, fsm.min_length + 4, prompt=tok.encode('{"name": ', bos=True))
    path = [fsm.start]
    for char in text:
        path.append(fsm.trans[path[-1]][char])
    graph = automaton_graph(fsm)
    depth = {n["state"]: len(n["prefix"]) for n in graph["nodes"]}
    children: dict[int, list[int]] = {}
    for n in graph["nodes"][1:]:  # the breadth-first tree: each state under the state its prefix came through
        parent = fsm.walk(n["prefix"][:-1])
        children.setdefault(parent, []).append(n["state"])
    ypos, leaf = {}, [0]

    def place(s: int) -> float:  # leaves one row apart, a parent in the middle of its children
        kids = children.get(s, [])
        ypos[s] = sum(place(c) for c in kids) / len(kids) if kids else leaf[0]
        if not kids:
            leaf[0] += 1
        return ypos[s]

    place(fsm.start)
    on_path = set(zip(path, path[1:]))
    fig, ax = plt.subplots(figsize=(1.1 * max(depth.values()) + 2, 1.0 * leaf[0] + 1.2))
    for src, dst, char in graph["edges"]:
        hot = (src, dst) in on_path
        ax.annotate("", xy=(depth[dst], ypos[dst]), xytext=(depth[src], ypos[src]),
                    arrowprops={"arrowstyle": "->", "color": "#e6550d" if hot else "#888888", "lw": 2.4 if hot else 1,
                                "shrinkA": 13, "shrinkB": 13})
        ax.text((depth[src] + depth[dst]) / 2, (ypos[src] + ypos[dst]) / 2 - 0.12, char, ha="center", va="bottom",
                fontsize=10, family="monospace", color="#e6550d" if hot else "black")
    for n in graph["nodes"]:
        s, x, y = n["state"], depth[n["state"]], ypos[n["state"]]
        ax.scatter([x], [y], s=520, facecolor="#fdd0a2" if s in path else "#deebf7", edgecolor="black", zorder=3)
        if n["accepting"]:
            ax.scatter([x], [y], s=300, facecolor="none", edgecolor="black", zorder=4)
        ax.text(x, y, str(s), ha="center", va="center", fontsize=8, zorder=5)
        ax.text(x, y + 0.3, f"dist {n['dist']}", ha="center", va="top", fontsize=7, color="#555555")
    ax.set_xlim(-0.6, max(depth.values()) + 0.6)
    ax.set_ylim(leaf[0] - 0.3, -0.7)
    ax.axis("off")
    ax.set_title(f"DFA of {json.dumps(TOY_SCHEMA)}: {len(fsm.trans)} states (double circle: accepting, "
                 f"<eos> allowed);\norange: the path of the model's masked output {text} after '{{\"name\": '",
                 fontsize=9)
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'automaton')}")
    return {"schema": TOY_SCHEMA, "text": text, "path": path, **graph}


def allowed_text(fsm: SchemaFSM, state: int, remaining: int) -> str:
    tok = fsm.tok
    chars = [tok.itos[v] if v != tok.eos_id else "<eos>" for v in fsm.mask(state, remaining).nonzero().flatten()]
    return "".join(chars) if len(chars) <= 12 else f"{len(chars)} characters"


def walk_demo(fsm: SchemaFSM) -> list[dict]:
    """Allowed next characters after a few prefixes of a record, with plenty of budget and with just enough."""
    rows = []
    for prefix in ['', '{"name": "', '{"name": "b', '{"name": "bjarne", "age": ', '{"name": "bjarne", "age": 7',
                   '{"name": "ada", "age": 34, "city": "london", "langs": ["c"']:
        s = fsm.walk(prefix)
        left = fsm.dist[s]
        shown = prefix[-24:].removesuffix(" ") + ("\u2420" if prefix.endswith(" ") else "")  # a visible space
        rows.append({"after": shown or "(start)", "min to close": left,
                     "allowed (budget 100)": allowed_text(fsm, s, 100 - len(prefix)),
                     "allowed (budget = just enough)": allowed_text(fsm, s, left)})
    return rows


def unconstrained(model, budget: int, temperature: float, seed: int) -> str:
    """Plain sampling from <bos>: stop at <eos> or when the budget is spent (the text is then cut)."""
    g = torch.Generator().manual_seed(seed)
    tok = Tokenizer()
    out = generate(model, torch.tensor([[tok.bos_id]]), budget + 1, temperature, generator=g, eos_id=tok.eos_id)
    ids = out[0, 1:].tolist()
    return tok.decode(ids[: ids.index(tok.eos_id)] if tok.eos_id in ids else ids[:budget])


def validity(texts: list[str], schema: dict) -> tuple[float, float]:
    """(share that json.loads parses, share that also validates against the schema)."""
    parsed = valid = 0
    for text in texts:
        try:
            value = json.loads(text)
        except ValueError:
            continue
        parsed += 1
        valid += jsonschema.Draft202012Validator(schema).is_valid(value)
    return parsed / len(texts), valid / len(texts)


# --8<-- [start:sweep]
def budget_sweep(model, fsm: SchemaFSM, budgets, args: Settings, baseline: bool = True) -> tuple[list[dict], list]:
    """For each budget: constrained samples (every one must parse, validate and fit) and plain ones."""
    rows, examples = [], []
    for budget in budgets:
        texts = []
        for i in range(args.num_samples):
            g = torch.Generator().manual_seed(args.seed * 1000 + i)
            text = constrained_generate(model, fsm, budget, temperature=args.temperature, generator=g)
            jsonschema.validate(json.loads(text), fsm.schema)  # raises on any invalid output
            report.expect_equal(f"output within budget {budget}", len(text) <= budget, True)
            texts.append(text)
        row = {"budget": budget, "masked valid %": 100 * validity(texts, fsm.schema)[1]}
        if fsm.schema is RECORD_SCHEMA:  # the data module's own checks: unique langs, the learned facts
            row["is_valid_record %"] = 100 * sum(map(is_valid_record, texts)) / len(texts)
            row["consistent %"] = 100 * sum(map(is_consistent_record, texts)) / len(texts)
        if baseline:
            plain = [unconstrained(model, budget, args.temperature, args.seed * 1000 + i)
                     for i in range(args.num_samples)]
            row["plain parses %"], row["plain valid %"] = (100 * x for x in validity(plain, fsm.schema))
        rows.append(row)
        examples.append(texts[0])
    return rows, examples
# --8<-- [end:sweep]


# --8<-- [start:overhead]
def mask_overhead(model, fsm: SchemaFSM, budget: int, seed: int) -> dict:
    """Per-token seconds: table lookup vs scanning the vocabulary on the NFA vs one model forward."""
    g = torch.Generator().manual_seed(seed)
    text = constrained_generate(model, fsm, budget, temperature=1.0, generator=g)
    states, nfa_sets, state, nfa_states = [], [], fsm.start, fsm.nfa_start
    for ch in text:  # the states a real decode visits, in both representations
        states.append(state)
        nfa_sets.append(nfa_states)
        state, nfa_states = fsm.trans[state][ch], step_nfa(fsm.nfa, nfa_states, ch)
    table_t, scan_t = [], []
    fsm.mask(states[0], budget), fsm.mask_by_scanning(nfa_sets[0], budget)  # warm-up
    with bench.steady_timing():  # no garbage-collector pass inside a timed call
        for i, (s, ns) in enumerate(zip(states, nfa_sets)):
            t0 = time.perf_counter()
            a = fsm.mask(s, budget - i)
            t1 = time.perf_counter()
            b = fsm.mask_by_scanning(ns, budget - i)
            t2 = time.perf_counter()
            report.expect_equal(f"table mask == scanned mask at token {i}", a.tolist(), b.tolist())
            table_t.append(t1 - t0)
            scan_t.append(t2 - t1)
        cache = model.new_kv_cache(1, 32)
        fwd = []
        with torch.no_grad():
            for pos in range(32):
                t0 = time.perf_counter()
                model(torch.tensor([[3]]), kv_cache=cache, start_pos=pos)
                fwd.append(time.perf_counter() - t0)
    out = {"tokens": len(states), "table_s": statistics.median(table_t), "scan_s": statistics.median(scan_t),
           "forward_s": statistics.median(fwd)}
    return {**out, "scan_over_table": out["scan_s"] / out["table_s"], "table_share": out["table_s"] / out["forward_s"],
            "scan_share": out["scan_s"] / out["forward_s"]}
# --8<-- [end:overhead]


def draw(rows: list[dict], args: Settings) -> None:
    plt = plot.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    budgets = [r["budget"] for r in rows]
    ax.plot(budgets, [r["masked valid %"] for r in rows], "o-", label="with the schema mask")
    ax.plot(budgets, [r["plain valid %"] for r in rows], "x--", label="plain sampling, cut at the budget")
    ax.set(xlabel="token budget (max_tokens)", ylabel="outputs valid against the schema (%)", ylim=(-5, 105),
           title="Record schema, temperature " + str(args.temperature))
    ax.legend(fontsize=8)
    print(f"figure: {plot.save(fig, args, 'validity_vs_budget')}")


def draw_masks(fsm: SchemaFSM, outputs: list[tuple[int, str]], args: Settings) -> list[dict]:
    """The mask at every position of real outputs: vocabulary (rows) x position (columns); light = allowed,
    dark = the character the model chose. Returns, per output, how many positions allowed one token only."""
    plt = plot.pyplot()
    from matplotlib.colors import ListedColormap

    tok = fsm.tok
    # tall enough that each of the vocabulary's rows gets its own readable label (about 9 pt per row)
    fig, axes = plt.subplots(len(outputs), 1, figsize=(13, 0.125 * tok.vocab_size * len(outputs) + 1.2))
    forced = []
    for ax, (budget, text) in zip(axes, outputs):
        ids = tok.encode(text) + [tok.eos_id]
        grid = torch.zeros(tok.vocab_size, len(ids))
        for i, chosen in enumerate(ids):
            grid[:, i] = fsm.mask(fsm.walk(text[:i]), budget - i).float()
            grid[chosen, i] = 2
        forced.append({"budget": budget, "positions": len(ids), "one_choice": int(((grid > 0).sum(0) == 1).sum())})
        ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(["white", "#9ecae1", "#08306b"]))
        ax.set_xticks(range(len(ids)), [c if c != " " else "\u2423" for c in text] + ["$"], fontsize=7,
                      family="monospace")
        ax.set_yticks(range(tok.vocab_size), [t.replace(" ", "\u2423") if len(t) == 1 else t.strip("<>")[:3]
                                              for t in tok.itos], fontsize=6.5, family="monospace")
        ax.grid(False)
        ax.set(ylabel="next token", title=f"budget {budget}: {forced[-1]['one_choice']} of {len(ids)} positions "
                                          "allow exactly one token (light: allowed, dark: chosen; $ = <eos>)")
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'mask')}")
    return forced


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"num_samples": 2})
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = load_pretrained("small")

    # 0. a toy automaton, drawn whole
    toy = draw_automaton(model, args)
    print(f"0. toy schema {json.dumps(TOY_SCHEMA)}: {len(toy['nodes'])} DFA states, {len(toy['edges'])} edges; "
          f"after '{{\"name\": ' the masked model wrote {toy['text']}, through states {toy['path']}\n")

    # 1. the automaton
    t0 = time.perf_counter()
    fsm = SchemaFSM(RECORD_SCHEMA)
    compile_s = time.perf_counter() - t0
    print(f"1. record schema -> {len(fsm.nfa.edges)} NFA states -> {len(fsm.trans)} DFA states, token tables "
          f"{tuple(fsm.next_state.shape)} (compiled in {1e3 * compile_s:.0f} ms); shortest document: "
          f"{fsm.min_length} tokens")
    print("   " + report.table(walk_demo(fsm)).replace("\n", "\n   ") + "\n")

    # 2. budgets: masked vs plain
    lo = fsm.min_length
    budgets = [lo, lo + 5, 70, 80, 100] if not args.smoke else [lo, 90]
    rows, examples = budget_sweep(model, fsm, budgets, args)
    print(f"2. {args.num_samples} samples per budget at temperature {args.temperature}, record schema "
          "(every masked output parsed and validated: checked)")
    print("   " + report.table(rows, floatfmt=".0f").replace("\n", "\n   "))
    print(f"   at the tightest budget ({lo}): {examples[0]}\n   at {budgets[-1]}: {examples[-1]}")
    forced = draw_masks(fsm, [(lo, examples[0]), (budgets[-1], examples[-1])], args)
    extra = {}
    for name, schema, budgets2 in (("any JSON", {}, [1, 2, 12, 40]), ("other schema", OTHER_SCHEMA, [None, 60])):
        other = SchemaFSM(schema)
        budgets2 = [b or other.min_length for b in budgets2]
        rows2, ex2 = budget_sweep(model, other, budgets2, args, baseline=False)
        extra[name] = {"dfa_states": len(other.trans), "rows": rows2, "examples": ex2}
        print(f"   {name}: {len(other.trans)} DFA states, valid at budgets {budgets2}: "
              f"{[r['masked valid %'] for r in rows2]} %; e.g. {ex2[-1]}")

    # 3. the mask's cost
    cost = mask_overhead(model, fsm, 80, args.seed)
    print(f"\n3. mask per token, median over the {cost['tokens']} tokens of one decode: token tables "
          f"{1e6 * cost['table_s']:.1f} us, scanning every token on the NFA {1e6 * cost['scan_s']:.0f} us "
          f"({cost['scan_over_table']:.0f}x); one model forward {1e6 * cost['forward_s']:.0f} us, so the "
          f"tables add {100 * cost['table_share']:.1f}% and scanning {100 * cost['scan_share']:.0f}% per token "
          f"(masks identical: checked); {bench.load_average()}")

    draw(rows, args)
    if args.json:
        results = {"nfa_states": len(fsm.nfa.edges), "dfa_states": len(fsm.trans), "min_length": fsm.min_length,
                   "rows": rows, "examples": examples, "other": extra, "mask_cost": cost,
                   "forced": forced, "toy": toy,
                   "load_average": bench.load_average()}
        report.write_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
