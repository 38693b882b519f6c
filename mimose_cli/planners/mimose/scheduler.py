"""Mimose's greedy scheduler: which blocks to checkpoint so that a batch fits.

The paper's rule (Mimose, arXiv 2209.02478, section 4.4): order the blocks by predicted
memory, treating blocks within ±10 % of each other as one size (a *bucket*) and preferring
earlier blocks within a bucket; then, until the excess is covered, take the smallest block
that covers the remaining excess on its own, else the largest block left.

Earlier blocks go first because backward recomputes a checkpointed block while every block
before it still holds its activations: checkpointing the last block frees nothing at the peak,
checkpointing the first frees its bytes for nearly the whole backward.
"""

import math
from typing import Callable, Sequence


def buckets_of(block_bytes: Sequence[float], bucket: float = 0.10) -> list:
    """Groups of block indices from the smallest to the largest bucket, each in forward order.

    A bucket starts at its largest block and takes every block down to ``(1 - bucket)`` of
    it, so sizes within ±10 % of one another count as the same size.
    """
    by_size = sorted(range(len(block_bytes)), key=lambda i: (-block_bytes[i], i))
    buckets, lead = [], None
    for index in by_size:
        if lead is None or block_bytes[index] < lead * (1.0 - bucket):
            buckets.append([])
            lead = block_bytes[index]
        buckets[-1].append(index)
    return [sorted(group) for group in reversed(buckets)]


class Greedy:
    """The greedy choice, one block at a time, so a caller can keep going past the first
    estimate of the excess (see ``greedy_plan_checked``)."""

    def __init__(self, block_bytes: Sequence[float], bucket: float = 0.10):
        self.block_bytes = block_bytes
        groups = buckets_of(block_bytes, bucket)
        self.bucket = {i: rank for rank, group in enumerate(groups) for i in group}
        self.left = [i for group in groups for i in group]
        self.plan: list = []

    def take(self, excess_bytes: float) -> int | None:
        """Add the smallest block that covers ``excess_bytes``, else the largest; None when
        every block is in the plan already. "Smallest" is by bucket, then forward order, and
        a block covers by its own bytes (a bucket's members differ by up to 10 %)."""
        if not self.left:
            return None
        position = next((k for k, i in enumerate(self.left) if self.block_bytes[i] >= excess_bytes),
                        None)
        if position is None:  # nothing covers it alone: the largest bucket's earliest block
            largest = self.bucket[self.left[-1]]
            position = next(k for k, i in enumerate(self.left) if self.bucket[i] == largest)
        index = self.left.pop(position)
        self.plan.append(index)
        return index

    def cover(self, excess_bytes: float) -> float:
        """Take blocks until their bytes cover ``excess_bytes``; returns what is still uncovered."""
        while excess_bytes > 0:
            index = self.take(excess_bytes)
            if index is None:
                break
            excess_bytes -= self.block_bytes[index]
        return excess_bytes


def greedy_plan(block_bytes: Sequence[float], excess_bytes: float, bucket: float = 0.10) -> tuple:
    """The paper's greedy: blocks to checkpoint so their bytes cover ``excess_bytes``.

    ``block_bytes[i]`` is what checkpointing block ``i`` frees; ``excess_bytes`` how far the
    predicted peak is over the limit. Returns the plan sorted; empty when the excess is <= 0,
    every block when even all of them do not cover it.
    """
    greedy = Greedy(block_bytes, bucket)
    greedy.cover(excess_bytes)
    return tuple(sorted(greedy.plan))


def greedy_plan_checked(block_bytes: Sequence[float], predict_peak: Callable[[tuple], float],
                        limit_bytes: float, bucket: float = 0.10) -> tuple:
    """The greedy, re-checked with a full peak predictor: returns ``(plan, predicted_peak, fits)``.

    The excess is first ``predict_peak(()) - limit_bytes``; after the greedy has covered it the
    whole plan is predicted again (the peak may sit in backward, where a recomputed block comes
    back), and the greedy goes on with the remaining shortfall until the plan fits or holds
    every block. Each round adds at least one block, so there are at most ``len`` rounds and
    usually one or two. Then, since block bytes only approximate how much the peak drops, the
    blocks taken are tried out again, last taken first, and left out when the plan fits
    without them (each try is one prediction; most plans need one or two).
    """
    greedy = Greedy(block_bytes, bucket)
    plan = ()
    peak = predict_peak(plan)
    # A peak that is not a number never fits (as in ``choices.choice_plan_checked``): its excess
    # covers nothing, so every block is taken.
    while not peak <= limit_bytes and greedy.left:
        excess = peak - limit_bytes
        greedy.cover(excess if excess > 0 else math.inf)
        plan = tuple(sorted(greedy.plan))
        peak = predict_peak(plan)
    if not peak <= limit_bytes:
        return plan, peak, False
    for index in reversed(greedy.plan[1:]):
        trial = tuple(i for i in plan if i != index)
        trial_peak = predict_peak(trial)
        if not trial_peak <= limit_bytes:
            break
        plan, peak = trial, trial_peak
    return plan, peak, True
