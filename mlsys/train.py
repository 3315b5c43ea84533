"""Train the tiny GPT on the synthetic JSON corpus, deterministically.

One loop, the usual recipe: AdamW (weight decay on matrices only), linear
warmup then cosine decay of the learning rate, gradient-norm clipping, and a
validation loss on fixed batches. Given the same seed (and the same torch
build and thread count), two runs produce the same losses and weights: the
model init comes from `torch.manual_seed(seed)` and every batch from a
`torch.Generator` seeded from it, so nothing else can shift the stream.

    python -m mlsys.train --preset tiny --steps 200    # a few seconds on a 2-core CPU
    python -m mlsys.train --preset small               # ~2 min; see scripts/train_weights.py

Parts III and IV reuse `lr_at`, `configure_optimizer` and `estimate_loss`
when they take this loop apart (data parallel, FSDP, pipeline).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from tqdm.auto import tqdm

from mlsys.data import get_batch, load_splits
from mlsys.model import GPT, GPTConfig, num_params


def lr_at(step: int, steps: int, lr: float, warmup_steps: int, min_lr: float) -> float:
    """Linear warmup to `lr`, then half a cosine down to `min_lr` at the last step.

    Cosine schedule: Loshchilov & Hutter, SGDR, https://arxiv.org/abs/1608.03983
    """
    if step < warmup_steps:  # warmup
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - 1 - warmup_steps)  # 0 -> 1
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def configure_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; decay only 2-D weights (matmuls, embeddings), never biases or LayerNorm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


@torch.no_grad()
def estimate_loss(model: GPT, tokens, batch_size: int, num_batches: int = 8, seed: int = 1234) -> float:
    """Mean loss over `num_batches` batches that are the same on every call (fixed seed)."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    device, block_size = model.wte.weight.device, model.config.block_size
    losses = []
    for _ in range(num_batches):
        x, y = get_batch(tokens, batch_size, block_size, gen)  # (B, T) each
        losses.append(model(x.to(device), y.to(device))[1].item())
    model.train(was_training)
    return sum(losses) / len(losses)


def train(
    config: GPTConfig,
    steps: int = 700,
    batch_size: int = 8,
    lr: float = 6e-3,
    seed: int = 0,
    *,
    warmup_steps: int | None = None,
    min_lr_ratio: float = 0.1,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    eval_every: int | None = None,
    eval_batches: int = 8,
    num_records: int = 20_000,
    data: tuple[torch.Tensor, torch.Tensor] | None = None,
    progress: bool | None = None,
    device: str | torch.device = "cpu",
) -> dict:
    """Train a fresh GPT(config) for `steps` steps of `batch_size` x block_size tokens.

    warmup_steps: default 5% of steps. eval_every: default once, at the end.
    data: (train_tokens, val_tokens) to skip generating `num_records` records.
    progress: tqdm bar; default on only when stderr is a terminal.
    device: where the model and batches live (the stream stays on the CPU).

    Returns {"model", "train_loss": [per step], "val_loss": [(step, loss)],
    "final_train_loss", "final_val_loss", "seconds", "tokens_per_second"}.
    """
    train_tokens, val_tokens = data if data is not None else load_splits(num_records, seed)
    warmup_steps = max(1, steps // 20) if warmup_steps is None else warmup_steps
    eval_every = eval_every or steps
    progress = sys.stderr.isatty() if progress is None else progress

    torch.manual_seed(seed)  # model init and dropout
    batch_gen = torch.Generator().manual_seed(seed)  # batch order, independent of the above
    model = GPT(config).to(device).train()
    optimizer = configure_optimizer(model, lr, weight_decay)
    history: dict = {"train_loss": [], "val_loss": []}

    start = time.perf_counter()
    bar = tqdm(range(steps), desc=f"train {num_params(model):,} params", disable=not progress)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup_steps, lr * min_lr_ratio)
        x, y = get_batch(train_tokens, batch_size, config.block_size, batch_gen)  # (B, T) each
        _, loss = model(x.to(device), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        history["train_loss"].append(loss.item())
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            val = estimate_loss(model, val_tokens, batch_size, eval_batches)
            history["val_loss"].append((step + 1, val))
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{val:.3f}")
    seconds = time.perf_counter() - start

    model.eval()
    return {
        "model": model,
        **history,
        "final_train_loss": estimate_loss(model, train_tokens, batch_size, eval_batches),
        "final_val_loss": history["val_loss"][-1][1] if steps else float("nan"),
        "seconds": seconds,
        "tokens_per_second": steps * batch_size * config.block_size / max(seconds, 1e-9),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a GPT preset on the synthetic JSON corpus.")
    parser.add_argument("--preset", default="tiny", help="tiny, small or draft (default: tiny)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    parser.add_argument("--lr", type=float, default=6e-3, help="peak learning rate (default: 6e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seeds init, data and batches (default: 0)")
    args = parser.parse_args()
    out = train(GPTConfig.preset(args.preset), args.steps, args.batch_size, args.lr, args.seed)
    print(f"train {out['final_train_loss']:.4f}  val {out['final_val_loss']:.4f}  in {out['seconds']:.1f} s")


if __name__ == "__main__":
    main()
