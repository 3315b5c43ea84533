"""Mixture of experts with expert parallelism: top-k routing, capacity and drops, all-to-all dispatch and combine.

What it shows
    1. A mixture-of-experts (MoE) layer: a softmax router picks the top-k of E experts for every token, each expert
       takes at most `capacity = ceil(factor * N * k / E)` of a group's N tokens, and the assignments beyond that
       are dropped (the token keeps only its residual path for that choice).
    2. Expert parallelism on W ranks: rank r owns experts [r*E/W, (r+1)*E/W). Each rank routes its own tokens, sends
       every kept (token, expert) pair to the expert's owner with dist.all_to_all_single and per-rank split sizes,
       the owner runs its experts, and a second all-to-all sends the results back to be combined. Forward output,
       the loss and every gradient (router and experts) equal a dense MoE computed in one process, with the same
       drops under the same capacity rule (one capacity group per rank, as in GShard).
    3. Load-balance statistics: tokens per expert and the dropped fraction for several capacity factors, from
       the expert-parallel run and checked against the dense count.
    4. The auxiliary load-balancing loss of Switch Transformers, E * sum_i f_i * P_i, in a short expert-parallel
       training run with and without it: how the busiest expert's share and the drop rate change.

References: "Switch Transformers" (Fedus et al., https://arxiv.org/abs/2101.03961) for the capacity factor and the
auxiliary loss; "GShard" (Lepikhin et al., https://arxiv.org/abs/2006.16668) for top-2 routing, groups and
capacity-based dispatch with all-to-all.

How to run (W must divide the number of experts)
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/moe_expert_parallel.py -w 2
    torchrun --nproc-per-node 4 tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/moe_expert_parallel.py
    ... --top-k 1 --no-renormalize --capacity-factor 1.0      # Switch-style routing

Runtime on 2 cores: about 5 s at -w 2 on an idle machine (about 20 s at load 6 to 9), 3 s with --smoke.

Try next
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/moe_expert_parallel.py \\
        --top-k 1 --no-renormalize --capacity-factor 1.0
        -> Switch-style top-1 routing: every drop now drops the whole token (fully_dropped equals dropped)
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/moe_expert_parallel.py --skew 0
        -> unshifted inputs: the router spreads tokens almost evenly; from factor 1.25 up nothing drops, and the
           aux loss has nothing left to fix
    python tutorial/part2-parallelism/chapter07-pipeline-expert/scripts/moe_expert_parallel.py -w 3
        -> 3 ranks cannot share 4 experts evenly: a one-line usage error, exit 2
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mlsys import cli, plot, report
from mlsys.launch import RankContext, launch


@dataclass
class Settings(cli.DistArgs, cli.PlotArgs):
    num_experts: int = 4
    """Experts E in the layer; the world size must divide it."""
    top_k: int = 2
    """Experts each token is sent to."""
    renormalize: bool = True
    """Rescale the k chosen router probabilities to sum to 1 (--no-renormalize keeps the raw softmax values)."""
    tokens: int = 256
    """Tokens N on each rank (one capacity group per rank)."""
    hidden: int = 32
    """Model width C; each expert is an MLP C -> 4C -> C."""
    capacity_factor: float = 1.25
    """Slots per expert as a multiple of the fair share N*k/E, for the equality check and training."""
    factors: list[float] = field(default_factory=lambda: [0.5, 1.0, 1.25, 1.5, 2.0])
    """Capacity factors for the drop-rate table."""
    skew: float = 1.0
    """Shift of the input distribution along one direction: makes the untrained router prefer some experts."""
    train_steps: int = 40
    """Adam steps of the load-balancing comparison (0 skips it)."""
    aux_weight: float = 0.05
    """Weight of the auxiliary load-balancing loss in the comparison run (the other run uses 0)."""
    example_tokens: int = 6
    """Tokens per rank in the small routing drawn as dispatch.png (its own capacity group)."""

    def validate(self) -> None:
        if self.num_experts < 1 or self.world_size < 1 or self.num_experts % self.world_size:
            raise cli.UsageError(f"the world size ({self.world_size}) must divide --num-experts ({self.num_experts})")
        if not 1 <= self.top_k <= self.num_experts:
            raise cli.UsageError(f"--top-k must be in 1..{self.num_experts}, got {self.top_k}")
        if self.tokens < 1 or self.hidden < 1:
            raise cli.UsageError("--tokens and --hidden must be at least 1")
        if not 1 <= self.example_tokens <= min(self.tokens, 16):
            raise cli.UsageError(f"--example-tokens must be in 1..min(--tokens, 16), got {self.example_tokens}")
        if self.capacity_factor <= 0 or any(f <= 0 for f in self.factors):
            raise cli.UsageError("capacity factors must be positive")
        if self.train_steps < 0 or self.aux_weight < 0:
            raise cli.UsageError("--train-steps and --aux-weight must be >= 0")


# --8<-- [start:routing]
def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (N, E) -> probs (N, E) softmax, weights (N, k) for the chosen experts, experts (N, k) their ids."""
    probs = logits.softmax(dim=-1)  # (N, E)
    weights, experts = probs.topk(top_k, dim=-1)  # (N, k) each, best first
    if renormalize:  # the k weights sum to 1; with k = 1 this makes every weight 1
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, experts


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, factor: float) -> int:
    """Slots per expert: the fair share N*k/E of a group's assignments, times the capacity factor, rounded up."""
    return math.ceil(factor * num_tokens * top_k / num_experts)


