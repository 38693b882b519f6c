"""When Mimose trusts a prediction: ``Trust``, built with every fit (docs/MIMOSE.md)."""

import math
from dataclasses import dataclass, field

import numpy as np

from mimose_cli.planners.mimose.features import EXTRA_BYTES, RANK_RTOL, REACH, STEP_QUANTITIES, TOKENS, FeatureSet

_SPAN_RTOL = 1e-7
_TIMELINE = ("plain_bytes", "ckpt_bytes", "bwd_peak_bytes")
_HELD = ("plain_bytes", "ckpt_bytes", "pre_bytes", "resident_bytes", "release_bytes", *EXTRA_BYTES)
"""Quantities the timeline adds up over the blocks (what each holds, or lets go of, until its
backward; what a selective or partial checkpoint keeps): a miss in each may add up too."""
_STEP_PARTS = {"pre_bytes": "the bytes before the first block", "pre_peak_bytes": "the embeddings' peak",
               "head_peak_bytes": "the head's peak (backward never reached the last block)",
               "head_bwd_peak_bytes": "the head's backward peak (backward never reached the last block)",
               "tail_peak_bytes": "the peak after the blocks' backward"}


def _basis(design: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Orthonormal rows spanning the scaled design's rows."""
    _, singular, vt = np.linalg.svd(design / scale, full_matrices=False)
    rank = int((singular > RANK_RTOL * singular[0]).sum()) if len(singular) else 0
    return vt[:rank]


@dataclass
class Trust:
    """When Mimose trusts a prediction (docs/MIMOSE.md states the rule for users); built by
    ``Estimator.fit``, ``reason(size)`` says why a prediction is not trusted, or None.

    A prediction at an input size is trusted when all of these hold:

    1. **The samples determine it.** Memory is fitted as a linear function of the size's features
       (``estimator.FEATURES``). A least-squares fit is exact at a new size, whatever the true
       coefficients of those features, exactly when the new size's feature vector is a linear
       combination of the measured sizes' vectors (it lies in their row span). Two distinct lengths
       at one batch size do not determine the constant term, so a third length is not trusted; one
       batch size never determines what scales with the batch, so another batch size is not trusted.
       Each set of samples fitted together (one per pattern of missing measurements: an op
       measured in fewer samples, when a kernel changed with the size) is checked. Checking the
       main fit alone let fp16 runs under-predict by up to 14 %; checking all keeps them untrusted.
    2. **It is not far outside what was measured**: batch and length at most ``REACH`` times the
       largest seen (the grid on which the ops that can be a peak were chosen).
    3. **Every part of the step timeline was measured**: each block's held bytes and backward, and
       the embeddings, head and tail around them. A part never measured is not guessed.
    4. **The blocks ran in one order** in every sample (the timeline is built in that order).
    5. **An image's sides are multiples of what the model imposes** when the probes varied them
       (``Estimator.side_multiple``, ``scaling.side_multiple``: a patch's side, a convolution's
       stride, read from the probes' shapes): a convolution's output is a rounded fraction of its
       input (a stride-32 stack's last map is ``ceil(H / 32)`` wide), linear in the side only at
       such multiples.

    The fit's own misses (``residual_bytes``: how far it is from its samples, when the memory is not
    quadratic in the size as inferred) are not a reason to distrust a size; they are added to every
    predicted peak as a margin, so a model that is off is planned conservatively in proportion.
    """

    feature_set: FeatureSet = TOKENS
    scale: np.ndarray = field(default_factory=lambda: np.ones(len(TOKENS.names)))
    bases: list = field(default_factory=list)
    max_batch: float = 0.0
    max_lengths: tuple = ()
    unmeasured: tuple = ()
    residual_bytes: float = 0.0
    side_multiple: int = 1

    @classmethod
    def of(cls, estimator, keys: list, segments: np.ndarray, residual: np.ndarray, spans: list) -> "Trust":
        """The trust of a fit: ``keys`` its (quantity, block) segments, ``segments`` the segment
        of each fitted column, ``residual`` each column's largest miss on its samples (bytes;
        0 for times), ``spans`` the designs fitted together."""
        sizes = estimator.sizes
        fs = estimator.feature_set
        scale = np.abs(np.concatenate(spans)).max(axis=0) if spans else np.ones(len(fs.names))
        scale = np.where(scale > 0, scale, 1.0)
        worst = {key: float(residual[segments == n].max(initial=0.0)) for n, key in enumerate(keys)}
        held = max((v for (q, _), v in worst.items() if q in _HELD), default=0.0)
        peak = max((v for (q, _), v in worst.items() if q not in _HELD), default=0.0)
        # Held bytes add up over the blocks, a peak is one op on top: the worst case of both.
        residual_bytes = held * (estimator.num_blocks + 1) + peak
        max_lengths = tuple(float(max(dim)) for dim in zip(*(fs.lengths(s) for s in sizes)))
        return cls(fs, scale, [_basis(d, scale) for d in spans], float(max(s[0] for s in sizes)),
                   max_lengths, unmeasured_parts(estimator), residual_bytes if residual_bytes >= 1.0 else 0.0,
                   estimator.side_multiple)

    def reason(self, size) -> str | None:
        """Why a prediction at ``size`` is not trusted (one line), or None."""
        if self.unmeasured:
            return f"never measured: {', '.join(self.unmeasured)}"
        if self.side_multiple > 1 and any(int(side) % self.side_multiple for side in size[1:]):
            return (f"an image side of {tuple(size[1:])} is not a multiple of {self.side_multiple} (the model's "
                    "patch or stride): measured")
        lengths = self.feature_set.lengths(size)
        if size[0] > REACH * self.max_batch or any(n > REACH * m for n, m in zip(lengths, self.max_lengths)):
            return f"over {REACH}x the largest size measured"
        vector = self.feature_set.of(size) / self.scale
        for basis in self.bases:
            rest = vector - basis.T @ (basis @ vector)
            # Euclidean norms, as ``np.linalg.norm`` works them out (its wrapper costs more here)
            if math.sqrt(rest.dot(rest)) > _SPAN_RTOL * math.sqrt(vector.dot(vector)):
                return "not determined by the sizes measured"
        return None


def unmeasured_parts(estimator) -> tuple:
    """The parts of the step timeline no sample measured, in words."""
    layout = estimator.layout
    measured = set(layout) | estimator.empty
    parts = [_STEP_PARTS[q] for q in STEP_QUANTITIES if (q, -1) not in measured]
    blocks = [i for i in range(estimator.num_blocks) if any((q, i) not in layout for q in _TIMELINE)]
    if blocks:
        parts.append(f"block{'s' if len(blocks) > 1 else ''} {', '.join(map(str, blocks))} "
                     "(dropped by the data filter or no room to measure)")
    if estimator.shape_changed:
        parts.append("one order of the blocks (it changed between steps)")
    return tuple(parts)
