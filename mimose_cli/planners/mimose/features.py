"""The input size's regression features and the quantities measured per block and per step:
the vocabulary the collector, the estimator and its trust rule share."""

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from mimose_cli.planners.blocks import CHOICE_LEVEL, KEEP, PARTIAL_LEVELS, RECOMPUTE, SELECTIVE

FEATURES = ("BL2", "BL", "1", "B", "L2", "L")
TIME_FEATURES = ("BL2", "BL", "1")
KEPT_SETS = ("selective", *PARTIAL_LEVELS)
"""The selective checkpoints of a block, by what they keep: every heavy output its recompute takes
back (``selective``), or the first of them (``PARTIAL_LEVELS``)."""


def kept_quantities(kept_set: str) -> tuple:
    """``(extra, forward peak, recompute peak, backward peak)``: the block quantities of one of
    ``KEPT_SETS``."""
    return tuple(f"{kept_set}_{q}_bytes" for q in ("extra", "fwd_peak", "recompute_peak", "bwd_peak"))


EXTRA_BYTES = tuple(kept_quantities(kept_set)[0] for kept_set in KEPT_SETS)
"""The bytes each selective checkpoint (``KEPT_SETS``, in level order) keeps beyond a whole one's."""

KEEP_LEVEL, SELECTIVE_LEVEL = CHOICE_LEVEL[KEEP], CHOICE_LEVEL[SELECTIVE]
PARTIAL_LEVEL = {level: CHOICE_LEVEL[level] for level in PARTIAL_LEVELS}
RECOMPUTE_LEVEL = CHOICE_LEVEL[RECOMPUTE]
LEVELS = RECOMPUTE_LEVEL + 1
"""A block's level in a plan, by what it frees (``blocks.CHOICE_LEVEL``, ``blocks.plan_levels``):
kept, checkpointed selectively, partially (each of ``PARTIAL_LEVELS``, keeping less and less),
recomputed whole (or offloaded: the same level)."""


PARTIAL_QUANTITIES = tuple(q for level in PARTIAL_LEVELS for q in kept_quantities(level))
BLOCK_QUANTITIES = ("saved_bytes", "plain_bytes", "ckpt_bytes", "selective_extra_bytes", "resident_bytes",
                    "gap_peak_bytes", "fwd_peak_bytes", "ckpt_fwd_peak_bytes", "selective_fwd_peak_bytes",
                    "bwd_peak_bytes", "selective_bwd_peak_bytes", "recompute_peak_bytes",
                    "selective_recompute_peak_bytes", *PARTIAL_QUANTITIES, "release_bytes",
                    "fwd_ms")
"""Per block, all in bytes above the live bytes at the block's entry, except ``fwd_ms``:
``saved_bytes`` what autograd saves (the paper's layer memory); ``plain_bytes`` and
``ckpt_bytes`` the live bytes the block adds until its backward, run plainly or checkpointed,
``selective_extra_bytes`` what it holds beyond ``ckpt_bytes`` checkpointed selectively (its
compute-heavy ops' outputs; known where the probes measured it, ``scaling.selective_bytes``);
``resident_bytes`` what its run leaves live beyond its outputs until the forward ends (autocast's
cached casts of its weights), which a block run plainly may keep until its backward;
``gap_peak_bytes`` the peak between the previous block and this one; ``*fwd_peak_bytes`` the
peak during its forward (run plainly, checkpointed, checkpointed selectively: ``selective_*``
quantities are the peaks of a selective checkpoint, which holds its kept outputs until its
recompute takes them back; ``partial*_*`` the same of one that keeps only the first of them,
``PARTIAL_LEVELS``); ``bwd_peak_bytes`` the peak during its backward's own ops and
``recompute_peak_bytes`` during its recompute; ``release_bytes`` the bytes of the inputs it is
called with that are let go of once it returns when it and every other block that took them run
plainly (``Releases``)."""
STEP_QUANTITIES = ("pre_bytes", "pre_peak_bytes", "head_peak_bytes", "head_bwd_peak_bytes", "tail_peak_bytes")
"""Outside the blocks: live bytes before the first block (embeddings), the peak before it,
the peak from the last block's output to the start of its backward (head, loss, head
backward) above the live bytes then, and the peak after the first block's backward."""