def keep_mask(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """experts (N, k) -> (N, k) bool: does this assignment get one of its expert's `capacity` slots?

    Priority as in GShard: every token's first choice before any token's second choice, and within one choice
    the earlier token first. Position of an assignment = how many earlier assignments chose the same expert.
    """
    N, k = experts.shape
    one_hot = F.one_hot(experts.t().reshape(-1), num_experts)  # (k*N, E), choice-major order
    position = (one_hot.cumsum(dim=0) - 1) * one_hot  # (k*N, E): slot index where chosen, 0 elsewhere
    slot = position.sum(dim=-1).view(k, N).t()  # (N, k)
    return slot < capacity
# --8<-- [end:routing]


# --8<-- [start:aux]
def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch Transformers' auxiliary loss E * sum_i f_i * P_i for one group.

    f_i: fraction of the N*k assignments that chose expert i (counted before capacity; not differentiable).
    P_i: mean router probability of expert i over the N tokens. Perfect balance gives 1; everything on one expert
    with probability 1 gives E. Only P carries a gradient, and it pushes probability away from busy experts.
    """
    E = probs.size(-1)
    f = torch.bincount(experts.reshape(-1), minlength=E).to(probs.dtype) / experts.numel()  # (E,)
    P = probs.mean(dim=0)  # (E,)
    return E * (f * P).sum()
# --8<-- [end:aux]


class ExpertBank(nn.Module):
    """Experts [first, first + n) of the layer, each an MLP C -> 4C -> C, stored as stacked tensors."""

    def __init__(self, n: int, hidden: int, first: int = 0, generator: torch.Generator | None = None):
        super().__init__()
        self.first = first
        self.w1 = nn.Parameter(torch.randn(n, hidden, 4 * hidden, generator=generator) / math.sqrt(hidden))
        self.b1 = nn.Parameter(torch.zeros(n, 4 * hidden))
        self.w2 = nn.Parameter(torch.randn(n, 4 * hidden, hidden, generator=generator) / math.sqrt(4 * hidden))
        self.b2 = nn.Parameter(torch.zeros(n, hidden))

    def shard(self, first: int, n: int) -> ExpertBank:
        """A copy of experts [first, first + n): what one expert-parallel rank owns."""
        part = ExpertBank(n, self.w1.size(1), first).to(self.w1.device)
        with torch.no_grad():
            for name in ("w1", "b1", "w2", "b2"):
                getattr(part, name).copy_(getattr(self, name)[first:first + n])
        return part

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Global expert id e on tokens x (M, C) -> (M, C)."""
        j = e - self.first
        return F.gelu(x @ self.w1[j] + self.b1[j], approximate="tanh") @ self.w2[j] + self.b2[j]


class MoE(nn.Module):
    """The full layer in one process: router + all E experts. `dense_forward` is the reference."""

    def __init__(self, args: Settings):
        super().__init__()
        gen = torch.Generator().manual_seed(args.seed)
        self.args = args
        self.gate = nn.Linear(args.hidden, args.num_experts, bias=False)
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn(args.num_experts, args.hidden, generator=gen) / math.sqrt(args.hidden))
        self.experts = ExpertBank(args.num_experts, args.hidden, generator=gen)


