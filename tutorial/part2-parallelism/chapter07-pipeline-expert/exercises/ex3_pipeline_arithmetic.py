"""Exercise ch07.3 (warm-up) — the arithmetic of the chapter: the bubble, how many micro-batches hide it, how many
micro-batches a stage holds under GPipe and 1F1B, and where a rank sits in a (pp, dp, tp) mesh. Pure Python.

Check your work:  make check EX=ch07.3
"""

from __future__ import annotations


def bubble_fraction(num_stages: int, num_micro: int) -> float:
    """Idle fraction of every stage with equal stages: a step lasts m + p - 1 slots, of which a stage works m."""
    raise NotImplementedError("TODO: (p - 1) / (m + p - 1)")


def micro_batches_for(num_stages: int, max_bubble: float) -> int:
    """The smallest number of micro-batches m >= 1 whose bubble is at most `max_bubble` (0 < max_bubble < 1).
    Example: p = 4, max_bubble 0.1 -> 27 (bubble 3/30 = 0.1)."""
    raise NotImplementedError("TODO: solve (p - 1) / (m + p - 1) <= b for the smallest integer m")


def peak_in_flight(schedule: str, stage: int, num_stages: int, num_micro: int) -> int:
    """The most micro-batches stage `stage` holds at once between their forward and their backward.

    "gpipe": all forwards before any backward. "1f1b": warm-up of p - 1 - stage forwards, then one forward and one
    backward in turn, so at most p - stage at a time (never more than m). Unknown schedule: ValueError.
    """
    raise NotImplementedError("TODO: gpipe holds all m; 1f1b holds p - stage, capped at m")


def mesh_coords(rank: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    """(pp index, dp index, tp index) of `rank` when the ranks are laid out as an array of shape (pp, dp, tp) with
    the tensor-parallel index changing fastest, as mlsys.mesh.ParallelMesh does. Example: dp=2, tp=2, pp=2,
    rank 5 -> (1, 0, 1)."""
    raise NotImplementedError("TODO: divmod by tp, then by dp")
