"""Mimose's lightning memory estimator: per-block least squares on the input size.

The paper fits each layer's memory as ``a·x² + b·x + c`` of the sequence length ``x``. Here
``x`` is the input shape, so batches whose batch size changes are predicted too: with ``B`` the
batch and ``L`` the product of the other dimensions (the padded length; H·W for images),
memory is fitted on ``B·L², B·L, 1, B, L², L``. Attention is ``B·L²``, the rest of a
transformer layer ``B·L``; ``L²``/``L`` alone cover tensors shared by the batch (XLNet's
relative positions). A feature is used only when the sizes seen so far tell it apart from
the others (numerical rank), so a sheltered phase whose batch size never changed fits
``B·L², B·L, 1``: activations proportional to the batch, the prior a per-sample model carries.

Memory bytes are exact integers, quadratic in the shape, so the fit is exact wherever that
model holds; forward time is fitted on ``B·L², B·L, 1``.
"""

from dataclasses import dataclass

import numpy as np

from mimose_cli.planners.blocks import plan_levels
from mimose_cli.planners.mimose.features import (
    BLOCK_QUANTITIES,
    FEATURE_SETS,
    FEATURES,
    KEEP_LEVEL,
    KEPT_SETS,
    LEVELS,
    NO_EVENT,
    RANK_RTOL,
    RECOMPUTE_LEVEL,
    SELECTIVE_LEVEL,
    STEP_QUANTITIES,
    TIME_FEATURES,
    TOKENS,
    FeatureSet,
    Releases,
    features,
    kept_quantities,
    widened,
)
from mimose_cli.planners.mimose.trust import Trust

_MAX_SAMPLES = 60  # the most recent samples fitted (a bit per sample marks which are missing)

__all__ = ["BLOCK_QUANTITIES", "FEATURES", "NO_EVENT", "STEP_QUANTITIES", "TIME_FEATURES", "Estimator",
           "Prediction", "Timeline", "features", "least_squares", "peak_timeline", "plan_peak_bytes", "prune_ops",
           "select_features"]


def select_features(design: np.ndarray, candidates: tuple, names: tuple = FEATURES) -> list:
    """Columns of ``design`` (``names`` order) taken in order while each raises the rank."""
    chosen: list = []
    for name in candidates:
        column = names.index(name)
        trial = design[:, chosen + [column]]
        scaled = trial / np.maximum(np.abs(trial).max(axis=0), 1e-300)
        singular = np.linalg.svd(scaled, compute_uv=False)
        if len(chosen) < design.shape[0] and singular[-1] > RANK_RTOL * singular[0]:
            chosen.append(column)
    return chosen


def least_squares(design: np.ndarray, targets: np.ndarray, candidates: tuple,
                  names: tuple = FEATURES) -> np.ndarray:
    """Coefficients (``names`` x targets) of each target column on the selected features."""
    coef = np.zeros((len(names), targets.shape[1]))
    chosen = select_features(design, candidates, names)
    x = design[:, chosen]
    scale = np.abs(x).max(axis=0)
    # One pseudo-inverse of the small design serves every target column (a plain product).
    coef[chosen] = (np.linalg.pinv(x / scale) @ targets) / scale[:, None]
    return coef


