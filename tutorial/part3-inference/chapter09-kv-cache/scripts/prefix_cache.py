"""Prefix caching with the engine's radix tree: a shared system prompt, served with and without the cache.

What it shows
    1. A workload where every request starts with the same few-shot "system prompt" (--shots records of the
       training format) and ends with its own question: <bos> and the start of a new record up to the first
       letter of a name, e.g. '<bos>{"name": "k', which the model completes. Requests arrive one per engine step.
       Two engines serve it, one with enable_prefix_caching, and their steps are interleaved so both run under
       the same machine load. Reported side by side: prefix hit rate (the share of
       prompt tokens served from the cache), prompt tokens actually prefilled (the engine's own
       num_prefill_tokens counter), and time to first token (TTFT) counted in each engine's own step time from
       the request's arrival to its first token. Timing: one
       untimed warm-up pass, then --repeats passes with the garbage collector frozen (mlsys.bench.steady_timing);
       the p50 TTFT of each pass, best and median over the passes, with the machine's load average.
    2. Every request's tokens are the same with and without the cache (greedy), and a repeat of the first prompt
       (a full hit: every full block of the prompt is cached, only the last block is computed) gives the tokens
       of a cold run.
    3. The radix tree after the run: edges of token ids (shown as text) owning blocks. The first edge is the
       shared prefix rounded DOWN to whole blocks (the system prompt plus the start every question shares);
       below it one child per distinct continuation: requests whose first full block after it is the same
       (same name, greedy) share a child. With every request finished all reference counts are 0, the engine's
       invariants hold, and emptying the cache returns every block to the free list.
    4. Eviction: a pool too small to keep every prefix, with two different system prompts taking turns; the
       least recently used unreferenced leaves are evicted, outputs still match the uncached engine.

How to run
    python tutorial/part3-inference/chapter09-kv-cache/scripts/prefix_cache.py
    python tutorial/part3-inference/chapter09-kv-cache/scripts/prefix_cache.py --num-requests 32 --shots 1

Runtime on 2 idle cores: about 4 s, 4 s with --smoke (several times that on a busy machine).

Try next
    python tutorial/part3-inference/chapter09-kv-cache/scripts/prefix_cache.py --shots 1
        -> a shorter shared system prompt (one record instead of two): the first edge holds fewer tokens
    python tutorial/part3-inference/chapter09-kv-cache/scripts/prefix_cache.py --block-size 4
        -> smaller blocks: the first edge holds the same tokens in four times as many blocks, and below it each
           request's own tokens become a chain of small edges, so the tree gets deeper (the printout and the
           figure say how many edges they leave out;
           the printout marks the chain it cuts)
    python tutorial/part3-inference/chapter09-kv-cache/scripts/prefix_cache.py --num-requests 32
        -> more requests: the same first edge, more children below it
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import torch

from mlsys import bench, cli, plot, report
from mlsys.data import Tokenizer, format_record, sample_record
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.weights import load_pretrained


@dataclass
class Settings(cli.Args, cli.PlotArgs):
    num_requests: int = 16
    """Requests sharing the system prompt (one arrives per engine step)."""
    shots: int = 2
    """Records in the shared few-shot system prompt (about 70 tokens each)."""
    max_tokens: int = 24
    """Tokens each request generates (ignore_eos: fixed lengths)."""
    block_size: int = 16
    """Tokens per KV block: only full blocks are cached and shared."""
    repeats: int = 3
    """Timed passes of the side-by-side run (after one untimed warm-up); TTFT p50: best and median of them."""

    def validate(self) -> None:
        if self.num_requests < 2 or not 1 <= self.max_tokens <= 64:
            raise cli.UsageError("--num-requests must be >= 2 and --max-tokens in 1..64")
        if not 1 <= self.repeats <= 20:
            raise cli.UsageError(f"--repeats must be in 1..20, got {self.repeats}")
        if not 1 <= self.shots <= 2:
            raise cli.UsageError(f"--shots must be 1 or 2 (the model's context is 256 tokens), got {self.shots}")
        if not 1 <= self.block_size <= 64:
            raise cli.UsageError(f"--block-size must be in 1..64, got {self.block_size}")


# --8<-- [start:workload]
def make_prompts(n: int, shots: int, seed: int) -> tuple[list[int], list[list[int]]]:
    """A shared prefix '<bos>{record}<eos>' * shots, then each request's '<bos>{"name": "xy' (11 chars)."""
    rng, tok = random.Random(seed), Tokenizer()
    system = [t for _ in range(shots) for t in tok.encode(format_record(sample_record(rng)), bos=True, eos=True)]
    return system, [system + tok.encode(format_record(sample_record(rng))[:11], bos=True) for _ in range(n)]
# --8<-- [end:workload]


# --8<-- [start:side_by_side]
def serve_side_by_side(model, prompts, args: Settings, num_blocks: int | None = None) -> dict[str, dict]:
    """Two engines, cache off and on; request i arrives at step i; steps alternate between the engines.

    TTFT is counted on each engine's own clock (the sum of its step times), so the other engine's steps
    do not count against it."""
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    engines, clock, arrive, first, final = {}, {}, {}, {}, {}
    for name, cached in (("no cache", False), ("prefix cache", True)):
        cfg = EngineConfig(block_size=args.block_size, num_blocks=num_blocks, max_num_seqs=len(prompts),
                           enable_prefix_caching=cached)
        engines[name] = Engine(model, config=cfg)
        clock[name], arrive[name], first[name], final[name] = 0.0, {}, {}, {}
    step = 0
    while step < len(prompts) or any(e.has_unfinished() for e in engines.values()):
        for name, engine in engines.items():
            if step < len(prompts):
                rid = engine.add_request(prompts[step], params, request_id=f"r{step}")
                arrive[name][rid] = clock[name]
            outs = engine.step()
            clock[name] += engine.last_step_timing["total"]  # this engine's clock: its own step times
            for out in outs:
                first[name].setdefault(out.request_id, clock[name])  # its first token came out of this step
                if out.finished:
                    final[name][out.request_id] = out
            engine.check_invariants()
        step += 1
    results = {}
    for name, engine in engines.items():
        rids = [f"r{i}" for i in range(len(prompts))]
        ttft = [first[name][r] - arrive[name][r] for r in rids]
        stats = engine.stats()
        results[name] = {
            "engine": engine, "outputs": [final[name][r].token_ids for r in rids], "stats": stats,
            "prompt_tokens": sum(map(len, prompts)),
            "prefilled_tokens": stats["num_prefill_tokens"],  # counted by the engine, step by step
            "cached_per_request": [final[name][r].metrics.num_cached_prompt_tokens for r in rids],
            "prefilled_per_request": [len(p) - final[name][r].metrics.num_cached_prompt_tokens
                                      for p, r in zip(prompts, rids)],
            "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": statistics.median(ttft)}
    return results


def timed_runs(model, prompts, args: Settings) -> tuple[dict, dict]:
    """One untimed warm-up, then args.repeats side-by-side passes with the GC frozen. Returns the last pass
    and, per engine, the p50 TTFT of every pass (a pause of the collector or of the OS lands in one pass)."""
    serve_side_by_side(model, prompts[:2], args)  # warm-up: first calls of every op, allocator, caches
    p50 = {"no cache": [], "prefix cache": []}
    for _ in range(args.repeats):
        with bench.steady_timing():
            runs = serve_side_by_side(model, prompts, args)
        for name, r in runs.items():
            p50[name].append(r["ttft_p50_s"])
    return runs, p50
# --8<-- [end:side_by_side]


# --8<-- [start:tree]
def edge_label(tok: Tokenizer, key, keep: int = 10) -> str:
    """An edge's tokens as text (^ = <bos>, $ = <eos>); a long one is cut in the middle at ' .. ', keeping its
    first and last `keep` characters (the printout and the figure cut alike)."""
    text = tok.decode(list(key), skip_special=False).replace("<bos>", "^").replace("<eos>", "$")
    return text if len(text) <= 2 * keep + 4 else text[:keep] + " .. " + text[-keep:]


def tree_lines(cache, tok: Tokenizer) -> list[str]:
    """The radix tree, one edge per line: its tokens as text, its blocks and their reference counts."""
    lines = []

    def walk(node, depth: int) -> None:
        for child in sorted(node.children.values(), key=lambda c: c.blocks[0]):
            text = edge_label(tok, child.key)
            refs = [cache.pool.ref_counts[b] for b in child.blocks]
            lines.append(f"   {'  ' * depth}[{text}]  {len(child.key)} tokens, blocks {child.blocks}, refs {refs}")
            walk(child, depth + 1)

    walk(cache.root, 0)
    return lines
# --8<-- [end:tree]


def count_edges(node) -> int:
    """Every edge below node (each child is one edge)."""
    return sum(1 + count_edges(child) for child in node.children.values())


def draw_tree(cache, tok: Tokenizer, seqs: list[list[int]], args: Settings, max_nodes: int = 24) -> list[dict]:
    """The radix tree as boxes: each edge's text, its tokens and blocks, and how many requests' token sequences
    (prompt + output) run through it. Depth left to right, siblings top to bottom. Returns the edges it drew
    (the tokens before each edge, the edge's tokens, its children)."""
    plt = plot.pyplot()
    boxes: list[tuple[int, float, str, int]] = []  # (depth, y, label, parent index)
    edges: list[dict] = []
    leaf = [0]

    def walk(node, depth: int, path: list[int], parent: int) -> float:
        kids = sorted(node.children.values(), key=lambda c: c.blocks[0])
        ys = []
        for child in kids:
            if len(boxes) >= max_nodes:
                break
            full = path + list(child.key)
            text = edge_label(tok, child.key)
            n_req = sum(seq[: len(full)] == full for seq in seqs)
            edges.append({"prefix": path, "tokens": list(child.key), "children": len(child.children)})
            idx = len(boxes)
            boxes.append((depth, 0.0, f"{text}\n{len(child.key)} tokens, {len(child.blocks)} block(s)\n"
                                      f"{n_req} request(s)", parent))
            y = walk(child, depth + 1, full, idx) if child.children else float(leaf[0])
            if not child.children:
                leaf[0] += 1
            boxes[idx] = (depth, y, boxes[idx][2], parent)
            ys.append(y)
        return sum(ys) / len(ys) if ys else float(leaf[0])

    root_y = walk(cache.root, 1, [], -1)
    total = count_edges(cache.root)
    max_depth = max((b[0] for b in boxes), default=1)
    # about 2 inches per level of depth, so that neighbouring boxes (at most 24 characters wide) never overlap
    fig, ax = plt.subplots(figsize=(max(10.0, 0.65 * (3 * max_depth + 3)), max(3.0, 0.55 * (leaf[0] + 1))))
    ax.text(0, root_y, "root", ha="center", va="center", bbox={"boxstyle": "round", "fc": "0.9"})
    for depth, y, label, parent in boxes:
        px, py = (0, root_y) if parent < 0 else (boxes[parent][0] * 3, boxes[parent][1])
        # an elbow: out of the parent, down or up between the two columns, then straight into the child's middle
        mid = depth * 3 - 1.5
        ax.plot([px, mid, mid, depth * 3], [py, py, y, y], color="0.6", lw=1, zorder=0)
        ax.text(depth * 3, y, label, ha="center", va="center", fontsize=7, family="monospace",
                bbox={"boxstyle": "round", "fc": "#dbe9f6" if depth == 1 else "#fde0c5"})
    ax.set_xlim(-1, 3 * max((b[0] for b in boxes), default=1) + 2)
    ax.set_ylim(leaf[0], -1)
    ax.axis("off")
    title = (f"the engine's radix tree after {len(seqs)} requests (blocks of {args.block_size} tokens); "
             "in the labels ^ = <bos>, $ = <eos>")
    if len(boxes) < total:
        title += f"\nonly the first {len(boxes)} of its {total} edges drawn; the rest are left out"
    ax.set_title(title)
    print(f"figure: {plot.save(fig, args, 'radix_tree')}")
    return edges


def compare_off_on(model, prompts, args: Settings) -> tuple[dict, dict, float, float, str]:
    """1. The same requests with the prefix cache off and on, side by side: tokens prefilled and p50 TTFT."""
    runs, p50 = timed_runs(model, prompts, args)
    off, on = runs["no cache"], runs["prefix cache"]
    ttft = {name: {"best_ms": 1e3 * min(v), "median_ms": 1e3 * statistics.median(v)} for name, v in p50.items()}
    rows = [{"engine": name, "hit rate %": 100 * r["stats"]["prefix_hit_rate"],
             "prompt tokens": r["prompt_tokens"], "prefilled": r["prefilled_tokens"],
             "TTFT p50 ms (best)": ttft[name]["best_ms"], "TTFT p50 ms (median)": ttft[name]["median_ms"],
             "TTFT mean ms (last)": 1e3 * r["ttft_mean_s"]}
            for name, r in runs.items()]
    print("1. " + report.table(rows, floatfmt=".3g").replace("\n", "\n   "))
    saved = 1 - on["prefilled_tokens"] / off["prefilled_tokens"]
    ratio = ttft["prefix cache"]["best_ms"] / ttft["no cache"]["best_ms"]
    direction = "lower" if ratio < 1 else "higher"
    print(f"   the cache skipped {100 * saved:.0f}% of the prompt tokens; p50 TTFT (best of {args.repeats} "
          f"pass(es), GC frozen) {ttft['no cache']['best_ms']:.2f} -> {ttft['prefix cache']['best_ms']:.2f} ms: "
          f"{ratio:.2f}x, "
          f"{direction} with the cache; {bench.load_average()}")
    return runs, ttft, saved, ratio, direction


def check_full_hit(runs: dict, prompts, args: Settings) -> int:
    """2. Same tokens with and without the cache; request 0 again is a full hit and equals its cold run."""
    off, on = runs["no cache"], runs["prefix cache"]
    for i, (a, b) in enumerate(zip(on["outputs"], off["outputs"])):
        report.expect_equal(f"request {i}: tokens with vs without the prefix cache", a, b)
    engine = on["engine"]
    full = (len(prompts[0]) - 1) // args.block_size * args.block_size  # every full block except the last token's
    [again] = engine.generate([prompts[0]], SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    report.expect_equal("full hit: cached prompt tokens", again.metrics.num_cached_prompt_tokens, full)
    report.expect_equal("full hit: tokens equal the cold run", again.token_ids, off["outputs"][0])
    print(f"\n2. All {len(prompts)} outputs identical with and without the cache. Repeating request 0: "
          f"{full} of its {len(prompts[0])} prompt tokens came from the cache, and its tokens equal the cold run.")
    return full


def show_tree(runs: dict, system, prompts, tok: Tokenizer, args: Settings) -> tuple[dict, int]:
    """3. The radix tree the requests left, every reference count back to 0, nothing leaked."""
    on = runs["prefix cache"]
    engine = on["engine"]
    cache, pool = engine.block_manager.prefix_cache, engine.block_manager.pool
    shared = next((i for i, col in enumerate(zip(*prompts)) if len(set(col)) > 1), min(map(len, prompts)))
    first_edge = len(next(iter(cache.root.children.values())).key)
    report.expect_equal("the first edge holds at least the shared prefix in whole blocks",
                        first_edge >= shared // args.block_size * args.block_size, True)
    top = list(cache.root.children.values())
    tree = {"cached_blocks": len(cache.cached_blocks()), "shared_prompt_tokens": shared,
            "system_tokens": len(system), "top_edges": len(top), "first_edge_tokens": len(top[0].key),
            "first_edge_children": len(top[0].children), "num_requests": len(prompts),
            # the shared prefix in three pieces: system prompt | question tokens in the first edge | after it
            "question_in_first_edge": len(top[0].key) - len(system),
            "question_after_first_edge": shared - len(top[0].key)}
    print(f"\n3. The radix tree ({tree['cached_blocks']} cached blocks; ^ = <bos>, $ = <eos>):")
    lines = tree_lines(cache, tok)
    shown = lines[:12]
    if len(lines) > 12 and len(lines[12]) - len(lines[12].lstrip()) > len(shown[-1]) - len(shown[-1].lstrip()):
        shown[-1] += "  ... (its chain continues; not all shown)"  # the cut falls inside a chain: say so
    print("\n".join(shown))
    if len(lines) > 12:
        print(f"   ... {len(lines) - 12} more edges not shown ({len(lines)} in all)")
    print(f"   every prompt starts with the same {shared} tokens ({len(system)} of system prompt + "
          f"{shared - len(system)} of the question's '<bos>{{\"name\": \"'); the first edge "
          f"holds {tree['first_edge_tokens']} tokens (the shared prefix in whole blocks of {args.block_size}: "
          f"{shared // args.block_size * args.block_size}). "
          + (f"Below it, {tree['first_edge_children']} children for {len(prompts)} requests: one per distinct next "
             "block (completed by generated tokens); requests that wrote the same block share one child."
             if tree["first_edge_children"] else "No request generated enough tokens to complete the next block."))
    sequences = [p + o for p, o in zip(prompts, on["outputs"])]
    tree["edges"], tree["sequences"] = draw_tree(cache, tok, sequences, args), sequences
    engine.check_invariants()
    report.expect_equal("reference counts after every request finished", max(pool.ref_counts), 0)
    for r in runs.values():
        r["engine"].check_invariants()
    freed = engine.reset_prefix_cache()
    report.expect_equal("free blocks after emptying the cache", pool.num_free, pool.num_blocks)
    print(f"   all reference counts 0, invariants hold; emptying the cache freed {freed} blocks: "
          f"{pool.num_free}/{pool.num_blocks} free.")
    return tree, freed


def eviction_run(model, prompts, args: Settings) -> dict:
    """4. Eviction under memory pressure: two system prompts take turns in a pool of about two sequences."""
    _, prompts_b = make_prompts(args.num_requests, args.shots, args.seed + 1)
    mixed = [p for pair in zip(prompts, prompts_b) for p in pair][: args.num_requests]
    longest = max(map(len, mixed)) + args.max_tokens
    engine_min = -(-model.config.block_size // args.block_size)  # the engine insists on one full-context sequence
    small_pool = max(2 * -(-longest // args.block_size), engine_min)  # about two sequences: prefixes must compete
    tight = serve_side_by_side(model, mixed, args, num_blocks=small_pool)
    for i, (a, b) in enumerate(zip(tight["prefix cache"]["outputs"], tight["no cache"]["outputs"])):
        report.expect_equal(f"eviction run, request {i}", a, b)
    st = tight["prefix cache"]["stats"]
    print(f"\n4. Two system prompts taking turns in a pool of {st['num_total_blocks']} blocks: "
          f"{st['num_evicted_blocks']} blocks evicted (LRU, unreferenced leaves only), hit rate "
          f"{100 * st['prefix_hit_rate']:.0f}%, {st['num_preemptions']} preemptions, outputs identical.")
    return st


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"num_requests": 4, "shots": 1, "max_tokens": 8})
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a tiny model: one thread is faster than two fighting over small matmuls
    model, tok = load_pretrained("small"), Tokenizer()
    system, prompts = make_prompts(args.num_requests, args.shots, args.seed)
    question = "^" + tok.decode(prompts[0][len(system) + 1:])  # ^ = <bos>, as in the tree printout
    print(f"{len(prompts)} requests: a shared {len(system)}-token system prompt ({len(system) // args.block_size} "
          f"full blocks of {args.block_size}) + a {len(prompts[0]) - len(system)}-token question each (<bos> and "
          f"the start of a new record up to a name's first letter, e.g. '{question}'), "
          f"{args.max_tokens} tokens out\n")
    runs, ttft, saved, ratio, direction = compare_off_on(model, prompts, args)
    full = check_full_hit(runs, prompts, args)
    tree, freed = show_tree(runs, system, prompts, tok, args)
    st = eviction_run(model, prompts, args)

    if args.json:
        out = {name: {k: v for k, v in r.items() if k not in ("engine", "outputs")} for name, r in runs.items()}
        report.write_json(args.json, {**out, "prefill_tokens_saved": saved, "ttft_p50": ttft,
                                      "ttft_ratio": ratio, "ttft_direction": direction,
                                      "load_average": bench.load_average(), "tree": tree,
                                      "full_hit_cached_tokens": full, "prompt0_tokens": len(prompts[0]),
                                      "freed_on_reset": freed, "eviction": {"stats": st}}, args)
    return 0

if __name__ == "__main__":
    cli.run(main)