@dataclass
class Releases:
    """Inputs that blocks run plainly let go of, as a plain probe step saw them freed
    (``collector.InputReleases``): an input the blocks' graphs do not save (under autocast a
    block saves the casts of its hidden state, not the state; an attention bias added to the
    scores) is freed once the model's loop has moved past the last block that took it, where a
    checkpoint of any of those blocks keeps it until that block's backward.

    ``consumers[L]`` (a bool row over blocks): the blocks that took what block ``L``, the last of
    them, lets go of; all must run plainly for it to go. ``slots[L]``: which of ``L``'s inputs
    (positions among the tensor leaves of its ``(args, kwargs)``) go; their bytes at each size
    are the quantity ``release_bytes``."""

    consumers: np.ndarray
    slots: dict

    @classmethod
    def none(cls, num_blocks: int) -> "Releases":
        return cls(np.zeros((num_blocks, num_blocks), dtype=bool), {})

    @property
    def count(self) -> int:
        return int(self.consumers.any(axis=1).sum())

    def deepened(self, runs) -> "Releases":
        """These releases, seen by a plain probe step that left out layers of a stack
        (``blocks.stack_runs``: ``[(template, skipped)]``), for the step with every layer: a
        left-out layer lets go of what its template lets go of alone (its own input), and takes
        what its template takes along with later blocks (a bias shared by the stack). Raises
        ValueError where the template lets go of what it shares with blocks before it."""
        consumers, slots = self.consumers.copy(), {k: set(v) for k, v in self.slots.items()}
        for template, skipped in runs:
            skipped = list(skipped)
            for last in np.flatnonzero(consumers.any(axis=1)):
                users = set(np.flatnonzero(consumers[last]))
                if last == template:
                    if users != {template}:
                        raise ValueError(f"block {template} lets go of inputs blocks before it took too")
                    consumers[skipped, skipped] = True
                    slots.update({k: set(slots.get(template, ())) for k in skipped})
                elif template in users and last > template:
                    consumers[last, skipped] = True
        return Releases(consumers, slots)

    def state_dict(self) -> dict:
        return {"consumers": self.consumers.tolist(), "slots": {str(k): sorted(v) for k, v in self.slots.items()}}

    @classmethod
    def from_state(cls, state: dict | None, num_blocks: int) -> "Releases":
        if not state:
            return cls.none(num_blocks)
        return cls(np.array(state["consumers"], dtype=bool).reshape(num_blocks, num_blocks),
                   {int(k): set(v) for k, v in state["slots"].items()})


RANK_RTOL = 1e-9  # a singular value below this (relative) adds no rank
REACH = 64  # how far beyond the largest size measured a prediction may reach
NO_EVENT = -1e30


def features(size) -> np.ndarray:
    """Regression features of an input size ``(B, L)`` or ``(B, H, W)``, in ``FEATURES`` order."""
    batch = float(size[0])
    length = float(math.prod(size[1:]))
    return np.array((batch * length * length, batch * length, 1.0, batch, length * length, length))


def seq2seq_features(size) -> np.ndarray:
    """Features of an encoder-decoder's input size ``(B, E, D)`` (encoder and decoder lengths),
    in ``SEQ2SEQ.names`` order: each stack quadratic in its own length, cross-attention in both."""
    b, e, d = (float(v) for v in size)
    return np.array((b * e * e, b * e, b * d * d, b * d, b * e * d, 1.0, b, e * e, e, d * d, d, e * d))


@dataclass(frozen=True)
class FeatureSet:
    """What memory is regressed on for one kind of input size: the feature names (in the order
    ``of`` returns them), those forward time is fitted on, and the size's length dimensions that
    the fit's reach is checked on (``lengths(size)``)."""

    names: tuple
    time_names: tuple
    of: Callable
    lengths: Callable

    def grid(self, sizes: list) -> np.ndarray:
        """Features of a grid spanning the sizes seen and reaching ``REACH`` times beyond them."""
        batches = [s[0] for s in sizes]
        grid_b = sorted({1, min(batches), max(batches), REACH * max(batches)})
        per_dim = [np.geomspace(1.0, REACH * max(dim), 10 if len(self.lengths(sizes[0])) == 1 else 5)
                   for dim in zip(*(self.lengths(s) for s in sizes))]
        return np.stack([self.of(point) for point in itertools.product(grid_b, *per_dim)])


TOKENS = FeatureSet(FEATURES, TIME_FEATURES, features, lambda size: (math.prod(size[1:]),))
"""(B, L) for tokens, (B, H, W) for images: one length, the product of the non-batch dims."""
SEQ2SEQ = FeatureSet(("BE2", "BE", "BD2", "BD", "BED", "1", "B", "E2", "E", "D2", "D", "ED"),
                     ("BE2", "BE", "BD2", "BD", "BED", "1"), seq2seq_features, lambda size: tuple(size[1:]))
"""(B, E, D) for encoder-decoders: the encoder's and the decoder's lengths apart."""


def _contrastive_features(size) -> np.ndarray:
    batch = float(size[0])
    return np.append(features(size), batch * batch)


CONTRASTIVE = FeatureSet((*FEATURES, "B2"), TIME_FEATURES, _contrastive_features, TOKENS.lengths)
"""``TOKENS`` and the square of the batch: what a contrastive loss over the batch's pairs holds
(CLIP's B x B similarities). Taken where the probes find such a tensor (``widened``), not always:
one more feature leaves more sizes undetermined by the measured ones."""
FEATURE_SETS = {names.names: names for names in (TOKENS, SEQ2SEQ, CONTRASTIVE)}
"""Each feature set by its names (a saved estimator's)."""


def widened(feature_set: FeatureSet) -> FeatureSet | None:
    """The feature set to read the probes with where ``feature_set`` cannot (a tensor of B x B),
    or None."""
    return CONTRASTIVE if feature_set is TOKENS else None


def feature_set_of(parts) -> FeatureSet:
    """What an input size's memory and work grow with for the planner's model: the encoder's and
    the decoder's lengths of an encoder-decoder model (``parts.encoder_decoder``), the tokens of any
    other."""
    return SEQ2SEQ if parts.encoder_decoder else TOKENS
