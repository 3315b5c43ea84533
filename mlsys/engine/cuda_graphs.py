"""CUDA graphs for the decode step: capture once per batch size, replay with new inputs.

A decode step of a small model is hundreds of tiny kernels, and on a GPU each
costs a few microseconds of CPU time to launch, more than the kernel itself
runs. A CUDA graph records the kernels of one step once and replays the whole
sequence with a single launch. The price is that a graph is frozen: the same
kernels on the same memory addresses with the same shapes. So vLLM and SGLang
capture the decode step for a list of batch sizes (vLLM's
`cudagraph_capture_sizes`: 1, 2, 4, then multiples of 8 up to 256 and of 16
beyond, up to min(2 * max_num_seqs, 512)) and at run time:

    n running sequences ──pick──> smallest captured size B >= n
        ──pad──> rows n..B-1 are dummies: token 0 at position 0, writing their K/V into a scratch block
        ──copy──> the step's ids, positions, slots, block tables into the graph's static input buffers
        ──replay──> logits (B, V) in the graph's static output buffer; keep rows 0..n-1

Shapes the eager runner derives from the batch are fixed here: every block table
is padded to the longest possible (max_model_len / block_size blocks), and the
causal mask is computed inside the graph from the positions.

The engine uses the graphs for the logits only: `execute` returns them and the
engine samples on the host with its ordinary sampler (sampler.py), outside the
graph, as vLLM and SGLang do. The captured forward also ends with a sampler, used
only through `run` (Chapter 10's script and tests): sampling inside a graph needs
random numbers that change at every replay, so the uniform noise is drawn OUTSIDE
the graph into a static buffer (each row from its own request's generator) and
the graph turns it into a sample with the Gumbel-max trick:
argmax(logits / T - log(-log(u))) is distributed as softmax(logits / T). (The
other way: torch registers the default CUDA generator with the graph, so
torch.rand inside a captured graph advances its Philox offset on every replay.)

On a CPU there is nothing to capture. The same padded static-buffer forward then
runs eagerly, which is how the tests check the padding logic without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mlsys.engine.model_runner import ModelRunner


# --8<-- [start:pick]
def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to (and including) max_num_seqs: vLLM's list for the batch sizes this
    engine meets (vLLM steps by 16 above 256 and stops at min(2 * max_num_seqs, 512))."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def pick_graph_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured batch size that holds num_seqs sequences; None: too many, run eagerly."""
    fitting = [s for s in sizes if s >= num_seqs]
    return min(fitting) if fitting else None
# --8<-- [end:pick]


# --8<-- [start:gumbel]
def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """logits (B, V), temperature (B, 1) with 0 meaning greedy, noise (B, V) uniform in (0, 1) -> ids (B,).

    Gumbel-max: if g = -log(-log(u)) with u uniform, argmax(z + g) is a sample from softmax(z).
    Only fixed-shape elementwise ops and one argmax: safe to capture, no data-dependent control flow.
    """
    gumbel = -torch.log(-torch.log(noise.clamp(1e-20, 1.0 - 1e-7)))  # (B, V)
    scaled = logits / temperature.clamp_min(1e-6) + gumbel
    return torch.where(temperature > 0, scaled, logits).argmax(dim=-1)  # greedy rows ignore the noise
# --8<-- [end:gumbel]


@dataclass
class DecodeBuffers:
    """The static tensors of one captured batch size B: a replay reads and writes exactly these."""

    input_ids: torch.Tensor  # (B,) last token of each sequence
    positions: torch.Tensor  # (B,) its position = the sequence's num_computed_tokens
    slot_mapping: torch.Tensor  # (B,) where its K/V goes in the pool
    block_tables: torch.Tensor  # (B, max_blocks) padded with the scratch block
    temperature: torch.Tensor  # (B, 1) 0 = greedy
    noise: torch.Tensor  # (B, V) uniform noise for the Gumbel-max sample, filled before each replay
    logits: torch.Tensor | None = None  # (B, V) outputs, set by the forward
    next_ids: torch.Tensor | None = None  # (B,)
    graph: torch.cuda.CUDAGraph | None = None


