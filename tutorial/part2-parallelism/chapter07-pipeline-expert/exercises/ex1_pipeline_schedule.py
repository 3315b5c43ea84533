"""Exercise ch07.1 — the 1F1B order of operations, and the bubble read off a timeline.

Write `one_f_one_b_order` and `bubble_from_timeline`; both are plain Python. `pipelined_gradients` at the bottom is
given: the checker runs it on 3 real ranks, where mlsys.pipeline.run_pipeline_step follows YOUR order, and compares
the gradients with the whole model in one process.
Check your work:  make check EX=ch07.1
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mlsys.data import Tokenizer, get_batch, make_corpus
from mlsys.model import GPT, GPTConfig
from mlsys.pipeline import run_pipeline_step, split_gpt


def one_f_one_b_order(stage: int, num_stages: int, num_micro: int) -> list[tuple[str, int]]:
    """Stage `stage`'s operations under 1F1B, as ("F", micro-batch) and ("B", micro-batch) pairs, in order.

    Warm-up: min(p - 1 - stage, m) forwards (the last stage has no warm-up). Steady state: one forward, then one
    backward, until all m forwards are done. Cool-down: the backwards that are left. Forwards and backwards each go
    in micro-batch order 0, 1, ..., m-1. Example, p=2, m=3: stage 0 -> F0 F1 B0 F2 B1 B2; stage 1 -> F0 B0 F1 B1 F2 B2.
    """
    raise NotImplementedError("TODO: warm-up forwards, then (forward, backward) pairs, then the remaining backwards")


def bubble_from_timeline(events: list[list[dict]]) -> list[float]:
    """The idle fraction of every stage. events[s] lists stage s's operations as dicts with "start" and "end".

    The step lasts from the earliest start on any stage to the latest end on any stage; a stage's idle fraction is
    1 - (its total compute time) / (that span).
    """
    raise NotImplementedError("TODO: span over all stages, busy time per stage, 1 - busy / span")


def pipelined_gradients(seed: int, num_micro: int) -> dict:
    """(Given, do not edit.) One pipelined step of a 3-block tiny GPT with your 1F1B order; runs on every rank of a
    real job.

    Returns this stage's gradients, keyed by the whole model's parameter names (the checker compares them with the
    whole model run in one process, in its own process), and the most micro-batches it held between forward and
    backward.
    """
    torch.manual_seed(seed)
    model = GPT(GPTConfig.preset("tiny", n_layer=3))
    tokens = Tokenizer().encode_corpus(make_corpus(100, seed))
    x, y = get_batch(tokens, 2 * num_micro, 16, torch.Generator().manual_seed(seed))  # (2m, 16) each
    p, rank = dist.get_world_size(), dist.get_rank()
    stage = split_gpt(model, p)[rank]
    out = run_pipeline_step(stage, list(range(p)), list(x.chunk(num_micro)), list(y.chunk(num_micro)),
                            schedule=one_f_one_b_order)
    grads = {stage.global_name(name): None if param.grad is None else param.grad.tolist()  # nested lists of floats
             for name, param in stage.named_parameters()}
    return {"grads": grads, "peak_in_flight": out["peak_in_flight"]}