def prune_ops(coef: np.ndarray, segments: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Mask of the op columns that are the largest of their segment somewhere on the grid: a
    peak is the max over its ops, and only these can be it at the sizes planned for."""
    values = grid @ coef
    starts = np.flatnonzero(np.r_[True, segments[1:] != segments[:-1]])
    best = np.maximum.reduceat(values, starts, axis=1)
    owner = np.cumsum(np.r_[False, segments[1:] != segments[:-1]])
    return (values >= best[:, owner]).any(axis=0)


@dataclass
class Prediction:
    """Predicted quantities at one input size: ``blocks[q]`` is an array over blocks for each
    name in BLOCK_QUANTITIES, ``step[q]`` a float for each name in STEP_QUANTITIES."""

    size: tuple
    blocks: dict
    step: dict
    order: tuple | None = None
    """Block indices in forward order; None: index order."""
    backward_reversed: bool = True
    """Whether backward runs the blocks in the reverse of ``order`` (else the backward events
    sit above everything the forward held: an upper bound)."""
    releases: np.ndarray | None = None
    """``Releases.consumers``: which blocks must run plainly for each block's ``release_bytes``
    to be let go of once it returns; None: nothing is."""

    @property
    def savings(self) -> np.ndarray:
        """What checkpointing each block frees until its backward (a checkpoint keeps the inputs
        a plain run would have let go of, counted against the block that lets them go)."""
        released = 0.0
        if self.releases is not None:
            released = np.where(self.releases.any(axis=1), np.maximum(self.blocks["release_bytes"], 0.0), 0.0)
        return np.maximum(self.blocks["plain_bytes"] - released - self.blocks["ckpt_bytes"], 0.0)


_TIMELINE_QUANTITIES = ("plain_bytes", "ckpt_bytes", "resident_bytes", "gap_peak_bytes", "fwd_peak_bytes",
                        "ckpt_fwd_peak_bytes", "bwd_peak_bytes", "recompute_peak_bytes",
                        *(q for kept_set in KEPT_SETS for q in kept_quantities(kept_set)))
"""The block quantities ``Timeline`` reads (and ``release_bytes`` for what is let go of)."""
_KEPT_QUANTITIES = tuple(kept_quantities(kept_set) for kept_set in KEPT_SETS)
_LET_GO_ELEMENTS = 1 << 21
"""``Timeline._let_go``'s products, at most this many float64s at once (16 MiB)."""


@dataclass(frozen=True)
class InOrderTerms:
    """A step's events where each adds up block by block (``Timeline.in_order_terms``). At position
    ``p`` of the forward (``order[p]`` the block) a level ``l`` holds ``held[l, p]`` until its
    backward and leaves ``resident[l, p]`` from the head's backward until its own (None: no block
    leaves anything); with ``H`` and ``R`` those summed over the blocks before, from a zero, its
    forward peaks at ``(H + pre) + fwd[l, p]`` and its backward at ``((H + pre) + R) + own[l, p]``
    (without ``R`` where none is left); with ``H`` and ``R`` summed over every block, the head at
    ``(H + pre) + max(head, head_bwd + R)``; ``fixed`` is the events before the blocks and after them
    (no plan moves them). The same float operations in the same order as ``Timeline._parts``."""

    order: list
    pre: float
    held: np.ndarray  # (levels, positions)
    fwd: np.ndarray
    own: np.ndarray
    resident: np.ndarray | None
    head: float
    head_bwd: float
    fixed: float


class Timeline:
    """``peak_timeline`` for one prediction: what does not depend on the plan (the blocks'
    quantities in forward order, the selective peaks, which inputs are let go of where) worked
    out once, so that a scheduler predicting many plans at one size pays for it once.

    ``events(plan_mask, selective_mask)`` is the step's memory events above the start-of-step
    bytes, for one plan (a bool mask over blocks, in block index order) or for many at once
    (masks of shape ``(plans, blocks)``: events on the last axis); ``peaks`` their maximum.

    Forward, in the blocks' forward order: each block adds its plain or checkpointed bytes; its
    forward peaks above what the blocks before it hold. Backward, block by block in reverse,
    peaks at what the blocks before it hold plus its own backward peak (the same whether it was
    checkpointed: the recompute brings its activations back; the recompute's own peak counts
    when it is checkpointed). When backward does not run in reverse forward order, every
    backward event and the tail sit above everything the forward held instead. Parameter
    gradients are in the fitted values.

    ``selective_mask`` (within ``plan_mask``) marks the blocks checkpointed selectively: they hold
    ``selective_extra_bytes`` more than checkpointed until their backward, and their forward,
    recompute and the rest of their backward peak at the ``selective_*_peak_bytes`` (the kept
    outputs held until the recompute takes them back; never below the checkpointed peaks, which
    measured training steps may have raised beyond the probes' selective ones). A partial level
    (``features.PARTIAL_LEVELS``, ``level_peaks``) likewise, from its own ``partial*_*`` quantities.

    Inputs no plain block saves are let go of once the loop moves on (``Releases``), where a
    checkpoint keeps them until its backward.
    """

    def __init__(self, pred: Prediction):
        b = pred.blocks
        # An index array, not a list: numpy converts a list anew for every quantity it indexes.
        order = pred.order  # the index order (most models) read as None: no reordering per plan
        self.order = None if order is None or tuple(order) == tuple(range(len(order))) else np.asarray(order)
        if self.order is not None:
            b = {q: b[q][self.order] for q in _TIMELINE_QUANTITIES}
        self.step, self.reversed = pred.step, pred.backward_reversed
        ckpt_fwd, bwd, recompute = b["ckpt_fwd_peak_bytes"], b["bwd_peak_bytes"], b["recompute_peak_bytes"]
        gap = b["gap_peak_bytes"]
        # Per quantity, its value for each level (``features.LEVELS``: kept, selective, partial,
        # recomputed) of each block: what a block holds until its backward, its forward's peak, its
        # backward's own peak (with the recompute's) and what a plain run leaves until the forward
        # ends; a plan picks a row per block.
        # (quantity, level, block); the selective checkpoints' rows (``KEPT_SETS``, the levels
        # between keep and recompute) worked out together: a miss builds this table anew.
        self.blocks = len(gap)
        tables = np.zeros((4, LEVELS, self.blocks))
        tables[:, KEEP_LEVEL] = (b["plain_bytes"], np.maximum(gap, b["fwd_peak_bytes"]), np.maximum(bwd, NO_EVENT),
                                 b["resident_bytes"])
        extra, fwd, again, back = np.array([[b[q] for q in names] for names in _KEPT_QUANTITIES]).transpose(1, 0, 2)
        tables[:3, SELECTIVE_LEVEL:RECOMPUTE_LEVEL] = (
            b["ckpt_bytes"] + np.maximum(extra, 0.0), np.maximum(gap, np.maximum(fwd, ckpt_fwd)),
            np.maximum(np.maximum(back, bwd), np.maximum(again, recompute)))
        tables[:3, RECOMPUTE_LEVEL] = (b["ckpt_bytes"], np.maximum(gap, ckpt_fwd), np.maximum(bwd, recompute))
        # Whether any block leaves something until the forward ends (else ``_parts`` skips its sums).
        self.resident = bool(tables[3, KEEP_LEVEL].any())
        # Flat, so that one ``take`` of ``level * blocks + block`` reads every quantity of a plan.
        self.tables = tables.reshape(4, -1)
        self.columns = np.arange(self.blocks)
        self.consumers = pred.releases
        if self.consumers is not None and not self.consumers.any():
            self.consumers = None
        if self.consumers is not None:
            release = np.maximum(pred.blocks["release_bytes"], 0.0)
            if self.order is not None:
                self.consumers, release = self.consumers[np.ix_(self.order, self.order)], release[self.order]
            self.active = self.consumers.any(axis=1)
            self.release = release
            positions = np.arange(len(self.active))
            first = np.argmax(self.consumers, axis=1)
            # span[L, k]: block k's backward no longer sees what block L let go of.
            self.span = (self.active[:, None] & (first[:, None] <= positions[None, :])
                         & (positions[None, :] <= positions[:, None])).astype(float)

    def _let_go(self, plan_mask: np.ndarray) -> tuple:
        """Per block in forward order, the input bytes let go of once it returns under each plan,
        and what that takes off each block's backward: everything let go of at or after a block,
        from the first block that took it (so it was live at that block's entry)."""
        if self.consumers is None:
            return 0.0, 0.0
        blocked = (plan_mask[..., None, :] & self.consumers).any(axis=-1)
        let_go = np.where(self.active & ~blocked, self.release, 0.0)
        # A sum over the rows, not a matrix product: the same additions in the same order for one
        # plan as for many (a product's BLAS kernel differs), so a plan's peak never depends on
        # how many plans were predicted with it. In chunks of plans: the products take blocks^2 each.
        rows = let_go.reshape(-1, self.blocks)
        chunk = max(1, _LET_GO_ELEMENTS // self.blocks ** 2)
        unseen = [(rows[k:k + chunk, :, None] * self.span).sum(axis=-2) for k in range(0, len(rows), chunk)]
        return let_go, np.concatenate(unseen).reshape(let_go.shape)

    def _parts(self, levels: np.ndarray) -> tuple:
        """The events in five parts: before the blocks (a float), each block's forward, the head
        (one per plan, shape ``(..., 1)``), each block's backward, the tail (a float, or one per
        plan where backward runs out of order)."""
        s = self.step
        levels = np.asarray(levels, dtype=np.intp)  # times the blocks below: no small integer type
        if self.order is not None:
            levels = levels[..., self.order]
        # (numpy's methods and ufuncs called directly: a miss predicts a few plans, where the
        # functions' wrappers cost as much as the arithmetic; the same operations)
        held, fwd, own, resident = self.tables.take(levels * self.blocks + self.columns, axis=1)
        if self.consumers is not None:
            let_go, unseen = self._let_go(levels > 0)
            held = held - let_go
        # What the blocks before each one hold, and the forward's end: sums from a zero.
        entry = np.zeros(levels.shape[:-1] + (self.blocks + 1,))
        np.add.accumulate(held, axis=-1, out=entry[..., 1:])
        entry += s["pre_bytes"]
        at, top = entry[..., :-1], entry[..., -1:]
        back = at - unseen if self.consumers is not None else at
        # Samples run every block checkpointed, so what a block's run leaves until the forward ends
        # (autocast's cached casts) is gone in their backward; a block run plainly may keep it (its
        # graph saves the casts) until its own backward: added back, for the blocks before (out of
        # order: all blocks) that are not in the plan. An upper bound: some ops save the fp32 weight.
        # (Nothing to add where no block leaves anything: the common case, its sums skipped.)
        kept_before, kept = 0.0, s["head_bwd_peak_bytes"]
        if self.resident:
            kept_before = np.zeros_like(entry)
            np.add.accumulate(resident, axis=-1, out=kept_before[..., 1:])
            back, kept = back + kept_before[..., :-1], kept + kept_before[..., -1:]
            kept_before = kept_before[..., -1:]
        bwd = (back if self.reversed else top + kept_before) + own
        tail = s["tail_peak_bytes"] + (0.0 if self.reversed else top)
        head = top + np.maximum(s["head_peak_bytes"], kept)
        return s["pre_peak_bytes"], at + fwd, head, bwd, tail

    def in_order_terms(self) -> "InOrderTerms | None":
        """The events as ``InOrderTerms`` where they add up block by block: no input let go of and
        backward in reverse forward order; None elsewhere."""
        if self.consumers is not None or not self.reversed:
            return None
        held, fwd, own, resident = (self.tables[q].reshape(LEVELS, self.blocks) for q in range(4))
        s = self.step
        return InOrderTerms(
            order=list(range(self.blocks)) if self.order is None else [int(i) for i in self.order],
            pre=s["pre_bytes"], held=held, fwd=fwd, own=own, resident=resident if self.resident else None,
            head=s["head_peak_bytes"], head_bwd=s["head_bwd_peak_bytes"],
            fixed=float(np.maximum(s["pre_peak_bytes"], s["tail_peak_bytes"])))  # NaN stays NaN: nothing fits

    @staticmethod
    def levels(plan_mask: np.ndarray, selective_mask: np.ndarray | None = None) -> np.ndarray:
        """The levels of plans given as masks (``features.LEVELS``): kept, checkpointed
        selectively (in both), recomputed."""
        levels = RECOMPUTE_LEVEL * plan_mask.astype(np.intp)
        if selective_mask is None:
            return levels
        return levels - (RECOMPUTE_LEVEL - SELECTIVE_LEVEL) * (plan_mask & selective_mask)

    def events(self, plan_mask: np.ndarray, selective_mask: np.ndarray | None = None) -> np.ndarray:
        """The step's events for each plan (``(..., events)``): before the blocks, each block's
        forward in forward order, the head, each block's backward, the tail."""
        one = np.ones(plan_mask.shape[:-1] + (1,))
        return np.concatenate([part * one for part in self._parts(self.levels(plan_mask, selective_mask))], axis=-1)

    def peaks(self, plan_mask: np.ndarray, selective_mask: np.ndarray | None = None) -> np.ndarray:
        """The events' maximum per plan (a float for one plan, an array over plans)."""
        return self.level_peaks(self.levels(plan_mask, selective_mask))

    def plan_peak(self, plan) -> float:
        """The peak for ``plan``, one choice per block (``blocks.plan_levels``: an offloaded block
        at the recompute level)."""
        return float(self.level_peaks(np.array(plan_levels(plan), dtype=np.intp)))

    def level_peaks(self, levels: np.ndarray) -> np.ndarray:
        """``peaks`` of plans given as levels per block (``(plans, blocks)`` or one plan's,
        ``features.LEVELS``; ``choices.choice_plan_checked``'s)."""
        pre, fwd, head, bwd, tail = self._parts(levels)
        blocks = np.maximum(fwd.max(axis=-1, initial=NO_EVENT), bwd.max(axis=-1, initial=NO_EVENT))
        peak = np.maximum(blocks, np.maximum(head, tail)[..., 0])
        return np.maximum(peak, pre)


def plan_peak_bytes(pred: Prediction, plan) -> float:
    """The peak of ``peak_timeline`` for ``plan``, one choice per block (``Timeline.plan_peak``)."""
    return Timeline(pred).plan_peak(plan)


def peak_timeline(pred: Prediction, plan_mask: np.ndarray, selective_mask: np.ndarray | None = None) -> np.ndarray:
    """The step's memory events above the start-of-step bytes, for one plan (a bool mask over
    blocks) or for many at once (masks of shape ``(plans, blocks)``: events on the last axis);
    ``Timeline`` says what they are. A caller predicting many plans at one size builds the
    ``Timeline`` once."""
    return Timeline(pred).events(plan_mask, selective_mask)


class Estimator:
    """Samples from the collector in, per-block regressions and step peaks out.

    A sample holds, for each quantity (and block), an array over the ops of that stretch of
    the step: one value for a live-bytes or time quantity, the live bytes after each op for a
    peak. Every op is fitted on its own, and a peak is predicted as the max over the ops that
    can be the largest (``prune_ops``): the max of quadratics is what the step really is, a
    single quadratic through segment peaks is not (the largest op changes with the size).
    """

    def __init__(self, num_blocks: int, feature_set: FeatureSet = TOKENS):
        self.num_blocks = num_blocks
        self.feature_set = feature_set
        self.sizes: list = []
        self.samples: list = []  # this session's (blocks, step) dicts, for inspection
        self.layout: dict = {}  # (quantity, block or -1) -> (offset, ops) in a flat row
        self._end: int | None = None  # where the last stretch laid out ends (``_width``)
        self.rows: list = []  # one flat array per sample, NaN where it has no value
        self.coef: np.ndarray | None = None  # FEATURES x kept ops, in segments
        self.starts: np.ndarray | None = None  # first column of each (quantity, block) segment
        self.source: np.ndarray | None = None  # per flat (quantity, block): its segment, or -1
        self.offset: np.ndarray | None = None  # per flat (quantity, block): added to its segment
        self._gather: np.ndarray | None = None
        self.order: tuple | None = None  # the blocks' forward order (from the first sample)
        self.backward_reversed = True
        self.shape_changed = False  # a later sample ran the blocks in another order
        self.empty: set = set()  # (quantity, block) stretches measured with no op in them
        self.side_multiple = 1
        """When probes varied an image's sides: their greatest common divisor, which every side
        of a trusted size must be a multiple of (``Trust``, rule 5); 1 otherwise."""
        self.releases = Releases.none(num_blocks)
        """Inputs blocks run plainly let go of (a plain probe step saw them freed). None unless
        seen: an input is then counted until its blocks' backward, an upper bound."""
        self.trust = Trust()

    @property
    def fitted(self) -> bool:
        return self.coef is not None

    def _keys(self) -> list:
        return ([(q, i) for q in BLOCK_QUANTITIES for i in range(self.num_blocks)]
                + [(q, -1) for q in STEP_QUANTITIES])

    def add(self, size: tuple, blocks: dict, step: dict, shape=None) -> None:
        """Record one sheltered step's measurements at input size ``size``: ``blocks[q][i]`` and
        ``step[q]`` are arrays over ops, or None for what the data filter dropped; ``shape`` the
        step's ``StepShape`` (forward order, whether backward reversed it). A stretch whose op
        count differs from the first one seen (another kernel ran) is left out."""
        if shape is not None:
            if self.order is None:
                self.order, self.backward_reversed = tuple(shape.order), shape.backward_reversed
            elif (tuple(shape.order), shape.backward_reversed) != (self.order, self.backward_reversed):
                self.shape_changed = True
        self.sizes.append(tuple(int(d) for d in size))
        self.samples.append((blocks, step))
        placed = []
        for q, i in self._keys():
            values = blocks[q][i] if i >= 0 else step[q]
            if values is None:
                continue
            if not len(values):  # a stretch measured with no op in it: no event, not unknown
                self.empty.add((q, i))
                continue
            if (q, i) not in self.layout:
                width = self._width()
                self.layout[(q, i)] = (width, len(values))
                self._end = width + len(values)
            offset, ops = self.layout[(q, i)]
            if ops == len(values):
                placed.append((offset, values))
        row = np.full(self._width(), np.nan)
        for offset, values in placed:
            row[offset: offset + len(values)] = values
        self.rows.append(row)

    def _width(self) -> int:
        """The columns of a flat row: where the last stretch laid out ends (each is laid out after the others)."""
        if self._end is None:
            self._end = max((offset + ops for offset, ops in self.layout.values()), default=0)
        return self._end

    def fit(self) -> None:
        """Fit every op of every quantity (one pseudo-inverse per pattern of missing samples),
        then keep the ops that can be a peak; raises ValueError without samples."""
        if not self.sizes:
            raise ValueError("the estimator has no samples: run the sheltered phase or load one")
        rows = self.rows[-_MAX_SAMPLES:]
        matrix = np.full((len(rows), self._width()), np.nan)
        for r, row in enumerate(rows):
            matrix[r, : len(row)] = row
        names = self.feature_set.names
        design = np.stack([self.feature_set.of(size) for size in self.sizes[-_MAX_SAMPLES:]])
        alias = self._duplicates(matrix)
        keys = sorted((k for k in self.layout if k not in alias), key=lambda k: self.layout[k][0])
        columns = np.concatenate([np.arange(*self._span(k)) for k in keys])
        matrix = matrix[:, columns]
        lengths = [self.layout[k][1] for k in keys]
        segments = np.repeat(np.arange(len(keys)), lengths)
        is_time = np.repeat([k[0] == "fwd_ms" for k in keys], lengths)
        present = ~np.isnan(matrix)
        pattern = (present.T.astype(np.int64) @ (1 << np.arange(len(rows), dtype=np.int64))) * 2 + is_time
        coef = np.zeros((len(names), matrix.shape[1]))
        residual = np.zeros(matrix.shape[1])
        spans = []
        for value in sorted(set(pattern.tolist())):  # (np.unique's first call imports numpy.ma: 20 ms)
            chosen = pattern == value
            used = [r for r in range(len(rows)) if (value >> (r + 1)) & 1]
            targets = matrix[np.ix_(used, chosen)]
            candidates = self.feature_set.time_names if value & 1 else names
            coef[:, chosen] = least_squares(design[used], targets, candidates, names)
            if not value & 1:  # bytes: what the promise rests on (times only rank plans)
                residual[chosen] = np.abs(design[used] @ coef[:, chosen] - targets).max(axis=0)
                spans.append(design[used])
        self.trust = Trust.of(self, keys, segments, residual, spans)
        keep = prune_ops(coef, segments, self.feature_set.grid(self.sizes))
        self.coef = coef[:, keep]
        kept = segments[keep]
        self.starts = np.flatnonzero(np.r_[True, kept[1:] != kept[:-1]])
        self._map_sources(keys, alias)

    def _span(self, key) -> tuple:
        offset, ops = self.layout[key]
        return offset, offset + ops

    def _duplicates(self, matrix: np.ndarray) -> dict:
        """Blocks whose samples equal the first block's op for op up to a constant (the layers
        of a homogeneous stack; the constant is the parameter gradients already allocated when
        a later block runs backward): ``{key: (first block's key, constant)}``. They share its
        fit, so the fit's cost grows with the number of distinct blocks, not of blocks."""
        alias = {}
        for q in BLOCK_QUANTITIES:
            keys = [(q, i) for i in range(self.num_blocks) if (q, i) in self.layout]
            if len(keys) < 2 or q == "fwd_ms":
                continue
            offset, ops = self.layout[keys[0]]
            if any(self.layout[k] != (offset + n * ops, ops) for n, k in enumerate(keys)):
                continue  # not laid out side by side: each is fitted on its own
            slab = matrix[:, offset: offset + len(keys) * ops].reshape(matrix.shape[0], len(keys), ops)
            missing = np.isnan(slab)
            diff = slab - slab[:, :1]
            low = np.where(missing, np.inf, diff).min(axis=(0, 2))
            high = np.where(missing, -np.inf, diff).max(axis=(0, 2))
            same = (missing == missing[:, :1]).all(axis=(0, 2)) & (low == high)
            alias.update({k: (keys[0], float(low[n])) for n, k in enumerate(keys) if n and same[n]})
        return alias

    def _map_sources(self, keys: list, alias: dict) -> None:
        """Each (quantity, block) reads its own segment (or its duplicate's); a block never
        measured reads its nearest measured block's (homogeneous stacks); what is left reads a
        default (-1: no bytes, or no event for a peak, as the gap before the first block)."""
        segment = {k: n for n, k in enumerate(keys)}
        segment.update({k: segment[rep] for k, (rep, _) in alias.items()})
        measured = {i for q, i in self.layout if q == "plain_bytes"}
        source, offset = [], []
        for q, i in self._keys():
            if (q, i) not in segment and i >= 0 and i not in measured:
                near = sorted((abs(j - i), j) for j in range(self.num_blocks) if (q, j) in segment)
                i = near[0][1] if near else i
            source.append(segment.get((q, i), -1))
            offset.append(alias.get((q, i), (None, 0.0))[1])
        self.source = np.array(source)
        self.offset = np.array(offset)
        self._gather = None

    def predict(self, size) -> Prediction:
        """Every quantity at ``size``; bytes, and ms for time (never below zero)."""
        values = np.maximum.reduceat(self.feature_set.of(size) @ self.coef, self.starts)
        flat = np.concatenate((values, (0.0, NO_EVENT)))[self.gather] + self.offset
        n = self.num_blocks * len(BLOCK_QUANTITIES)
        blocks = flat[:n].reshape(len(BLOCK_QUANTITIES), self.num_blocks)
        blocks[-1] = np.maximum(blocks[-1], 0.0)
        return Prediction(tuple(size), dict(zip(BLOCK_QUANTITIES, blocks)),
                          dict(zip(STEP_QUANTITIES, flat[n:].tolist())), self.order, self.backward_reversed,
                          self.releases.consumers if self.releases.consumers.any() else None)

    @property
    def gather(self) -> np.ndarray:
        """Where each flat (quantity, block) reads its value: its segment, or past the end for
        a default (0 bytes, or no event for a peak never measured)."""
        if self._gather is None:
            names = [q for q in BLOCK_QUANTITIES for _ in range(self.num_blocks)] + list(STEP_QUANTITIES)
            default = np.array([len(self.starts) + ("peak" in q) for q in names])
            self._gather = np.where(self.source >= 0, self.source, default)
        return self._gather

    def state_dict(self) -> dict:
        def plain(array):
            return [None if np.isnan(v) else float(v) for v in array]

        fitted = None if self.coef is None else {
            "coef": self.coef.tolist(), "starts": self.starts.tolist(), "source": self.source.tolist(),
            "offset": self.offset.tolist()}
        return {"num_blocks": self.num_blocks, "features": list(self.feature_set.names),
                "block_quantities": list(BLOCK_QUANTITIES), "step_quantities": list(STEP_QUANTITIES),
                "sizes": [list(s) for s in self.sizes],
                "order": None if self.order is None else list(self.order),
                "backward_reversed": self.backward_reversed, "shape_changed": self.shape_changed,
                "empty": [list(k) for k in sorted(self.empty)], "releases": self.releases.state_dict(),
                "side_multiple": self.side_multiple,
                "layout": [[q, i, offset, ops] for (q, i), (offset, ops) in self.layout.items()],
                "rows": [plain(row) for row in self.rows], "fitted": fitted}

    def load_state_dict(self, state: dict) -> None:
        if state["num_blocks"] != self.num_blocks:
            raise ValueError(f"the saved estimator has {state['num_blocks']} blocks, this model "
                             f"{self.num_blocks}; it was fitted for another model")
        # A state from before finer plans lacks the selective quantities, or some of today's (the
        # partial levels'): they are left out (the plans stay block-level, or without partial
        # levels: ``MimosePolicy._selective_known``, ``_partial_known``).

        def unselective(quantities):
            return [q for q in quantities if not q.startswith(KEPT_SETS)]

        widened_to = FEATURE_SETS.get(tuple(state["features"]))
        feature_set = widened_to if widened_to is not None and widened(self.feature_set) is widened_to else (
            self.feature_set)  # the probes of the run that saved it read a B x B tensor
        if (unselective(state["block_quantities"]) != unselective(BLOCK_QUANTITIES)
                or list(state["features"]) != list(feature_set.names)):
            raise ValueError("the saved estimator was written by an incompatible mimose version")
        self.feature_set = feature_set
        self.sizes = [tuple(s) for s in state["sizes"]]
        self.samples = []
        known = set(BLOCK_QUANTITIES) | set(STEP_QUANTITIES)
        self.layout = {(q, i): (offset, ops) for q, i, offset, ops in state["layout"] if q in known}
        self._end = None
        self.rows = [np.array([np.nan if v is None else v for v in row], dtype=float) for row in state["rows"]]
        order = state.get("order")
        self.order = None if order is None else tuple(order)
        self.backward_reversed = state.get("backward_reversed", True)
        self.shape_changed = state.get("shape_changed", False)
        self.empty = {tuple(k) for k in state.get("empty", [])}
        self.releases = Releases.from_state(state.get("releases"), self.num_blocks)
        self.side_multiple = int(state.get("side_multiple", 1))
        self.coef = None
        if state.get("fitted") is not None:
            self.fit()  # deterministic: the same coefficients, and the trust that goes with them