def dense_forward(moe: MoE, x: torch.Tensor, groups: int, factor: float) -> tuple[torch.Tensor, dict]:
    """x (G*N, C), split into `groups` capacity groups of N tokens -> y (G*N, C) and routing statistics."""
    a = moe.args
    ys, keeps, experts_all, aux = [], [], [], []
    for xg in x.chunk(groups):  # (N, C): the tokens one expert-parallel rank holds
        probs, weights, experts = route(moe.gate(xg), a.top_k, a.renormalize)
        keep = keep_mask(experts, a.num_experts, expert_capacity(len(xg), a.num_experts, a.top_k, factor))
        y = torch.zeros_like(xg)
        for e in range(a.num_experts):
            tok, slot = torch.nonzero((experts == e) & keep, as_tuple=True)  # kept assignments to expert e
            y = y.index_add(0, tok, weights[tok, slot, None] * moe.experts.expert(e, xg[tok]))
        ys.append(y)
        keeps.append(keep)
        experts_all.append(experts)
        aux.append(load_balancing_loss(probs, experts))
    return torch.cat(ys), {"keep": torch.cat(keeps), "experts": torch.cat(experts_all), "aux": torch.stack(aux)}


# --8<-- [start:all_to_all]
class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward is the reverse all-to-all (splits swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None
# --8<-- [end:all_to_all]


def ep_forward(gate: nn.Linear, bank: ExpertBank, x: torch.Tensor, args: Settings, factor: float,
               group=None) -> tuple[torch.Tensor, dict]:
    """This rank's tokens x (N, C) through the expert-parallel layer -> y (N, C), routing statistics."""
    W, E = dist.get_world_size(group), args.num_experts
    local = E // W  # experts per rank; expert e lives on rank e // local
    probs, weights, experts = route(gate(x), args.top_k, args.renormalize)  # (N, E), (N, k), (N, k)
    keep = keep_mask(experts, E, expert_capacity(len(x), E, args.top_k, factor))  # (N, k)

    # 1. the kept (token, choice) pairs, sorted by expert, hence by destination rank
    tok, slot = torch.nonzero(keep, as_tuple=True)  # (S,) each
    chosen = experts[tok, slot]  # (S,) expert ids
    order = torch.argsort(chosen, stable=True)
    tok, slot, chosen = tok[order], slot[order], chosen[order]
    send_counts = torch.bincount(chosen, minlength=E)  # (E,) rows for each expert

    # 2. tell every owner how many rows of each of its experts are coming: (W*local,) -> (W, local) received
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # equal splits: `local` counts per rank
    recv_counts = recv_counts.view(W, local)  # [source rank, my expert]
    in_splits = send_counts.view(W, local).sum(dim=1).tolist()  # rows to each rank
    out_splits = recv_counts.sum(dim=1).tolist()  # rows from each rank

    # 3. dispatch, compute each local expert on its rows (from every source), combine back
    received = AllToAll.apply(x[tok], out_splits, in_splits, group)  # (R, C), source-major, expert-minor
    row_expert = (torch.arange(local, device=x.device).repeat(W).repeat_interleave(recv_counts.reshape(-1))
                  + bank.first)  # (R,)
    out = torch.zeros_like(received)
    for e in range(bank.first, bank.first + local):
        rows = torch.nonzero(row_expert == e, as_tuple=True)[0]
        out = out.index_copy(0, rows, bank.expert(e, received[rows]))
    returned = AllToAll.apply(out, in_splits, out_splits, group)  # (S,) rows, in the order we sent them
    y = torch.zeros_like(x).index_add(0, tok, weights[tok, slot, None] * returned)
    return y, {"keep": keep, "experts": experts, "aux": load_balancing_loss(probs, experts),
               "sent_rows": in_splits, "received_rows": out_splits}


def make_data(args: Settings, rank: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s tokens x (N, C) and regression targets (N, C): a skewed Gaussian and a fixed nonlinear map."""
    gen = torch.Generator().manual_seed(args.seed * 7919 + 1)
    direction = torch.randn(args.hidden, generator=gen)
    teacher = torch.randn(args.hidden, args.hidden, generator=gen) / math.sqrt(args.hidden)
    gen.manual_seed(args.seed * 7919 + 100 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen) + args.skew * direction / direction.norm() * 3
    return x.to(device), torch.tanh(x @ teacher).to(device)


def local_loss(y: torch.Tensor, target: torch.Tensor, aux: torch.Tensor, W: int, aux_weight: float) -> torch.Tensor:
    """This rank's share of the global loss: summed over ranks it is mean squared error + aux_weight * mean aux."""
    return ((y - target) ** 2).sum() / (target.numel() * W) + aux_weight * aux / W


def balance_stats(experts: torch.Tensor, keep: torch.Tensor, E: int) -> dict:
    """Counts from (N, k) choices and keep mask: per-expert load, dropped assignments and fully dropped tokens."""
    return {"tokens_per_expert": torch.bincount(experts.reshape(-1), minlength=E).tolist(),
            "kept_per_expert": torch.bincount(experts[keep], minlength=E).tolist(),
            "assignments": experts.numel(), "dropped": int((~keep).sum()),
            "tokens": len(experts), "fully_dropped_tokens": int((~keep).all(dim=1).sum())}


def gathered(t: torch.Tensor) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0 (same shapes on all ranks)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def check_against_dense(ctx: RankContext, args: Settings) -> dict:
    """One forward + backward, expert-parallel vs dense in one process: outputs, drops, loss and gradients."""
    W, local = ctx.world_size, args.num_experts // ctx.world_size
    moe = MoE(args).to(ctx.device)  # every rank builds the same full layer from the seed; the dense reference
    gate = nn.Linear(args.hidden, args.num_experts, bias=False, device=ctx.device)
    gate.load_state_dict(moe.gate.state_dict())  # replicated router
    bank = moe.experts.shard(ctx.rank * local, local)  # this rank's experts
    x, target = make_data(args, ctx.rank, ctx.device)

    y, info = ep_forward(gate, bank, x, args, args.capacity_factor)
    loss = local_loss(y, target, info["aux"], W, args.aux_weight)
    loss.backward()
    dist.all_reduce(gate.weight.grad)  # the router is data-parallel: sum its gradient over ranks
    total = loss.detach().clone()
    dist.all_reduce(total)

    xs, ts = zip(*(make_data(args, r, ctx.device) for r in range(W)))  # the whole batch, as one process would see it
    y_ref, ref = dense_forward(moe, torch.cat(xs), W, args.capacity_factor)
    loss_ref = sum(local_loss(yg, tg, a, W, args.aux_weight) for yg, tg, a in zip(y_ref.chunk(W), ts, ref["aux"]))
    loss_ref.backward()
    loss_ref = loss_ref.detach()

    report.expect_equal("keep mask (drops)", gathered(info["keep"]), ref["keep"])
    report.expect_close("MoE output", gathered(y.detach()), y_ref.detach(), rtol=1e-5, atol=1e-5)
    report.expect_close("loss", total, loss_ref.detach(), rtol=1e-5, atol=1e-6)
    report.expect_close("router gradient", gate.weight.grad, moe.gate.weight.grad, rtol=1e-4, atol=1e-6)
    for name in ("w1", "b1", "w2", "b2"):
        ref_grad = getattr(moe.experts, name).grad[bank.first:bank.first + local]
        report.expect_close(f"expert {name} gradient", getattr(bank, name).grad, ref_grad, rtol=1e-4, atol=1e-6)
    stats = balance_stats(ref["experts"], ref["keep"], args.num_experts)
    return {"loss": total.item(), "loss_dense": loss_ref.item(), "sent_rows": info["sent_rows"],
            "received_rows": info["received_rows"], **stats}


def drop_table(ctx: RankContext, args: Settings) -> list[dict]:
    """Dropped fraction per capacity factor, measured in the expert-parallel forward and checked against dense."""
    moe = MoE(args).to(ctx.device)
    local = args.num_experts // ctx.world_size
    bank = moe.experts.shard(ctx.rank * local, local)
    x, _ = make_data(args, ctx.rank, ctx.device)
    xs = torch.cat([make_data(args, r, ctx.device)[0] for r in range(ctx.world_size)])
    rows = []
    with torch.no_grad():
        for factor in args.factors:
            _, info = ep_forward(moe.gate, bank, x, args, factor)
            keep, experts = gathered(info["keep"]), gathered(info["experts"])
            report.expect_equal(f"drops at factor {factor}", keep,
                                dense_forward(moe, xs, ctx.world_size, factor)[1]["keep"])
            s = balance_stats(experts, keep, args.num_experts)
            rows.append({"capacity_factor": factor,
                         "capacity": expert_capacity(args.tokens, args.num_experts, args.top_k, factor),
                         # per expert, summed over the ranks' slots: the bound on each kept_per_expert number
                         "capacity_all_ranks": ctx.world_size * expert_capacity(args.tokens, args.num_experts,
                                                                                args.top_k, factor),
                         "dropped_assignments": s["dropped"], "drop_rate": s["dropped"] / s["assignments"],
                         "fully_dropped_tokens": s["fully_dropped_tokens"],
                         "kept_per_expert": " ".join(map(str, s["kept_per_expert"]))})
    return rows


def train_balance(ctx: RankContext, args: Settings, aux_weight: float) -> dict:
    """Expert-parallel Adam training; load statistics of the first and last step."""
    W, local = ctx.world_size, args.num_experts // ctx.world_size
    moe = MoE(args).to(ctx.device)
    gate, bank = moe.gate, moe.experts.shard(ctx.rank * local, local)
    opt = torch.optim.Adam([*gate.parameters(), *bank.parameters()], lr=3e-3)
    x, target = make_data(args, ctx.rank, ctx.device)
    history = []
    for _ in range(args.train_steps):
        y, info = ep_forward(gate, bank, x, args, args.capacity_factor)
        loss = local_loss(y, target, info["aux"], W, aux_weight)
        opt.zero_grad()
        loss.backward()
        dist.all_reduce(gate.weight.grad)
        opt.step()
        s = balance_stats(gathered(info["experts"]), gathered(info["keep"]), args.num_experts)
        mse = ((y.detach() - target) ** 2).mean().reshape(1)
        aux = info["aux"].detach().reshape(1)
        history.append({"max_share": max(s["tokens_per_expert"]) / s["assignments"],
                        "drop_rate": s["dropped"] / s["assignments"],
                        "mse": float(gathered(mse).mean()), "aux": float(gathered(aux).mean())})
    return {"aux_weight": aux_weight, "first": history[0], "last": history[-1]}


def dispatch_example(ctx: RankContext, args: Settings) -> dict:
    """A real routing of a tiny batch: the first --example-tokens tokens of every rank through `ep_forward`
    (router, capacity, both all-to-alls), with every rank's top-k choices, keep mask and rows sent per rank."""
    W, n, local = ctx.world_size, args.example_tokens, args.num_experts // ctx.world_size
    moe = MoE(args).to(ctx.device)
    bank = moe.experts.shard(ctx.rank * local, local)
    x, _ = make_data(args, ctx.rank, ctx.device)
    with torch.no_grad():
        _, info = ep_forward(moe.gate, bank, x[:n], args, args.capacity_factor)  # (n, C) tokens of this rank
    sent = gathered(torch.tensor(info["sent_rows"], device=ctx.device))  # (W*W,): [source rank, destination]
    return {"tokens_per_rank": n, "capacity": expert_capacity(n, args.num_experts, args.top_k, args.capacity_factor),
            "experts": gathered(info["experts"]).view(W, n, -1).tolist(),  # [rank][token][choice] -> expert
            "keep": gathered(info["keep"]).view(W, n, -1).tolist(), "sent_rows": sent.view(W, W).tolist()}


def worker(ctx: RankContext, args: Settings) -> dict:
    torch.manual_seed(args.seed)
    result = {"world_size": ctx.world_size, "check": check_against_dense(ctx, args),
              "dispatch": dispatch_example(ctx, args), "drop_table": drop_table(ctx, args)}
    if args.train_steps:
        result["training"] = [train_balance(ctx, args, w) for w in (0.0, args.aux_weight)]
    return result


def draw(result: dict, args: Settings) -> None:
    """Left: tokens each expert was chosen for vs the slots at each capacity factor. Right: drop rate vs factor."""
    plt = plot.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    wanted = result["check"]["tokens_per_expert"]
    left.bar(range(len(wanted)), wanted, color="C0", label="chosen by the router")
    colors = plt.cm.viridis([i / max(1, len(result["drop_table"])) for i in range(len(result["drop_table"]))])
    for row, color in zip(result["drop_table"], colors):
        left.axhline(row["capacity"] * args.world_size, color=color, ls="--", lw=1.2,
                     label=f"slots at factor {row['capacity_factor']:g}")
    left.set(xlabel="expert", ylabel="assignments (all ranks)", title="load per expert",
             xticks=range(len(wanted)))
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)  # below: keeps lines clear
    factors = [r["capacity_factor"] for r in result["drop_table"]]
    right.plot(factors, [r["drop_rate"] for r in result["drop_table"]], "o-", label="assignments dropped")
    right.plot(factors, [r["fully_dropped_tokens"] / (args.tokens * args.world_size) for r in result["drop_table"]],
               "s--", label="tokens with every choice dropped")
    right.set(xlabel="capacity factor", ylabel="fraction", title=f"drops, top-{args.top_k} of {args.num_experts}")
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    print(f"figure: {plot.save(fig, args, 'moe_drops')}")


def draw_dispatch(example: dict, args: Settings) -> dict:
    """Tokens -> experts on their ranks (dispatch all-to-all) -> back to their tokens (combine all-to-all), one
    line per kept (token, choice) of the real routing; a dropped choice gets no line but an "x e3" (its expert)
    in a column left of its token. Returns the lines (kept or dropped) and the rows each rank sends to each rank,
    counted from those lines."""
    plt = plot.pyplot()
    W, n, E = len(example["experts"]), example["tokens_per_rank"], args.num_experts
    local = E // W
    token_y = {(r, t): -(r * (n + 1) + t) for r in range(W) for t in range(n)}  # rank blocks, top to bottom
    rows = W * (n + 1) - 1
    expert_y = {e: -(e + 0.5) * rows / E + 0.5 for e in range(E)}
    fig, ax = plt.subplots(figsize=(9, 0.3 * rows + 1.6))
    colour = plot.colours(f"rank {r}" for r in range(W))
    lines, send = [], [[0] * W for _ in range(W)]
    for (r, t), y in token_y.items():
        for choice, (e, kept) in enumerate(zip(example["experts"][r][t], example["keep"][r][t])):
            lines.append([r, t, choice, e, e // local, bool(kept)])
            c = colour[f"rank {r}"]
            if kept:
                send[r][e // local] += 1
                ax.plot([0.15, 1.35], [y, expert_y[e]], color=c, lw=1.3)  # dispatch
                ax.plot([1.65, 2.85], [expert_y[e], y], color=c, lw=1.3, ls="--")  # combine
            else:  # over capacity: this choice never leaves the rank; marked left of the token, clear of the lines
                ax.text(-0.3 - 0.22 * choice, y, f"x e{e}", color="#c44e52", ha="right", va="center", fontsize=8)
        for x in (0, 3):
            ax.text(x, y, f"r{r} t{t}", ha="center", va="center", fontsize=8,
                    bbox={"boxstyle": "round", "fc": colour[f"rank {r}"], "alpha": 0.35})
    for owner in range(W):  # experts grouped by the rank that owns them
        ys = [expert_y[e] for e in range(owner * local, (owner + 1) * local)]
        ax.add_patch(plt.Rectangle((1.3, min(ys) - 0.8), 0.4, max(ys) - min(ys) + 1.6, fc=colour[f"rank {owner}"],
                                   alpha=0.15, ec="0.4"))
        ax.text(1.5, max(ys) + 1.0, f"rank {owner}", ha="center", fontsize=8)
        for e in range(owner * local, (owner + 1) * local):
            ax.text(1.5, expert_y[e], f"expert {e}", ha="center", va="center", fontsize=8,
                    bbox={"boxstyle": "round", "fc": "white"})
    ax.text(-0.41, 1.2, "dropped\nchoices", ha="right", va="bottom", fontsize=8, color="#c44e52")
    for x, head in ((0, "tokens, on their rank"), (0.75, "dispatch\n(all-to-all)"), (1.5, "experts compute"),
                    (2.25, "combine\n(all-to-all back)"), (3, "weighted sum\nper token")):
        ax.text(x, 2.2, head, ha="center", va="bottom", fontsize=9, weight="bold")
    text = "; ".join(f"rank {r} sends " + ", ".join(f"{send[r][d]} to rank {d}" for d in range(W)) for r in range(W))
    ax.text(1.5, -rows - 1.2, f"rows per rank pair: {text} (capacity {example['capacity']} per expert and rank)",
            ha="center", va="top", fontsize=8)
    ax.set(xlim=(-0.95, 3.4), ylim=(-rows - 2.2, 3.4))
    ax.axis("off")
    print(f"figure: {plot.save(fig, args, 'dispatch')}")
    return {"lines": lines, "send_counts": send}


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"tokens": 64, "hidden": 16, "train_steps": 5, "world_size": 2},
                     world_sizes=lambda w: 1 <= w <= 8, world_sizes_text="1..8 dividing --num-experts")
    result = launch(worker, args)
    if result is None:
        return 0
    c, E, k = result["check"], args.num_experts, args.top_k
    cap = expert_capacity(args.tokens, E, k, args.capacity_factor)
    print(f"MoE: E={E} experts on W={args.world_size} ranks ({E // args.world_size} each), top-{k}, "
          f"renormalize={args.renormalize}, N={args.tokens} tokens per rank, model width {args.hidden}")
    print(f"capacity factor {args.capacity_factor}: {cap} slots per expert per rank (= ceil({args.capacity_factor} "
          f"* {args.tokens} * {k} / {E}))")
    print(f"tokens per expert (router's choice, all ranks): {c['tokens_per_expert']}")
    kept_label = f"kept per expert (all ranks, at most W * {cap}):"
    print(f"{kept_label:47s} {c['kept_per_expert']}")
    print(f"dropped {c['dropped']} of {c['assignments']} assignments ({c['dropped'] / c['assignments']:.1%}); "
          f"{c['fully_dropped_tokens']} tokens lost " + ("their expert" if k == 1 else f"all {k} of their experts"))
    print(f"rank 0 sent {c['sent_rows']} rows to ranks 0..{args.world_size - 1} and received {c['received_rows']}")
    d = result["dispatch"]
    print(f"the small routing drawn in dispatch.png: the first {d['tokens_per_rank']} tokens of each rank, "
          f"capacity {d['capacity']} per expert ("
          + ("tN->a: token N chose expert a" if k == 1 else "tN->a,b: token N chose experts a and b")
          + "; x = dropped)")
    for r, (choices, keeps) in enumerate(zip(d["experts"], d["keep"])):
        print(f"  rank {r}: " + "  ".join(f"t{t}->" + ",".join(f"{e}" + ("" if k else "x") for e, k in zip(es, ks))
                                           for t, (es, ks) in enumerate(zip(choices, keeps))))
    print(f"  rows sent [from rank][to rank]: {d['sent_rows']}")
    print(f"OK: expert-parallel output, drops, loss ({c['loss']:.6f} vs dense {c['loss_dense']:.6f}) and the "
          "gradients of router and experts equal the dense MoE in one process\n")
    print("dropped assignments per capacity factor (expert-parallel run, equal to the dense count; capacity is per\n"
          "expert and rank, capacity_all_ranks and kept_per_expert are summed over the W ranks):")
    print(report.table(result["drop_table"], floatfmt=".3f"))
    if "training" in result:
        print(f"\n{args.train_steps} Adam steps, capacity factor {args.capacity_factor}: without and with the "
              "auxiliary loss (max share = busiest expert's fraction of assignments; fair share is "
              f"{1 / E:.3f})")
        rows = [{"aux_weight": t["aux_weight"], "step": when, **{key: t[when][key] for key in t[when]}}
                for t in result["training"] for when in ("first", "last")]
        print(report.table(rows, floatfmt=".3f"))
        off, on = (t["last"] for t in result["training"])
        print(f"after {args.train_steps} steps, with the auxiliary loss vs without: busiest expert's share "
              f"{on['max_share']:.3f} vs {off['max_share']:.3f}, drop rate {on['drop_rate']:.3f} vs "
              f"{off['drop_rate']:.3f}, task loss {on['mse']:.3f} vs {off['mse']:.3f}")
    draw(result, args)
    result["dispatch"]["drawn"] = draw_dispatch(result["dispatch"], args)
    if args.json:
        report.write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    cli.run(main)
