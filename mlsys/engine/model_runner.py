"""Runs the model's weights over a packed batch, reading and writing a paged KV cache.

The model is the book's GPT or a Llama-style checkpoint (mlsys.llama); the runner reaches it only through
embed / blocks / head and each block's attention_qkv / attention_out / feed_forward.

`mlsys.model.GPT.forward` takes a rectangle (B, T) of tokens that all start at
the same position. A serving step is ragged: one request prefills 40 prompt
tokens from position 0, another prefills the 9 tokens its prefix-cache hit did
not cover from position 32, thirty others decode one token each at their own
positions. So the runner packs every scheduled token into one flat row
(N = sum of each sequence's new tokens) and runs the same weights, block by
block, on (N, C) activations. Everything except attention is per token and does
not care which sequence a row belongs to; attention is where the block tables
come in:

    packed q, k, v (N, H, D)
      │ write k, v at slot_mapping: slot = block_table[pos // bs] * bs + pos % bs
      ▼
    K/V pool (num_blocks, bs, H, D) ── gather by block tables ──> (S, max_blocks * bs, H, D)
      ▼
    queries padded to (S, Qmax) ── SDPA with mask key_pos <= query_pos ──> unpad to (N, H, D)

All of it is a handful of batched tensor ops per layer, whatever the mix of
prefill and decode, and no Python loop over tokens. A production kernel
(vLLM's paged attention, FlashAttention's varlen/paged kernels) reads the
blocks in place instead of gathering a padded copy; the arithmetic is the same.
The padding is the price of the simple way: one 200-token context among
forty-token ones, or one prefill among decodes, pads everyone to its size. So
`split_by_shape` may cut the step's sequences into two groups of similar shape
that attend separately (still no loop over tokens), the way padded-batch
servers bucket requests by length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mlsys.model import GPT  # or mlsys.llama.Llama: the runner uses only the seams both models have


@dataclass
class AttnGroup:
    """Sequences that attend together, padded to the group's longest query and context."""

    token_index: torch.Tensor | None  # (N_g,) packed rows of the group's tokens; None: all N rows, in order
    block_tables: torch.Tensor  # (S_g, max_blocks) physical block ids, padded with block 0
    pad_index: torch.Tensor  # (N_g,) row of each token in the padded (S_g * Qmax) query layout
    attn_mask: torch.Tensor  # (S_g, 1, Qmax, Kmax) additive: 0 where key j is visible to query i, else -inf
    num_seqs: int
    max_query_len: int


@dataclass
class ModelInput:
    """One step's batch, packed: N scheduled tokens from S sequences."""

    input_ids: torch.Tensor  # (N,) token ids
    positions: torch.Tensor  # (N,) absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # (N,) flat slot (block * bs + offset) where its k, v are written
    groups: list[AttnGroup]  # one, or two when one padded rectangle would be mostly padding
    logits_indices: torch.Tensor  # (R,) packed rows whose next-token logits are wanted


