"""Chapter 9 oracles: paged attention against the contiguous GPT, the engine's bookkeeping, admission and
preemption against a brute-force simulation of the pool, prefix caching against the engine's own counters and
the prompts' shared prefixes, preemption against an unconstrained run (each script's --json), and the
calculator's arithmetic by hand."""

from __future__ import annotations

import json
from collections import deque

import pytest
import torch

from conftest import load_script, run_json, scripts_dir
from mlsys import kv_memory as kvm

CH09 = scripts_dir(9)


@pytest.fixture(scope="module")
def paged(tmp_path_factory) -> dict:
    return run_json(tmp_path_factory, CH09 / "paged_kv.py")  # the default run: 12 requests, preemptions


@pytest.fixture(scope="module")
def preempt(tmp_path_factory) -> dict:
    return run_json(tmp_path_factory, CH09 / "preemption.py")  # the default run


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> dict:
    return run_json(tmp_path_factory, CH09 / "prefix_cache.py", "--smoke", "--repeats", "1")


# ------------------------------------------------------------------------------------------ paged attention
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_paged_attention_equals_contiguous_gpt(tiny_model, block_size: int) -> None:
    mod = load_script(CH09 / "paged_kv.py")
    # lengths ending before, on and after block boundaries; decode steps cross into new blocks
    worst = mod.paged_vs_contiguous(tiny_model, [1, 2, 3, 4, 5, 15, 16, 17, 33], block_size, decode_steps=4, seed=1)
    assert worst < 1e-5


def test_bookkeeping_demo_counts_blocks() -> None:
    mod = load_script(CH09 / "paged_kv.py")
    out = mod.bookkeeping_demo(block_size=4, num_blocks=10)
    # A: 10 prompt + 3 decoded = 13 tokens -> 4 blocks; B: 4 + 3 = 7 tokens -> 2 blocks; A freed -> 8 free
    assert {k: out[k] for k in ("blocks_A", "blocks_B", "free_after")} == {"blocks_A": 4, "blocks_B": 2,
                                                                           "free_after": 8}