class CUDAGraphRunner:
    """Decode steps of a ModelRunner through static buffers, captured as one CUDA graph per batch size."""

    def __init__(self, runner: ModelRunner, max_model_len: int, sizes: list[int], capture: bool | None = None):
        self.runner, self.sizes = runner, sorted(set(sizes))
        self.device = runner.device
        self.use_graphs = self.device.type == "cuda" if capture is None else capture
        bs, nb = runner.block_size, runner.num_blocks
        self.max_blocks = -(-max_model_len // bs)  # every table padded to the longest possible
        # --8<-- [start:scratch]
        # One extra block at the end of the pool: padding rows write their K/V there, never into a real block.
        # The runner keeps a view of the first nb blocks, so eager steps and replays share the same memory.
        for name in ("k_cache", "v_cache"):
            pool = getattr(runner, name)  # (L, nb, bs, H, D)
            big = torch.zeros((pool.size(0), nb + 1, *pool.shape[2:]), dtype=pool.dtype, device=self.device)
            big[:, :nb] = pool
            setattr(self, name + "_ext", big)  # (L, nb + 1, bs, H, D)
            setattr(runner, name, big[:, :nb])
        self.scratch_block = nb
        # --8<-- [end:scratch]
        self.key_pos = torch.arange(self.max_blocks * bs, device=self.device)  # (Kmax,)
        self.buffers = {B: self._new_buffers(B) for B in self.sizes}
        self.num_graph_steps = 0
        self.pool = None  # graphs share one memory pool (captured largest first, as vLLM does)

    def _new_buffers(self, B: int) -> DecodeBuffers:
        dev, V = self.device, self.runner.model.config.vocab_size
        z = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=dev)
        return DecodeBuffers(z(B), z(B), z(B), z(B, self.max_blocks), z(B, 1, dtype=torch.float32),
                             torch.full((B, V), 0.5, device=dev))

    # --8<-- [start:forward]
    @torch.inference_mode()
    def forward(self, b: DecodeBuffers) -> None:
        """The decode step on static buffers: reads b's inputs, writes b.logits and b.next_ids.
        Fixed shapes, no .item(), no Python branch on tensor values: this is what a graph records."""
        model, r = self.runner.model, self.runner
        B, H, H_kv, D = b.input_ids.size(0), r.n_head, r.n_kv_head, r.head_dim
        x, pos = model.embed(b.input_ids, b.positions)  # (B, C)
        visible = self.key_pos[None, :] <= b.positions[:, None]  # (B, Kmax): keys up to each position
        mask = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(~visible, float("-inf"))
        mask = mask[:, None, None, :]  # (B, 1, 1, Kmax) additive, as the eager runner's
        for i, block in enumerate(model.blocks):
            q, k, v = block.attention_qkv(x, pos)  # (B, H, D), (B, H_kv, D) x 2
            k_pool, v_pool = self.k_cache_ext[i], self.v_cache_ext[i]  # (nb + 1, bs, H_kv, D)
            k_pool.view(-1, H_kv, D).index_copy_(0, b.slot_mapping, k)
            v_pool.view(-1, H_kv, D).index_copy_(0, b.slot_mapping, v)
            keys = F.embedding(b.block_tables, k_pool.view(k_pool.size(0), -1))  # (B, max_blocks, bs * H_kv * D)
            values = F.embedding(b.block_tables, v_pool.view(v_pool.size(0), -1))
            keys = keys.view(B, -1, H_kv, D).transpose(1, 2)  # (B, H_kv, Kmax, D)
            values = values.view(B, -1, H_kv, D).transpose(1, 2)
            # the H / H_kv query heads reading K/V head j are query rows of it, as in ModelRunner.attend
            y = F.scaled_dot_product_attention(q.view(B, H_kv, H // H_kv, D), keys, values, attn_mask=mask)
            x = x + block.attention_out(y.reshape(B, H * D))  # (B, C)
            x = x + block.feed_forward(x)
        logits = model.head(x)  # (B, V)
        next_ids = gumbel_sample(logits, b.temperature, b.noise)  # (B,)
        if b.logits is None:
            b.logits, b.next_ids = logits, next_ids
        else:  # eager run on a CPU: refresh the outputs in place, as a replay would
            b.logits.copy_(logits)
            b.next_ids.copy_(next_ids)
    # --8<-- [end:forward]

    # --8<-- [start:capture]
    def capture(self) -> CUDAGraphRunner:
        """Record one graph per size, largest first so that smaller ones reuse its memory pool."""
        if not self.use_graphs:
            return self
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up on a side stream: cuBLAS handles, lazy inits
            for B in self.sizes:
                for _ in range(2):
                    self._warmup(self.buffers[B])
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for B in sorted(self.sizes, reverse=True):
            b = self.buffers[B]
            b.logits = b.next_ids = None  # the captured forward allocates its outputs from the graph pool
            b.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(b.graph, pool=self.pool):
                self.forward(b)
            self.pool = b.graph.pool()
        torch.cuda.synchronize(self.device)
        return self

    def _warmup(self, b: DecodeBuffers) -> None:
        b.slot_mapping.fill_(self.scratch_block * self.runner.block_size)  # warm-up writes go to the scratch block
        b.block_tables.fill_(self.scratch_block)
        self.forward(b)
        b.logits = b.next_ids = None
    # --8<-- [end:capture]

    # --8<-- [start:run]
    def fill(self, b: DecodeBuffers, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
             temperatures: list[float] | None = None, noise: torch.Tensor | None = None) -> None:
        """Copy n sequences' decode inputs into the buffers of size B >= n; rows n..B-1 become padding."""
        n, bs, pad = len(token_ids), self.runner.block_size, self.scratch_block
        B = b.input_ids.size(0)
        tables = [t + [pad] * (self.max_blocks - len(t)) for t in block_tables] + [[pad] * self.max_blocks] * (B - n)
        slots = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, positions)] + [pad * bs] * (B - n)
        host = torch.tensor([list(token_ids) + [0] * (B - n), list(positions) + [0] * (B - n), slots])  # (3, B)
        temps = list(temperatures or [0.0] * n) + [0.0] * (B - n)
        for dst, src in ((b.input_ids, host[0]), (b.positions, host[1]), (b.slot_mapping, host[2]),
                         (b.block_tables, torch.tensor(tables)),  # (B, max_blocks)
                         (b.temperature, torch.tensor(temps, dtype=torch.float32)[:, None])):
            _to_device(dst, src)
        if noise is not None:
            _to_device(b.noise[:n], noise)

    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
            temperatures: list[float] | None = None, noise: torch.Tensor | None = None):
        """One decode step for n sequences -> (logits (n, V), next_ids (n,)), views of the static outputs."""
        n = len(token_ids)
        B = pick_graph_size(n, self.sizes)
        if B is None:
            raise ValueError(f"{n} sequences exceed the largest captured size {self.sizes[-1]}")
        b = self.buffers[B]
        self.fill(b, token_ids, positions, block_tables, temperatures, noise)
        self.replay(b)
        return b.logits[:n], b.next_ids[:n]

    def replay(self, b: DecodeBuffers) -> None:
        if b.graph is not None:
            b.graph.replay()  # one launch for the whole step
        else:
            self.forward(b)  # CPU, or not captured: the same static-buffer code, eagerly
    # --8<-- [end:run]

    # The engine's ModelRunner interface: a step in which every sequence computes one token and wants its
    # logits (all decodes) goes through the graphs, anything else to the eager runner.
    # --8<-- [start:dispatch]
    def prepare(self, starts, token_chunks, block_tables, want_logits):
        n = len(token_chunks)
        B = pick_graph_size(n, self.sizes)
        if B is None or not all(want_logits) or any(len(c) != 1 for c in token_chunks):
            return self.runner.prepare(starts, token_chunks, block_tables, want_logits)
        b = self.buffers[B]
        self.fill(b, [c[0] for c in token_chunks], starts, block_tables)
        return GraphBatch(b, n)

    def execute(self, m, all_logits: bool = False) -> torch.Tensor:
        if not isinstance(m, GraphBatch):
            return self.runner.execute(m, all_logits)
        self.num_graph_steps += 1
        self.replay(m.buffers)
        return m.buffers.logits[: m.num_seqs].clone()  # the next replay overwrites the static output
    # --8<-- [end:dispatch]

    def __getattr__(self, name: str):  # kv_cache_bytes, k_cache, ...: the wrapped runner's
        return getattr(self.__dict__["runner"], name)


def _to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy into a static buffer without blocking the CPU. From pageable memory, a host-to-device copy
    waits for the stream's earlier work (the step in flight) before it starts; from pinned memory it is
    queued behind it and the CPU moves on."""
    if dst.is_cuda and not src.is_cuda:
        src = src.pin_memory()
    dst.copy_(src, non_blocking=True)


@dataclass
class GraphBatch:
    buffers: DecodeBuffers
    num_seqs: int