class ModelRunner:
    def __init__(self, model: GPT, num_blocks: int, block_size: int, device: str | torch.device = "cpu"):
        self.model = model
        self.device = torch.device(device)
        c = model.config
        self.block_size, self.num_blocks = block_size, num_blocks
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, c.head_dim
        dtype = next(model.parameters()).dtype
        # --8<-- [start:kv_pool]
        # The KV pool: for each layer, K and V of every block, (num_blocks, block_size, H_kv, D). H_kv is the
        # number of key/value heads: all the heads for the book's GPT, fewer with grouped-query attention.
        shape = (c.n_layer, num_blocks, block_size, c.n_kv_head, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        # --8<-- [end:kv_pool]

    def to_device(self, x: torch.Tensor) -> torch.Tensor:
        """Host tensor -> device. On a GPU through pinned memory: a copy from pageable memory would wait
        for the step in flight to finish (Chapter 10's overlap scheduling prepares the next step meanwhile)."""
        if self.device.type == "cuda":
            x = x.pin_memory()
        return x.to(self.device, non_blocking=True)

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets block src's K and V, every layer (in order: a later pair wins)."""
        for src, dst in pairs:
            self.k_cache[:, dst] = self.k_cache[:, src]
            self.v_cache[:, dst] = self.v_cache[:, src]

    # --8<-- [start:prepare]
    def prepare(self, starts: list[int], token_chunks: list[list[int]], block_tables: list[list[int]],
                want_logits: list[bool]) -> ModelInput:
        """Pack a step. Sequence s computes tokens token_chunks[s] at positions starts[s]..;
        its K/V rows live in the blocks block_tables[s]; want_logits[s]: sample after it."""
        lens = torch.tensor([len(t) for t in token_chunks])  # (S,) new tokens per sequence
        first = torch.cumsum(lens, 0) - lens  # (S,) packed row of each sequence's first token
        N = int(lens.sum())
        slot_mapping = torch.empty(N, dtype=torch.long)
        groups = []
        for members in self.split_by_shape(lens.tolist(), [len(t) for t in block_tables]):
            groups.append(self._group(members, torch.tensor(starts), lens, first, block_tables, slot_mapping))
        last = (first + lens - 1)[torch.tensor(want_logits, dtype=torch.bool)]  # (R,)
        ids = torch.tensor([t for chunk in token_chunks for t in chunk])  # (N,)
        positions = torch.repeat_interleave(torch.tensor(starts) - first, lens) + torch.arange(N)  # (N,)
        to = self.to_device
        return ModelInput(to(ids), to(positions), to(slot_mapping), groups, to(last))

    def _group(self, members, start, lens, first, block_tables, slot_mapping) -> AttnGroup:
        """Padded layout of the sequences `members`; fills their rows of slot_mapping."""
        bs, S = self.block_size, len(members)
        sel = torch.tensor(members)
        g_lens = lens[sel]  # (S_g,)
        Qmax, N_g = int(g_lens.max()), int(g_lens.sum())
        seq_of = torch.repeat_interleave(torch.arange(S), g_lens)  # (N_g,) which member each token is
        offset = torch.arange(N_g) - (torch.cumsum(g_lens, 0) - g_lens)[seq_of]  # (N_g,) 0..len-1
        rows = first[sel][seq_of] + offset  # (N_g,) packed rows of these tokens
        positions = start[sel][seq_of] + offset  # (N_g,)
        max_blocks = max(len(block_tables[i]) for i in members)
        table = torch.tensor([block_tables[i] + [0] * (max_blocks - len(block_tables[i])) for i in members])
        slot_mapping[rows] = table[seq_of, positions // bs] * bs + positions % bs
        pad_index = seq_of * Qmax + offset  # (N_g,)
        q_pos = torch.zeros(S * Qmax, dtype=torch.long)
        q_pos[pad_index] = positions  # padded queries sit at position 0: they see key 0, never NaN
        key_pos = torch.arange(max_blocks * bs)  # (Kmax,)
        visible = key_pos[None, None, :] <= q_pos.view(S, Qmax, 1)  # (S_g, Qmax, Kmax): causal + ragged
        mask = torch.zeros(visible.shape, dtype=self.k_cache.dtype).masked_fill_(~visible, float("-inf"))
        identity = S == len(lens)  # everyone in one group: rows are 0..N-1 already
        to = self.to_device
        return AttnGroup(None if identity else to(rows), to(table), to(pad_index), to(mask[:, None]), S, Qmax)
    # --8<-- [end:prepare]

    @staticmethod
    def split_by_shape(query_lens: list[int], num_blocks: list[int], keep: float = 0.6) -> list[list[int]]:
        """Bucket sequences so that little attention work is spent on padding.

        One padded rectangle costs about S * Qmax * Kmax. A 200-token context among
        short ones, or a prefill among decodes, makes most of it padding. Sorted by
        that per-sequence size, the best cut into two groups is taken when it costs
        at most `keep` of one rectangle; each extra group pays a few more kernel
        launches, so small savings are not worth it.
        """
        S = len(query_lens)
        order = sorted(range(S), key=lambda i: (query_lens[i] + 1) * num_blocks[i])
        q = [query_lens[i] for i in order]
        k = [num_blocks[i] for i in order]
        suffix_q, suffix_k = q[:], k[:]  # max over order[j:]
        for j in range(S - 2, -1, -1):
            suffix_q[j], suffix_k[j] = max(q[j], suffix_q[j + 1]), max(k[j], suffix_k[j + 1])
        best, cut, max_q, max_k = S * suffix_q[0] * suffix_k[0], 0, 0, 0
        one = best
        for j in range(1, S):  # group order[:j] and order[j:]
            max_q, max_k = max(max_q, q[j - 1]), max(max_k, k[j - 1])
            cost = j * max_q * max_k + (S - j) * suffix_q[j] * suffix_k[j]
            if cost < best:
                best, cut = cost, j
        if cut == 0 or best > keep * one:
            return [list(range(S))]
        return [order[:cut], order[cut:]]

    # --8<-- [start:attention]
    def attention(self, layer: int, q, k, v, m: ModelInput) -> torch.Tensor:
        """q (N, H, D), k, v (N, H_kv, D) -> (N, H * D): one layer's self-attention over the paged cache."""
        N, H, D = q.shape
        k_pool, v_pool = self.k_cache[layer], self.v_cache[layer]  # (num_blocks, bs, H_kv, D)
        k_pool.view(-1, *k.shape[1:]).index_copy_(0, m.slot_mapping, k)  # write this step's keys into their slots
        v_pool.view(-1, *v.shape[1:]).index_copy_(0, m.slot_mapping, v)
        if len(m.groups) == 1:
            return self.attend(q, k_pool, v_pool, m.groups[0])
        y = q.new_empty(N, H * D)
        for g in m.groups:  # at most two: see split_by_shape
            y.index_copy_(0, g.token_index, self.attend(q.index_select(0, g.token_index), k_pool, v_pool, g))
        return y

    def attend(self, q: torch.Tensor, k_pool, v_pool, g: AttnGroup) -> torch.Tensor:
        """q (N_g, H, D) of one group -> attention output (N_g, H * D)."""
        H, H_kv, D = self.n_head, self.n_kv_head, self.head_dim
        S, Qmax = g.num_seqs, g.max_query_len
        # gather each sequence's blocks in table order: one row of bs * H_kv * D numbers per block
        keys = F.embedding(g.block_tables, k_pool.view(self.num_blocks, -1))  # (S, max_blocks, bs * H_kv * D)
        values = F.embedding(g.block_tables, v_pool.view(self.num_blocks, -1))
        keys = keys.view(S, -1, H_kv, D).transpose(1, 2)  # (S, H_kv, Kmax = max_blocks * bs, D)
        values = values.view(S, -1, H_kv, D).transpose(1, 2)
        G = H // H_kv  # query heads per K/V head (grouped-query attention; 1 for multi-head)
        if Qmax == 1:  # decode only: one query per sequence, already in order
            queries = q.view(S, H_kv, G, D)  # the G query heads that read K/V head j become G query rows of it
            y = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.attn_mask)  # (S, H_kv, G, D)
            return y.reshape(S, H * D)  # query head j*G + i is row i of K/V head j: heads in order again
        queries = q.new_zeros(S * Qmax, H, D).index_copy_(0, g.pad_index, q)
        queries = queries.view(S, Qmax, H_kv, G, D).permute(0, 2, 3, 1, 4).reshape(S, H_kv, G * Qmax, D)
        mask = g.attn_mask.repeat(1, 1, G, 1) if G > 1 else g.attn_mask  # each group's rows see the same keys
        y = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)  # (S, H_kv, G * Qmax, D)
        y = y.view(S, H_kv, G, Qmax, D).permute(0, 3, 1, 2, 4).reshape(S * Qmax, H * D)
        return y[g.pad_index]  # (N_g, H * D): padding rows dropped
    # --8<-- [end:attention]

    # --8<-- [start:forward]
    @torch.inference_mode()
    def execute(self, m: ModelInput, all_logits: bool = False) -> torch.Tensor:
        """The model's forward on the packed batch -> logits (R, V) at m.logits_indices
        (or (N, V) for every packed token with all_logits, e.g. to verify draft tokens)."""
        model = self.model
        x, pos = model.embed(m.input_ids, m.positions)  # (N, C); pos: rotary angles for Llama, else None
        for i, block in enumerate(model.blocks):
            q, k, v = block.attention_qkv(x, pos)  # norm + projections: (N, H, D), (N, H_kv, D) x 2
            x = x + block.attention_out(self.attention(i, q, k, v, m))
            x = x + block.feed_forward(x)
        if not all_logits:
            x = x[m.logits_indices]  # only the rows we sample from pay for the (C, V) head
        return model.head(x)
    # --8<-- [end:forward]