def test_block_table_picture_slots(tiny_model, tmp_path) -> None:
    """block_table.png: the slot drawn for every cached token (read from the engine's ModelRunner.prepare through
    the real block tables) equals table[p // B] * B + p % B worked out here, and no two tokens share a slot."""
    from types import SimpleNamespace

    mod = load_script(CH09 / "paged_kv.py")
    state = mod.bookkeeping_demo(block_size=4, num_blocks=10)["before_free"]
    assert {n: st["tokens"] for n, st in state.items()} == {"A": 13, "B": 7}  # 10 + 3 and 4 + 3 tokens
    slots = mod.block_table_slots(tiny_model, state, block_size=4, num_blocks=10)
    drawn = mod.draw_block_table(state, slots, 4, 10, ("A", 9), SimpleNamespace(plot_dir=str(tmp_path)))
    want = [(n, p, st["block_table"][p // 4] * 4 + p % 4) for n, st in state.items() for p in range(st["tokens"])]
    assert [(d["seq"], d["position"], d["slot"]) for d in drawn] == want
    assert len({d["slot"] for d in drawn}) == len(drawn)


def simulate_pool(work: list[tuple[int, int]], num_blocks: int, block_size: int, max_num_seqs: int,
                  max_model_len: int, budget: int = 512, first: dict | None = None) -> dict:
    """Brute force, tokens and block counts only: requests (prompt_len, max_tokens) served step by step from a
    pool of num_blocks. Running sequences first, oldest first, each taking blocks for its next tokens; when the
    pool is short the newest running one gives all its blocks back and waits at the front of the queue (it
    recomputes everything later); then waiting ones are admitted in order while seats, token budget and blocks
    last, but not in a step that preempted. Returns the running count after every step and the preemptions.
    `first` (a dict) receives the queues and blocks held before and after the first step that preempts."""
    prompt, max_tokens = [p for p, _ in work], [m for _, m in work]
    done, gen, held = [0] * len(work), [0] * len(work), [0] * len(work)  # computed, generated, blocks held
    waiting, running, free = deque(range(len(work))), [], num_blocks
    counts, preemptions, per_request, prefill, order = [], 0, [0] * len(work), 0, []

    def blocks_for(r: int, n: int) -> int:
        return max(0, -(-(done[r] + n) // block_size) - held[r])

    def state() -> dict:
        return {"running": list(running), "waiting": list(waiting), "held": {r: h for r, h in enumerate(held) if h}}

    while waiting or running:
        left, scheduled, preempted, i = budget, [], False, 0
        before = state()
        while i < len(running) and left > 0:
            r = running[i]
            n = min(prompt[r] + gen[r] - done[r], left)
            while blocks_for(r, n) > free:
                victim = running.pop()
                free, held[victim], done[victim] = free + held[victim], 0, 0
                waiting.appendleft(victim)
                preemptions, preempted = preemptions + 1, True
                per_request[victim] += 1
                order.append([len(counts) + 1, victim])  # (step, victim) in the order they are popped
                if victim == r:
                    break
            else:
                free -= blocks_for(r, n)
                held[r] += blocks_for(r, n)
                scheduled.append((r, n))
                left -= n
                i += 1
        while not preempted and waiting and len(running) < max_num_seqs and left > 0:
            r = waiting[0]
            n = min(prompt[r] + gen[r], left)
            if blocks_for(r, n) > free:
                break
            waiting.popleft()
            free -= blocks_for(r, n)
            held[r] += blocks_for(r, n)
            running.append(r)
            scheduled.append((r, n))
            left -= n
        for r, n in scheduled:
            prefill += n if not (n == 1 and gen[r] and done[r] == prompt[r] + gen[r] - 1) else 0  # not a decode
            done[r] += n
            if done[r] == prompt[r] + gen[r]:  # all its tokens are in the cache: it samples one more
                gen[r] += 1
                if gen[r] == max_tokens[r] or prompt[r] + gen[r] >= max_model_len:
                    free, held[r] = free + held[r], 0
                    running.remove(r)
        counts.append(len(running))
        if first is not None and preempted and not first:
            first.update(step=len(counts), before=before, after=state())
    return {"steps": len(counts), "preemptions": preemptions, "peak_running": max(counts),
            "mean_running": sum(counts) / len(counts), "preemptions_per_request": per_request,
            "prefill_tokens": prefill, "preemption_order": order}


@pytest.mark.timeout(180)
def test_paged_kv_script(paged: dict) -> None:
    mod = load_script(CH09 / "paged_kv.py")
    args = mod.Settings()  # the fixture ran the defaults
    work = [(len(p), sp.max_tokens) for p, sp in mod.make_workload(args)]
    assert paged["paged_vs_contiguous_max_abs_diff"] < 1e-4
    # the waste table, brute force: walk every token of every final sequence into blocks of bs
    final = [p + m for p, m in work]
    for row in paged["computed_waste"]:
        bs, slots, block_fill = row["block_size"], 0, 0
        for length in final:
            for _ in range(length):
                if block_fill == 0:
                    slots += bs  # a new block
                block_fill = (block_fill + 1) % bs
            block_fill = 0  # the next sequence starts in a block of its own
        assert row["tokens used"] == sum(final) and row["paged slots"] == slots
        assert row["reserved slots"] == len(final) * args.max_model_len
        assert row["paged waste %"] == pytest.approx(100 * (1 - sum(final) / slots))
    # admission and preemption: the engine's runs against the brute-force pool simulation
    pool = args.pool_seqs * args.max_model_len
    for name, seats in (("paged", args.num_requests), ("reserved", paged["reserved_seats"])):
        sim = simulate_pool(work, pool // args.block_size, args.block_size, seats, args.max_model_len)
        got = paged["runs"][name]
        assert (got["steps"], got["preemptions"], got["peak_running"]) == (sim["steps"], sim["preemptions"],
                                                                          sim["peak_running"]), name
        assert got["mean_running"] == pytest.approx(sim["mean_running"]), name
    assert paged["runs"]["paged"]["preemptions"] > 0  # the default run exercises preemption
    sims = [simulate_pool(work, pool // args.block_size, args.block_size, s, args.max_model_len)
            for s in (args.num_requests, paged["reserved_seats"])]
    assert paged["concurrency_gain"] == pytest.approx(sims[0]["mean_running"] / sims[1]["mean_running"])
    assert paged["concurrency_gain"] > 1  # the Recap: paging runs more sequences in the same memory
    assert paged["reserved_seats"] == pool // args.max_model_len


# ------------------------------------------------------------------------------------------ preemption
@pytest.mark.timeout(180)
def test_preemption_script(preempt: dict) -> None:
    """Both runs against the brute-force pool: steps, preemptions (per request) and the prefill tokens the
    engine counted, recomputed tokens included."""
    mod = load_script(CH09 / "preemption.py")
    args = mod.Settings()  # the fixture ran the defaults
    work = [(len(p), args.max_tokens) for p in mod.make_prompts(args.num_requests, args.seed)]
    for name, blocks in (("tight", args.num_blocks), ("roomy", preempt["roomy"]["num_blocks"])):
        sim = simulate_pool(work, blocks, args.block_size, args.num_requests, args.max_model_len)
        got = preempt[name]
        assert got["num_blocks"] == blocks and got["steps"] == sim["steps"], name
        assert got["num_preemptions"] == sim["preemptions"], name
        assert got["preemptions_per_request"] == sim["preemptions_per_request"], name
        assert got["prefill_tokens"] == sim["prefill_tokens"], name
    tight, roomy = preempt["tight"], preempt["roomy"]
    assert roomy["num_preemptions"] == 0 and tight["num_preemptions"] > 0
    assert roomy["num_blocks"] == args.num_requests * -(-args.max_model_len // args.block_size)  # the lesson's 6 x 12
    assert roomy["prefill_tokens"] == sum(p for p, _ in work)  # without preemption every prompt once
    assert tight["reasons"] == ["length"] * len(tight["reasons"])  # outputs equal: checked by the script (exit 0)
    assert preempt["recomputed_tokens"] > 0


def test_preemption_log_lists_victims_in_the_schedulers_order(preempt: dict) -> None:
    """The log prints the victims of one step in the order the scheduler popped them off the end of `running`
    (newest first), the brute-force pool's order; not in request-id order."""
    mod = load_script(CH09 / "preemption.py")
    args = mod.Settings()
    work = [(len(p), args.max_tokens) for p in mod.make_prompts(args.num_requests, args.seed)]
    sim = simulate_pool(work, args.num_blocks, args.block_size, args.num_requests, args.max_model_len)
    want = [[step, f"req-{r}"] for step, r in sim["preemption_order"]]
    assert preempt["tight"]["preemption_order"] == want
    first = [r for step, r in want if step == want[0][0]]
    assert first == ["req-5", "req-4"]  # the lesson: the newer one is queued first, the older one in front of it


def test_preemption_picture_queues_and_pool(preempt: dict) -> None:
    """preemption.png: the running and waiting queues and the blocks each request holds, drawn from the scheduler
    and the pool before and after the first step that preempts, equal the brute-force pool's (victims, newest
    first, go to the front of the waiting queue, so they wait there in the order they were running)."""
    mod = load_script(CH09 / "preemption.py")
    args = mod.Settings()
    work = [(len(p), args.max_tokens) for p in mod.make_prompts(args.num_requests, args.seed)]
    want: dict = {}
    simulate_pool(work, args.num_blocks, args.block_size, args.num_requests, args.max_model_len, first=want)
    drawn = preempt["tight"]["first_preemption"]
    assert drawn["step"] == want["step"]
    for when in ("before", "after"):
        got, sim = drawn[when], want[when]
        index = {f"req-{r}": r for r in range(len(work))}  # the engine names requests req-0, req-1, ... in order
        assert [index[r] for r in got["running"]] == sim["running"], when
        assert [index[r] for r in got["waiting"]] == sim["waiting"], when
        held = {index[r]: got["pool"].count(r) for r in set(got["pool"]) - {None}}
        assert held == sim["held"] and len(got["pool"]) == args.num_blocks, when
    # the caption's reading: six requests of two blocks and two free; then four of three and 4, 5 at the front
    assert want["before"]["held"] == {r: 2 for r in range(6)} and want["before"]["waiting"] == []
    assert want["after"]["held"] == {r: 3 for r in range(4)} and want["after"]["waiting"] == [4, 5]


@pytest.mark.timeout(180)
def test_smallest_pool_takes_more_steps_and_need_not_preempt_more(preempt: dict, tmp_path_factory) -> None:
    """The Try-next claim for --num-blocks 12: more steps than the default 14 blocks, the same tokens (the script's
    exit 0), and, in this workload, fewer preemptions and fewer recomputed tokens; the engine's run against the
    brute-force pool simulation, so the claim is computed, not copied from a run."""
    mod = load_script(CH09 / "preemption.py")
    args = mod.Settings()
    floor = -(-args.max_model_len // args.block_size)  # the smallest pool the script accepts
    small = run_json(tmp_path_factory, CH09 / "preemption.py", "--num-blocks", str(floor))
    work = [(len(p), args.max_tokens) for p in mod.make_prompts(args.num_requests, args.seed)]
    sim = simulate_pool(work, floor, args.block_size, args.num_requests, args.max_model_len)
    tight, default = small["tight"], preempt["tight"]
    assert (tight["num_blocks"], tight["steps"], tight["num_preemptions"]) == (floor, sim["steps"],
                                                                            sim["preemptions"])
    assert tight["steps"] > default["steps"]  # "the run takes more steps than with 14 blocks"
    assert tight["num_preemptions"] < default["num_preemptions"]  # "(here they fall)"
    assert small["recomputed_tokens"] < preempt["recomputed_tokens"]


def _llama_prefills_on_meta(shape: kvm.ModelShape, lengths: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    """{n: (FLOPs, KV-cache bytes)} of one n-token prefill of the real architecture, from transformers'
    LlamaForCausalLM in bf16 on the meta device (shapes only, no memory, no arithmetic): the FLOPs as torch's
    FlopCounterMode counts them, the bytes from the DynamicCache the forward returns."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                         intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                         num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                         head_dim=shape.head_dim, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    out = {}
    for n in lengths:
        with FlopCounterMode(display=False) as counter:
            cache = model(input_ids=torch.zeros(1, n, dtype=torch.long, device="meta")).past_key_values
        out[n] = (counter.get_total_flops(),
                  sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)))
    return out


def test_recompute_vs_swap_against_a_real_prefill() -> None:
    """The script's Llama-3-8B costs against the architecture itself: the bytes a swap moves are the bytes of the
    KV cache transformers builds (exactly), and the recompute time times the GPU's effective FLOP rate is the
    prefill's FLOPs as torch counts them, within 10% (the formula leaves out attention's n^2 term and counts the
    embedding lookup as a matmul; both stay small against 2 x params per token at these lengths)."""
    mod = load_script(CH09 / "preemption.py")
    args = mod.Settings(gpu_tflops=989.0, mfu=0.5, pcie_gbps=50.0)
    s = kvm.MODEL_SHAPES["llama-3-8b"]
    for n, (flops, kv) in _llama_prefills_on_meta(s, (64, 2048)).items():
        out = mod.computed_recompute_vs_swap(s, n, args)
        assert out["kv_bytes"] == kv, n
        assert out["swap_s"] * args.pcie_gbps * 1e9 == pytest.approx(2 * kv), n  # out to host memory, then back
        assert out["recompute_s"] * args.gpu_tflops * 1e12 * args.mfu == pytest.approx(flops, rel=0.10), n


def test_measured_swap_restores_the_cache(tiny_model) -> None:
    mod = load_script(CH09 / "preemption.py")
    out = mod.measure_recompute_vs_swap(tiny_model, 20, 8, "cpu", repeats=1, keep=True)
    # 3 blocks of 8 x 2 layers x 2 heads x 16 dims x 4 B, for K and V
    assert out["kv_bytes"] == 2 * 2 * 3 * 8 * 2 * 16 * 4 and out["recompute_s"] > 0 and out["swap_s"] > 0
    for written, restored in zip(out["blocks_written"], out["blocks_restored"]):  # K, then V
        assert written.abs().sum() > 0 and torch.equal(restored, written)  # the swap brought back what was there


# ------------------------------------------------------------------------------------------ prefix caching
def full_block_prefix(a: list[int], b: list[int], block_size: int) -> int:
    """Tokens of a's longest prefix that b shares, in whole blocks."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // block_size * block_size


@pytest.mark.timeout(180)
def test_prefix_cache_script(prefix: dict) -> None:
    """Prefill work from the engine's own counter; cache hits from the prompts' shared prefixes (brute force)."""
    mod = load_script(CH09 / "prefix_cache.py")
    bs = mod.Settings().block_size
    _, prompts = mod.make_prompts(4, 1, seed=0)  # the --smoke workload: 4 requests, 1 shot
    off, on = prefix["no cache"], prefix["prefix cache"]
    assert on["prompt_tokens"] == off["prompt_tokens"] == sum(map(len, prompts))
    # the lesson's per-request prefill (prompt minus its cached tokens) adds up to the engine's own step counter
    for run in (off, on):
        assert sum(run["prefilled_per_request"]) == run["prefilled_tokens"]
    assert off["stats"]["prefix_hit_rate"] == 0 and off["prefilled_tokens"] == off["prompt_tokens"]
    # the engine's num_prefill_tokens (counted in Engine.step from what was scheduled) against the requests'
    # own record of their cached tokens (set at admission): two counts that must agree
    cached = on["cached_per_request"]
    assert on["prefilled_tokens"] == on["prompt_tokens"] - sum(cached) == on["stats"]["num_prefill_tokens"]
    assert sum(cached) == on["stats"]["prefix_hit_tokens"] > 0
    assert cached[0] == 0  # the first request finds an empty tree
    for i in range(1, len(prompts)):  # request i arrives after every earlier prompt was prefilled and cached
        cap = (len(prompts[i]) - 1) // bs * bs  # the last prompt token is always computed
        shared = max(full_block_prefix(prompts[i], prompts[j], bs) for j in range(i))
        assert min(shared, cap) <= cached[i] <= cap, i
    assert prefix["full_hit_cached_tokens"] == (prefix["prompt0_tokens"] - 1) // bs * bs
    tree = prefix["tree"]
    common = min(full_block_prefix(prompts[0], p, 1) for p in prompts[1:])  # tokens every prompt shares
    assert tree["shared_prompt_tokens"] == common and tree["first_edge_tokens"] >= common // bs * bs
    # the lesson's three pieces of the shared prefix: system prompt | rest of the first edge | the tokens after it
    assert tree["system_tokens"] + tree["question_in_first_edge"] == tree["first_edge_tokens"]
    assert tree["first_edge_tokens"] + tree["question_after_first_edge"] == tree["shared_prompt_tokens"]
    assert prefix["freed_on_reset"] == tree["cached_blocks"] > 0
    # radix_tree.png against plain Python: each finished sequence leaves its computed tokens (all but the last
    # sampled one) in whole blocks; the leaves drawn are the cuts no other cut extends, and the nodes where the
    # drawn tree branches are exactly the whole-block common prefixes of two cuts that part ways
    cuts = {tuple(s[: (len(s) - 1) // bs * bs]) for s in tree["sequences"]}
    leaves = {c for c in cuts if not any(o != c and o[: len(c)] == c for o in cuts)}
    branch = set()
    for a in leaves:
        for b in leaves:
            if a < b:
                branch.add(a[: full_block_prefix(list(a), list(b), bs)])
    paths = [(tuple(e["prefix"] + e["tokens"]), e) for e in tree["edges"]]
    assert all(len(e["tokens"]) % bs == 0 and len(e["prefix"]) % bs == 0 for _, e in paths)
    assert {p for p, e in paths if e["children"] == 0} == leaves
    assert {p for p, e in paths if e["children"] >= 2} | ({()} if len(tree["edges"]) and sum(
        not e["prefix"] for e in tree["edges"]) >= 2 else set()) == branch
    assert on["stats"]["num_used_blocks"] == 0 and off["stats"]["num_used_blocks"] == 0
    assert set(prefix["ttft_p50"]) == {"no cache", "prefix cache"}  # timings are reported, never asserted


def test_prefix_workload_shares_the_system_prompt() -> None:
    mod = load_script(CH09 / "prefix_cache.py")
    system, prompts = mod.make_prompts(5, 2, seed=0)
    assert all(p[: len(system)] == system for p in prompts) and len({tuple(p) for p in prompts}) > 1
    assert system.count(1) == 2 and system.count(2) == 2  # two <bos> ... <eos> records


# ------------------------------------------------------------------------------------------ calculator
def test_calculator_row_by_hand() -> None:
    mod = load_script(CH09 / "kv_calculator.py")
    args = mod.Settings(prompt_len=1024, max_new_tokens=1024, block_size=16, reserve_fraction=0.1)
    row = mod.model_row(kvm.MODEL_SHAPES["llama-3-8b"], args, 80 * kvm.GIB)
    b = row["_bytes"]
    assert b["per_token"] == 131072 and b["per_token_mha"] == 4 * 131072
    assert b["per_request"] == 2048 * 131072  # 256 MiB
    assert b["weights"] == 2 * 8_030_261_248
    budget = 0.9 * 80 * kvm.GIB - 2 * 8_030_261_248
    assert b["kv_budget"] == pytest.approx(budget)
    assert row["max tokens"] == int(budget // (131072 * 16)) * 16
    assert row["max requests"] == int(budget // (131072 * 16)) // 128  # 2048 tokens = 128 blocks
    # the lesson's worked line: blocks of 16 x 128 KiB = 2 MiB, whole blocks in the budget, 128 per request
    assert (b["block_mib"], b["num_blocks"], b["blocks_per_request"]) == (2.0, int(budget // (2 * kvm.MIB)), 128)
    mqa = mod.model_row(kvm.MODEL_SHAPES["llama-3-8b"], mod.Settings(kv_heads=1), 80 * kvm.GIB)
    assert mqa["_bytes"]["per_token"] == 131072 // 8


def test_gqa_picture_against_the_published_configs(tmp_path) -> None:
    """gqa_heads.png: the query -> K/V head map drawn equals transformers' own repeat_kv (the K/V head it places at
    query position q), and one layer's row holds K and V of every K/V head, with head_dim = hidden / heads worked
    out here from the models' config.json values; times the layers it is the table's KiB per token."""
    from types import SimpleNamespace

    from transformers.models.llama.modeling_llama import repeat_kv

    mod = load_script(CH09 / "kv_calculator.py")
    pictures = [mod.head_groups(kvm.MODEL_SHAPES[n], "bf16") for n in mod.FIGURE_MODELS]
    mod.draw_gqa(pictures, SimpleNamespace(plot_dir=str(tmp_path), dtype="bf16"))
    assert (tmp_path / "gqa_heads.png").exists()
    # hidden_size, num_attention_heads, num_key_value_heads, num_hidden_layers from each model's config.json
    published = {"llama-2-7b": (4096, 32, 32, 32), "llama-3-8b": (4096, 32, 8, 32)}
    assert [p["model"] for p in pictures] == list(published)
    for p in pictures:
        hidden, heads, kv, layers = published[p["model"]]
        head_dim = hidden // heads
        assert (p["heads"], p["kv_heads"], p["head_dim"], p["layers"]) == (heads, kv, head_dim, layers)
        kv_index = torch.arange(kv, dtype=torch.float32).view(1, kv, 1, 1)
        assert p["query_to_kv"] == repeat_kv(kv_index, heads // kv).flatten().long().tolist(), p["model"]
        assert p["row_numbers"] == 2 * kv * head_dim and p["row_bytes"] == 2 * p["row_numbers"]  # bf16: 2 bytes
        row = mod.model_row(kvm.MODEL_SHAPES[p["model"]], mod.Settings(), 80 * kvm.GIB)
        assert p["token_kib"] == layers * p["row_bytes"] / 1024 == row["KiB/token"]


def test_calculator_own_model_from_hf_config(tmp_path) -> None:
    """--config: a Llama-3-8B config.json gives the built-in row, parameters rebuilt from the shape."""
    mod = load_script(CH09 / "kv_calculator.py")
    ref = kvm.MODEL_SHAPES["llama-3-8b"]
    cfg = {"model_type": "llama", "num_hidden_layers": ref.num_layers, "hidden_size": ref.hidden_size,
           "num_attention_heads": ref.num_heads, "num_key_value_heads": ref.num_kv_heads,
           "intermediate_size": ref.intermediate_size, "vocab_size": ref.vocab_size}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    own = mod.shape_from_hf_config(str(path))
    assert own.num_params == ref.num_params and own.head_dim == ref.head_dim
    args = mod.Settings()
    row, want = mod.model_row(own, args, 80 * kvm.GIB), mod.model_row(ref, args, 80 * kvm.GIB)
    assert row["_bytes"] == want["_bytes"] and row["max requests"] == want["max requests"]
    del cfg["num_key_value_heads"]  # no GQA key: every head has its own K and V
    path.write_text(json.dumps(cfg))
    assert mod.shape_from_hf_config(str(path)).num_kv_heads == ref.num_heads
    path.write_text("{}")
    with pytest.raises(mod.cli.UsageError):
        mod.shape_from_hf_config(str(path))


def test_calculator_weights_too_big_and_bad_flags(tmp_path, monkeypatch, capsys) -> None:
    from mlsys import cli

    mod = load_script(CH09 / "kv_calculator.py")
    out = tmp_path / "r.json"
    monkeypatch.setattr("sys.argv", ["kv_calculator.py", "--model", "llama-3-70b", "--gpu-mem-gib", "24",
                                     "--json", str(out)])
    assert mod.main() == 0 and "do not fit" in capsys.readouterr().out
    assert json.loads(out.read_text())["results"]["models"]["llama-3-70b"]["max requests"] == 0
    for flags in (["--reserve-fraction", "1"], ["--gpu-mem-gib", "-1"], ["--gpu-mem-gib", "nan"],
                  ["--model", "gpt-5"], ["--block-size", "0"], ["--dtype", "fp7"], ["--prompt-len", "0"]):
        with pytest.raises(SystemExit) as exc:
            cli.parse(mod.Settings, argv=flags)
        assert exc.value.code == 2, flags
        assert len(capsys.readouterr().err.strip().splitlines()) == 1, flags


# ------------------------------------------------------------------------------------------------- GQA memory
@pytest.mark.timeout(120)
def test_gqa_pool_bytes_and_concurrency(tmp_path_factory) -> None:
    """The pool the engine allocates holds 2 * L * H_kv * D * 4 bytes per token (kv_memory's formula, and the
    tensors' own byte count); a quarter of the K/V heads buys four times the blocks in the same budget, and no
    fewer sequences per step."""
    r = run_json(tmp_path_factory, CH09 / "gqa_memory.py", "--smoke", "--kv-heads", "2")
    mha, gqa = r["runs"]["MHA"], r["runs"]["GQA"]
    layers, head_dim = 2, 128 // 8  # the --smoke model: 2 layers, hidden 128, 8 heads
    # the shape the lesson quotes to let a reader redo the bytes per token: the models' own config, float32
    assert r["shape"] == {"layers": layers, "hidden": 128, "heads": 8, "head_dim": head_dim, "bytes_per_element": 4}
    for run, kv_heads in ((mha, 8), (gqa, 2)):
        assert run["bytes_per_token"] == kvm.kv_bytes_per_token(layers, kv_heads, head_dim, 4)
        assert run["pool_bytes"] == run["num_blocks"] * 16 * run["bytes_per_token"] <= 256 * 1024
        assert run["generated"] == 8 * 16  # every request to its length
    assert gqa["num_blocks"] == 4 * mha["num_blocks"]
    assert gqa["mean_running"] >= mha["mean_running"] and gqa["steps"] <= mha["steps"]


def test_gqa_memory_refuses_a_budget_too_small_for_one_sequence() -> None:
    from conftest import run

    proc = run([CH09 / "gqa_memory.py", "--kv-kib", "1"], timeout=60)
    assert proc.returncode == 2 and "cannot hold one 64-token sequence" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("flags, want", [
    (["--smoke"], dict(shared=6 + 4 * 2, separate=4 * 8, copies=3)),  # P=100, T=20, bs=16: 6 full blocks, 2 own
    (["--smoke", "--prompt-len", "96"], dict(shared=6 + 4 * 2, separate=4 * 8, copies=0)),  # P fills its blocks
    (["--smoke", "--n", "1"], dict(shared=8, separate=8, copies=0)),  # nothing to share
])
def test_parallel_sampling_blocks_counted_by_hand(tmp_path_factory, flags, want):
    """Peak KV blocks of n answers with the prompt shared copy-on-write and of n separate requests, against
    counts worked out by hand for each setting (not the script's formula); the forked answers equal the
    separately seeded requests (the script's self-check, exit 0)."""
    r = run_json(tmp_path_factory, CH09 / "parallel_sampling.py", *flags)
    assert r["shared"]["peak_blocks"] == want["shared"] and r["separate"]["peak_blocks"] == want["separate"]
    assert r["shared"]["cow_copies"] == want["copies"]
    assert r["shared"]["prefill_tokens"] * (4 if "1" not in flags else 1) == r["separate"]["prefill_tokens"]
    # fork.png: every drawn reference count equals a brute-force count of the answers whose table holds the block
    snaps = r["shared"]["snapshots"]
    assert len(snaps) == 2 and len(r["fork_drawn"]) == sum(len(t) for s in snaps for t in s["tables"].values())
    for d in r["fork_drawn"]:
        snap = snaps[0] if d["panel"].startswith("after the prefill") else snaps[1]
        assert d["ref_count"] == sum(d["block"] in t for t in snap["tables"].values()), d
    first, second = (list(s["tables"].values()) for s in snaps)
    n = 1 if "1" in flags else 4
    assert len(first) == len(second) == n and all(t == first[0] for t in first)  # the fork copies the table
    assert len({t[-1] for t in second}) == n  # after its first write every answer owns its last block
