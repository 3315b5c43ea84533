"""Tensor-parallel serving: N ranks each hold 1/N of every layer and the KV cache of their own heads.

    engine = Engine(model, config=EngineConfig(tensor_parallel_size=2))   # or LLM(model=..., tensor_parallel_size=2)

The split is Chapter 6's (Megatron-LM's): in attention, each rank computes its share of the query heads (column
parallel: rows of the q, k, v projections) and the output projection's matching columns (row parallel), so one
all-reduce of the (N, C) partial sums ends the block; the MLP the same way, its first projection split by output
features, the second by input features, one more all-reduce. Norms, embeddings and the head are replicated. The
slices are Chapter 6's ColumnParallelLinear and RowParallelLinear (mlsys/tp_layers.py); the all-reduce is its
`g` (mlsys/tp_comm.py), which also keeps this process's running totals in `COMM`.

    rank r:   x ── norm ── q,k,v of heads r·H/N..(r+1)·H/N ── paged attention (its own KV pool) ── o_proj[:, cols]
                                                                                                     │ partial (N, C)
                                                                              all-reduce (sum over ranks)
              x ── norm ── gate/up rows ── down_proj[:, cols] ── all-reduce ── ...

Keys and values follow the query heads: a rank stores the K/V heads its query heads read. With grouped-query
attention and N dividing the K/V heads, each rank holds H_kv / N of them; with N larger (N a multiple of H_kv),
each rank holds the one K/V head its query heads share, replicated on N / H_kv ranks, as vLLM does. So the KV
memory per rank shrinks N-fold (down to one head), and the same pool holds N times the tokens.

Processes, in the shape of vLLM V0's multiprocessing executor (v1 starts every rank as a worker): the process that
builds the engine is rank 0. It schedules, samples and detokenizes as before; `start_workers` (mlsys/launch.py)
starts ranks 1..N-1 (gloo on CPU; with EngineConfig(device="cuda"), NCCL with rank r on cuda:r). Every step, rank 0
broadcasts the packed batch (the ModelInput of model_runner.py, and the copy-on-write block copies) and all ranks
run the same forward, each on its shard; the all-reduces keep them in step, and rank 0 reads the logits. A worker
that dies makes the next step raise `WorkerDied`, naming the rank; the engine does not try to carry on. The ranks
form this process's default process group, so a process holds one tensor-parallel engine at a time (close() the
first before building another), and not inside a job that already has a process group.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mlsys.engine.model_runner import ModelInput, ModelRunner
from mlsys.engine.request import FatalEngineError
from mlsys.tp_comm import COMM  # noqa: F401  (this process's all-reduce totals, read by ch10's tp_serving.py)
from mlsys.tp_layers import ColumnParallelLinear, RowParallelLinear


class WorkerDied(FatalEngineError):
    """A tensor-parallel worker is gone; the engine cannot compute another step."""


# ------------------------------------------------------------------------------------------- sharding a model
def check_tp(config, size: int) -> None:
    """ValueError unless `size` ranks can split the model: the attention heads, the K/V heads (or replicate
    them), and the MLP width (each rank takes width // size columns: a remainder would be dropped silently). The
    vocabulary needs no check: the embeddings and the LM head stay whole on every rank."""
    H, H_kv = config.n_head, config.n_kv_head
    if H % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the {H} attention heads")
    width = getattr(config, "intermediate_size", None) or 4 * config.n_embd   # Llama/Qwen2, or the GPT's 4C
    if width % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the MLP width ({width})")
    if H_kv % size and size % H_kv:
        raise ValueError(f"tensor_parallel_size={size} must divide the {H_kv} key/value heads or be a multiple of "
                         f"them")


def _rows(t: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if t is None else t[start:stop].clone()


# --8<-- [start:shard]
class ShardedBlock(nn.Module):
    """One decoder block's rank-r slice, built from Chapter 6's ColumnParallelLinear and RowParallelLinear, with
    the three serving seams of mlsys.model.Block / mlsys.llama (attention_qkv, attention_out, feed_forward)."""

    def __init__(self, block: nn.Module, rank: int, size: int, H: int, H_kv: int, D: int):
        super().__init__()
        h = H // size  # query heads on this rank
        q0 = rank * h
        kv0, hk = (q0 * H_kv // H, max(1, H_kv // size))  # first K/V head this rank's query heads read; how many
        self.D, self.llama = D, hasattr(block, "self_attn")
        if self.llama:
            a, m = block.self_attn, block.mlp
            self.norm1, self.norm2 = block.input_layernorm, block.post_attention_layernorm
            wq, bq = a.q_proj.weight, a.q_proj.bias
            wk, bk, wv, bv = a.k_proj.weight, a.k_proj.bias, a.v_proj.weight, a.v_proj.bias
            wo, bo = a.o_proj.weight, a.o_proj.bias
            ups, down = [m.gate_proj, m.up_proj], m.down_proj
        else:  # the book's GPT: one fused c_attn (q rows, then k, then v)
            a, m = block.attn, block.mlp
            self.norm1, self.norm2 = block.ln_1, block.ln_2
            C = H * D
            w, b = a.c_attn.weight, a.c_attn.bias
            wq, wk, wv = w[:C], w[C : 2 * C], w[2 * C :]
            bq, bk, bv = (None, None, None) if b is None else (b[:C], b[C : 2 * C], b[2 * C :])
            wo, bo = a.c_proj.weight, a.c_proj.bias
            ups, down = [m.c_fc], m.c_proj

        def column(w, b, start: int, stop: int) -> ColumnParallelLinear:  # rows start..stop of the dense weight
            return ColumnParallelLinear(_rows(w, start, stop), _rows(b, start, stop), group=None)

        self.q_proj = column(wq, bq, q0 * D, (q0 + h) * D)
        self.k_proj = column(wk, bk, kv0 * D, (kv0 + hk) * D)  # K/V heads: split, or this rank's replica
        self.v_proj = column(wv, bv, kv0 * D, (kv0 + hk) * D)
        self.o_proj = RowParallelLinear(wo[:, q0 * D : (q0 + h) * D].clone(), _rows(bo, 0, None), group=None)
        f = ups[0].out_features // size
        self.up = nn.ModuleList(column(u.weight, u.bias, rank * f, (rank + 1) * f) for u in ups)  # [gate,] up
        self.down = RowParallelLinear(down.weight[:, rank * f : (rank + 1) * f].clone(), _rows(down.bias, 0, None),
                                      group=None)

    wq, wk, wv, wo = (property(lambda self, n=n: getattr(self, n).weight)
                      for n in ("q_proj", "k_proj", "v_proj", "o_proj"))  # this rank's slices, for inspection

    def attention_qkv(self, x: torch.Tensor, pos=None):
        """x (N, C) -> q (N, h, D), k and v (N, h_kv, D) of this rank's heads (rotated for Llama)."""
        x = self.norm1(x)
        q, k, v = (proj(x).unflatten(-1, (-1, self.D)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.llama:
            from mlsys.llama import apply_rope

            cos, sin = (t[:, None] for t in pos)  # (N, 1, D): the same angle for every head
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def attention_out(self, y: torch.Tensor) -> torch.Tensor:
        return self.o_proj(y)  # partial sums of every rank's heads, all-reduced; the bias once, after the sum

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm2(x)
        if self.llama:
            gate, up = self.up
            h = F.silu(gate(x)) * up(x)
        else:
            h = F.gelu(self.up[0](x), approximate="tanh")
        return self.down(h)  # one all-reduce, then the bias
# --8<-- [end:shard]


class _ShardConfig:
    """The model's config as one rank sees it: fewer heads, everything else the same."""

    def __init__(self, base, n_head: int, n_kv_head: int):
        self._base, self.n_head, self.n_kv_head = base, n_head, n_kv_head

    def __getattr__(self, name: str):
        return getattr(self._base, name)


def shard_model(model: nn.Module, rank: int, size: int) -> nn.Module:
    """Rank `rank`'s copy of `model`: its slice of every block, the embeddings and head whole."""
    c = model.config
    check_tp(c, size)
    H, H_kv, D = c.n_head, c.n_kv_head, c.head_dim
    shard = copy.copy(model)  # a shallow copy: the module dicts are copied below, the blocks replaced
    shard._modules = dict(model._modules)
    blocks = nn.ModuleList(ShardedBlock(b, rank, size, H, H_kv, D) for b in model.blocks)
    if hasattr(model, "h"):
        shard._modules["h"] = blocks
    else:
        backbone = copy.copy(model.model)
        backbone._modules = dict(model.model._modules, layers=blocks)
        shard._modules["model"] = backbone
    shard.config = _ShardConfig(c, H // size, max(1, H_kv // size))
    return shard.eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------- the ranks
def moved(obj, device):
    """`obj` (a ModelInput, its AttnGroups, lists of them, tensors) with every tensor on `device`. The step's
    batch travels as a pickle: on NCCL, rank 0 sends it from the CPU and each rank moves it to its own GPU."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list):
        return [moved(o, device) for o in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: moved(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj)})
    return obj


def _worker(ctx, model: nn.Module, num_blocks: int, block_size: int) -> None:
    """Ranks 1..N-1: build this rank's shard and KV pool (on its GPU with NCCL), then run every step rank 0
    broadcasts, until "stop"."""
    torch.set_num_threads(1)
    runner = ModelRunner(shard_model(model, ctx.rank, ctx.world_size).to(ctx.device), num_blocks, block_size,
                         ctx.device)
    del model
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0)
        cmd, *rest = msg[0]
        if cmd == "stop":
            return
        batch, copies, all_logits = rest
        runner.copy_blocks(copies)
        runner.execute(moved(batch, ctx.device), all_logits)


class TPRunner:
    """Rank 0's runner: the ModelRunner interface (prepare, execute, copy_blocks, kv_cache_bytes) over N ranks."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, size: int, device: str = "cpu",
                 timeout: float = 120.0):
        from mlsys.launch import start_workers

        check_tp(model.config, size)
        self.size, self.device = size, torch.device("cuda", 0) if device != "cpu" else torch.device("cpu")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(self.device)  # rank 0 on cuda:0; rank r on cuda:r (mlsys/launch.py)
        workers_copy = copy.deepcopy(model).cpu() if backend == "nccl" else model  # pickled to the workers
        self.group = start_workers(_worker, size, workers_copy, num_blocks, block_size, backend=backend,
                                   timeout=timeout)
        del workers_copy
        self.model = shard_model(model, 0, size).to(self.device)
        self.local = ModelRunner(self.model, num_blocks, block_size, self.device)
        self._copies: list[tuple[int, int]] = []
        self.closed = False

    def __getattr__(self, name: str):  # block_size, k_cache, ...: the local runner's
        return getattr(self.local, name)

    @property
    def kv_cache_bytes(self) -> int:
        return self.local.kv_cache_bytes  # per rank: every rank holds the same share

    def prepare(self, *args, **kwargs) -> ModelInput:
        return self.local.prepare(*args, **kwargs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.local.copy_blocks(pairs)
        self._copies += pairs  # the workers copy theirs with the next step

    def execute(self, m: ModelInput, all_logits: bool = False) -> torch.Tensor:
        if self.closed:
            raise WorkerDied("the tensor-parallel workers were shut down")
        dead = self.group.dead()
        if dead:
            raise WorkerDied(f"tensor-parallel worker {dead}; the engine cannot run another step")
        try:
            sent = m if self.device.type == "cpu" else moved(m, "cpu")
            dist.broadcast_object_list([("step", sent, self._copies, all_logits)], src=0)
            self._copies = []
            return self.local.execute(m, all_logits)
        except RuntimeError as err:  # a collective failed: a worker is gone (gloo: "Connection closed by peer")
            deadline = time.monotonic() + 5.0
            while not (dead := self.group.dead()) and time.monotonic() < deadline:
                time.sleep(0.05)
            raise WorkerDied(f"tensor-parallel worker {dead or 'unknown'} failed during a step ({err})") from err

    def close(self) -> None:
        """Tell the workers to return, wait for them, and leave the process group."""
        if self.closed:
            return
        self.closed = True
        if not self.group.dead():
            try:
                dist.broadcast_object_list([("stop",)], src=0)
            except RuntimeError:
                pass
        self.group.close()
