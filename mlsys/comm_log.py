"""One log of the collectives and transfers the book's parallel layers run: tensor parallelism (mlsys/tp_comm.py)
and context parallelism (mlsys/context_parallel.py) both record here, so a test or a figure can count every byte
one rank moved inside a `with comm_log() as log:` block, whichever mechanism moved it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class CommEvent:
    """One collective or transfer, as the code that ran it saw it.

    `nbytes` follows the op: for "all_reduce" the tensor, for "all_gather" its output, for "reduce_scatter" its input
    (the full buffer, comm_volume's convention); for "ring_send" and "all_to_all" the bytes this rank sends."""

    op: str  # "all_reduce", "all_gather", "reduce_scatter", "ring_send" or "all_to_all"
    phase: str  # "forward" or "backward"
    nbytes: int
    tag: str = "activation"  # "activation", or "param_grad" for the small gradient all-reduces of replicated params


_LOG: list[CommEvent] | None = None


@contextlib.contextmanager
def comm_log() -> Iterator[list[CommEvent]]:
    """Record every collective run by the recording modules (in this process) while the block is active."""
    global _LOG
    previous, _LOG = _LOG, []
    try:
        yield _LOG
    finally:
        _LOG = previous


def record(op: str, phase: str, nbytes: int, tag: str = "activation") -> None:
    if _LOG is not None:
        _LOG.append(CommEvent(op, phase, int(nbytes), tag))
