"""The input size's regression features and the quantities measured per block and per step:
the vocabulary the collector, the estimator and its trust rule share."""

import math

import numpy as np

FEATURES = ("BL2", "BL", "1", "B", "L2", "L")
TIME_FEATURES = ("BL2", "BL", "1")
BLOCK_QUANTITIES = ("saved_bytes", "plain_bytes", "ckpt_bytes", "gap_peak_bytes", "fwd_peak_bytes",
                    "ckpt_fwd_peak_bytes", "bwd_peak_bytes", "recompute_peak_bytes", "fwd_ms")
"""Per block, all in bytes above the live bytes at the block's entry, except ``fwd_ms``:
``saved_bytes`` what autograd saves (the paper's layer memory); ``plain_bytes`` and
``ckpt_bytes`` the live bytes the block adds until its backward, run plainly or checkpointed;
``gap_peak_bytes`` the peak between the previous block and this one; ``*fwd_peak_bytes`` the
peak during its forward; ``bwd_peak_bytes`` the peak during its backward's own ops and
``recompute_peak_bytes`` during its recompute."""
STEP_QUANTITIES = ("pre_bytes", "pre_peak_bytes", "head_peak_bytes", "tail_peak_bytes")
"""Outside the blocks: live bytes before the first block (embeddings), the peak before it,
the peak from the last block's output to the start of its backward (head, loss, head
backward) above the live bytes then, and the peak after the first block's backward."""
RANK_RTOL = 1e-9  # a singular value below this (relative) adds no rank
REACH = 64  # how far beyond the largest size measured a prediction may reach
_MAX_SAMPLES = 60  # the most recent samples fitted (a bit per sample marks which are missing)
NO_EVENT = -1e30


def features(size) -> np.ndarray:
    """Regression features of an input size ``(B, L)`` or ``(B, H, W)``, in ``FEATURES`` order."""
    batch = float(size[0])
    length = float(math.prod(size[1:]))
    return np.array((batch * length * length, batch * length, 1.0, batch, length * length, length))
