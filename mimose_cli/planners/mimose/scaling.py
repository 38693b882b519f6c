"""Plan from the first step: Mimose's estimate from two small measured steps before training.

A sheltered step measures the step's live bytes after every op at one input size; the estimator
needs several sizes to fit how each op's bytes grow. But the live bytes are a sum over tensor
storages, and each storage's bytes are one term of the regression's features: a hidden state is
``c * B * L``, an attention matrix ``c * B * L**2``, a weight gradient ``c``. Two measured steps at
sizes chosen so that every feature grows by a different factor between them (``probe_sizes``)
therefore tell each storage's polynomial: its first tensor's shape, read dimension by dimension
(``coefficients``), or, for a view of part of a storage, the one feature that grew by its factor.
Knowing every storage's polynomial and when it lived (``memory.probe.LiveProbe`` with
``lifetimes``), the live bytes at every op are known at *any* size, and ``ScaledStep.sample``
writes them out as the samples the collector would measure, at sizes spanning the features
(``ScaledStep.sizes``), for the estimator to fit as it fits measured ones.

The two steps are small (a short length; the smallest batch that can be made, from two rows, and
twice it). What this cannot describe raises ``ScalingError`` with the reason, and Mimose learns
from measured steps instead: the op sequence differs between the two sizes (a kernel chosen by
size, data-dependent shapes such as MoE routing or ``nonzero``), or a storage's bytes are no sum
of the features (a buffer padded to a multiple, a cube of the length). A size at which a
kernel choice differs from the probes' is caught by the check every planned step makes (its
measured peak against the prediction), which then measures that size.
"""

import dataclasses
import functools
import math
from fractions import Fraction
from typing import NamedTuple

import numpy as np

from mimose_cli.planners.blocks import PARTIAL_LEVELS
from mimose_cli.planners.mimose.collector import RawStep, Trace, backward_stretch, build_sample
from mimose_cli.planners.mimose.features import KEPT_SETS, kept_quantities

_RTOL = 1e-9
_LENGTH_PAIRS = ((16, 24), (8, 12), (4, 6))
"""Shorter and longer length of the two probes, the first pair a dimension allows: a factor 1.5;
an encoder-decoder's decoder length takes a factor 1.25 (``(8, 10)``, ``(4, 5)``), so that no two
features grow alike. Where lengths allow, both are multiples of 8: CUDA's fused attention pads an
attention mask whose rows are not (``pad_bias`` in torch's SDPA), which adds ops and storages, so
probes at 8 and 12 ran different op sequences on an H200 and could not be scaled (16 and 24 run
the aligned path at both sizes)."""
_DECODER_PAIRS = ((8, 10), (4, 5))
SIDE_PAIR = (64, 96)
"""An image's two probe sides (height and width alike), when the largest image allows them and the
model takes other sides than its own: multiples of 32, the stride of a CNN's last stage (ResNet, ConvNeXt, Swin), so that every
feature map is a whole fraction of the side; factor 1.5."""
_MAX_SLOPE = 2
_EXTRA_TOKENS = 8
"""Tokens a vision transformer may add to its patches' (a class token, a distillation token, registers)."""


class ScalingError(ValueError):
    """The two probe steps cannot be scaled to other sizes; the message says why (one line)."""


def _dimension_multiple(da: int, db: int, size_a: tuple, size_b: tuple) -> int | None:
    """The multiple of an image's sides at which one dimension of a tensor, ``da`` and ``db`` at
    the probes' sizes ``(B, H, W)``, is what the probes read: 1 for a constant or the batch; ``s``
    for a side's fraction ``H / s`` (a convolution's map of stride ``s``); ``p`` for patches of
    ``p`` px, ``H * W / p**2`` and a few tokens more (a vision transformer's tokens); either with
    the batch's rows flattened into it. None when it is none of these."""
    if da == db:
        return 1
    for rows_a, rows_b in ((1, 1), (size_a[0], size_b[0])):
        if da % rows_a or db % rows_b:
            continue
        xa, xb = da // rows_a, db // rows_b
        if xa == xb:
            return 1
        if xa * size_b[1] == xb * size_a[1]:
            return Fraction(size_a[1], xa).numerator
        area_a, area_b = size_a[1] * size_a[2], size_b[1] * size_b[2]
        step, rest = divmod(area_b - area_a, xb - xa) if xb > xa else (0, 1)
        patch = math.isqrt(step)
        if not rest and patch * patch == step and not area_a % step and 0 <= xa - area_a // step <= _EXTRA_TOKENS:
            return patch
    return None


def side_multiple(shapes_a: list, shapes_b: list, size_a: tuple, size_b: tuple) -> int:
    """The multiple of an image's sides the probes' reading holds at, from the shapes of every
    storage at the two probe sizes (``RawStep.shapes``): the least common multiple of what each
    dimension imposes (``_dimension_multiple``: a convolution's stride, a patch's side), so a ViT of
    16 px patches is trusted at every multiple of 16 and a stride-32 CNN at multiples of 32. Where
    a storage that grew has no shape, or a dimension is not read, or the multiple does not divide
    both probes' sides, the probes' common divisor (``SIDE_PAIR``)."""
    fallback = math.gcd(*SIDE_PAIR)
    multiple = 1
    for a, b in zip(shapes_a, shapes_b):
        if a is None or b is None or len(a[0]) != len(b[0]):
            if a != b:
                return fallback
            continue
        for da, db in zip(a[0], b[0]):
            dim = _dimension_multiple(int(da), int(db), size_a, size_b)
            if dim is None:
                return fallback
            multiple = math.lcm(multiple, dim)
    return multiple if not fallback % multiple else fallback


def probe_batches(max_batch: int) -> list:
    """Batch sizes a pair of probes may start from, smallest first: the largest batch halved
    while it stays whole, never one (a special case of many kernels) unless training runs batches
    of one. The caller takes the first whose batches can be made (a multiple-choice batch's rows
    come in whole examples)."""
    if max_batch <= 1:
        return [1]
    return sorted({max_batch >> k for k in range(max_batch.bit_length()) if max_batch >> k >= 2} | {max_batch})


def probe_sizes(max_size: tuple, vary_lengths: bool, decoder: bool = False, batch: int | None = None,
                image: bool = False) -> list:
    """The two probe sizes for a recipe whose largest size is ``max_size``: ``batch`` (by
    default the largest) and twice it (then still a multiple of whatever a batch's rows must be a
    multiple of), or one and one when training runs batches of one (only the lengths vary); each
    length dimension at a short pair when ``vary_lengths``: tokens at 8 and 12, an ``image``'s
    height and width at ``SIDE_PAIR`` (else they stay those of ``max_size``)."""
    batch = int(max_size[0] if batch is None else batch)
    batches = (batch, 2 * batch) if batch > 1 else (1, 1)
    lengths = []
    for position, longest in enumerate(max_size[1:]):
        pairs = _DECODER_PAIRS if decoder and position == 1 else _LENGTH_PAIRS
        pair = next((p for p in pairs if p[1] <= longest), None) if vary_lengths else None
        if image and vary_lengths:
            pair = SIDE_PAIR  # a CNN's sides (the caller checks the largest image allows them)
        lengths.append(pair or (int(longest), int(longest)))
    return [(batches[k], *(pair[k] for pair in lengths)) for k in range(2)]


def _classes(fa: np.ndarray, fb: np.ndarray):
    """Each feature's factor of growth between the two sizes, and for each feature the first
    feature that grows by the same factor (its representative)."""
    ratio = np.where(fa > 0, fb / np.where(fa > 0, fa, 1.0), np.nan)
    rep = np.arange(len(fa))
    for j in range(len(fa)):
        same = [k for k in range(j) if np.isfinite(ratio[k]) and abs(ratio[k] - ratio[j]) <= _RTOL * ratio[j]]
        rep[j] = same[0] if same else j
    return ratio, rep


def term_of(a: np.ndarray, b: np.ndarray, fa: np.ndarray, fb: np.ndarray) -> np.ndarray:
    """For bytes ``a`` at the first size and ``b`` at the second (arrays), the feature whose
    growth each follows (its representative, see ``_classes``), or -1 where none does. Zero bytes
    at both sizes are the constant feature's."""
    ratio, rep = _classes(fa, fb)
    candidates = [j for j in range(len(fa)) if rep[j] == j and np.isfinite(ratio[j])]
    term = np.full(len(a), -1)
    for j in candidates:
        hit = (term < 0) & (a > 0) & (np.abs(b - a * ratio[j]) <= _RTOL * np.maximum(b, 1.0) + 0.5)
        term[hit] = j
    constant = next(j for j in candidates if abs(ratio[j] - 1.0) <= _RTOL)
    term[(a == 0) & (b == 0)] = constant
    return term


def exponents(feature_set) -> tuple:
    """The variables of a feature set's names (``B``, ``L``; ``B``, ``E``, ``D``) and each
    feature's exponents over them: ``BL2`` is B * L**2."""
    variables, parsed = [], []
    for name in feature_set.names:
        powers, k = {}, 0
        while k < len(name):
            letter, k = name[k], k + 1
            power = 1
            if k < len(name) and name[k].isdigit():
                power, k = int(name[k]), k + 1
            if letter != "1":
                powers[letter] = powers.get(letter, 0) + power
                if letter not in variables:
                    variables.append(letter)
        parsed.append(powers)
    return tuple(variables), [tuple(p.get(v, 0) for v in variables) for p in parsed]


def _patches(da: int, db: int, pixels_a: int, pixels_b: int) -> tuple | None:
    """``(p**2, c)`` where a dimension ``da``, ``db`` at ``pixels_a``, ``pixels_b`` (H * W) is
    ``H * W / p**2 + c``: patches of ``p`` px and 1 to ``_EXTRA_TOKENS`` tokens more; else None."""
    step, rest = divmod(pixels_b - pixels_a, db - da) if db > da else (0, 1)
    extra = da - pixels_a // step if step else -1
    if not rest and step > 1 and math.isqrt(step) ** 2 == step and not pixels_a % step and 1 <= extra <= _EXTRA_TOKENS:
        return step, extra
    return None


@functools.lru_cache(maxsize=4096)
def _dimension(da: int, db: int, va: tuple, vb: tuple, monomials: tuple = (), image: bool = False):
    """One dimension of a tensor at the two sizes as a polynomial in one variable, ``{exponents:
    coefficient}``: a constant; ``k * x`` (it grew by the factor the variable ``x`` did); else,
    for a length (not the batch, variable 0), ``k * x + c`` with ``k`` 1 or 2 (a padded, shifted
    or relative-position length: ``L + 1``, ``2 * L - 1``; a steeper slope would also fit sums of
    two lengths, ``E + D``, and is refused), or the batch's rows of one flattened into it,
    ``B * (k * x + c)`` (``B * (L - 1)``: a causal LM's shifted tokens); for an ``image``'s pixels
    ``x = H * W``, also its patches of ``p`` px and a few tokens more, ``x / p**2 + c`` (a vision
    transformer's tokens with its class token). None when it is none of these, or when two readings of the same kind fit."""
    width = len(va)
    if da == db:
        return {(0,) * width: float(da)}
    proportional, affine = [], []
    for powers in monomials:  # a flattened dimension: B * L rows
        if sum(powers) < 2:
            continue
        ma, mb = (math.prod(v ** e for v, e in zip(vals, powers)) for vals in (va, vb))
        if ma != mb and db * ma == da * mb and da % ma == 0:
            proportional.append({tuple(powers): float(da // ma)})
    for x in range(width):
        if va[x] == vb[x]:
            continue
        unit = tuple(int(i == x) for i in range(width))
        if db * va[x] == da * vb[x] and da % va[x] == 0:
            proportional.append({unit: float(da // va[x])})
        slope, rest = divmod(db - da, vb[x] - va[x])
        if x > 0 and not rest and 1 <= slope <= _MAX_SLOPE:
            affine.append({unit: float(slope), (0,) * width: float(da - slope * va[x])})
        patches = _patches(da, db, va[x], vb[x]) if image and x > 0 else None
        if patches is not None:
            affine.append({unit: 1.0 / patches[0], (0,) * width: float(patches[1])})
        # Flattened rows of a shifted length, B * (L - 1) (a causal LM's shifted tokens, in one row).
        if x > 0 and va[0] != vb[0] and not da % va[0] and not db % vb[0]:
            per_a, per_b = da // va[0], db // vb[0]
            slope, rest = divmod(per_b - per_a, vb[x] - va[x])
            if not rest and 1 <= slope <= _MAX_SLOPE and per_a != slope * va[x]:
                batch = tuple(int(i == 0) for i in range(width))
                affine.append({tuple(int(i in (0, x)) for i in range(width)): float(slope),
                               batch: float(per_a - slope * va[x])})
            patches = _patches(per_a, per_b, va[x], vb[x]) if image else None
            if patches is not None:
                batch = tuple(int(i == 0) for i in range(width))
                affine.append({tuple(int(i in (0, x)) for i in range(width)): 1.0 / patches[0],
                               batch: float(patches[1])})
    found = proportional or affine
    return found[0] if len(found) == 1 else None


@functools.lru_cache(maxsize=4096)
def _polynomial(shape_a, shape_b, itemsize: int, va: tuple, vb: tuple, monomials: tuple = (), image: bool = False):
    """A tensor's bytes as a polynomial ``{exponents: coefficient}`` in the size's variables,
    from its shape at the two sizes (a dimension may be a flattened product: ``monomials``; an
    ``image``'s, its patches: ``_dimension``), or None."""
    if len(shape_a) != len(shape_b):
        return None
    poly = {(0,) * len(va): float(itemsize)}
    for da, db in zip(shape_a, shape_b):
        dim = _dimension(int(da), int(db), va, vb, monomials, image)
        if dim is None:
            return None
        product = {}
        for ea, ca in poly.items():
            for eb, cb in dim.items():
                key = tuple(x + y for x, y in zip(ea, eb))
                product[key] = product.get(key, 0.0) + ca * cb
        poly = product
    return poly


class _Reading:
    """What reading a shape at the two probe sizes as a polynomial of the size needs: each
    size's variables (the batch, the lengths), the features' exponents and each one's column."""

    def __init__(self, size_a: tuple, size_b: tuple, feature_set):
        _, powers = exponents(feature_set)
        self.columns = {p: j for j, p in enumerate(powers)}
        self.monomials = tuple(tuple(p) for p in powers)
        self.va = tuple(int(v) for v in (size_a[0], *feature_set.lengths(size_a)))
        self.vb = tuple(int(v) for v in (size_b[0], *feature_set.lengths(size_b)))
        self.image = len(size_a) - 1 > len(feature_set.lengths(size_a))  # (B, H, W): one length, H * W

    def row(self, shape_a, shape_b, factor) -> np.ndarray | None:
        """``factor`` times the product of a shape's dims, as coefficients over the features
        (``_polynomial``); None where the dims are not read or need a feature not in the set."""
        poly = _polynomial(tuple(shape_a), tuple(shape_b), factor, self.va, self.vb, self.monomials, self.image)
        if poly is None or not all(e in self.columns for e in poly):
            return None
        row = np.zeros(len(self.monomials))
        for e, c in poly.items():
            row[self.columns[e]] += c
        return row


def coefficients(a: RawStep, b: RawStep, size_a: tuple, size_b: tuple, feature_set) -> np.ndarray:
    """Each storage's bytes as coefficients over the features (storages x features), exact at
    both sizes: the product of its dimensions (``_polynomial``) when its first tensor's shape
    accounts for its bytes at both sizes (a fresh tensor) and is read, else (a storage whose tensor
    is a view of part of it, a dimension no reading explains) the one feature that grew by the
    same factor. Raises ``ScalingError`` for
    a storage neither describes. The shape goes first because a factor alone can mislead: a
    (B, L + 24) tensor grows by 2.25 between the probes, which is also L²'s factor."""
    fa, fb = feature_set.of(size_a), feature_set.of(size_b)
    coef = np.zeros((len(a.nbytes), len(fa)))
    term = term_of(a.nbytes, b.nbytes, fa, fb)
    reading = _Reading(size_a, size_b, feature_set)
    for k in range(len(a.nbytes)):
        fresh = False
        if a.shapes[k] is not None and b.shapes[k] is not None:
            (shape_a, item), (shape_b, _) = a.shapes[k], b.shapes[k]
            fresh = item * math.prod(shape_a) == a.nbytes[k] and item * math.prod(shape_b) == b.nbytes[k]
        row = reading.row(shape_a, shape_b, item) if fresh else None
        if row is not None and abs(row @ fa - a.nbytes[k]) <= 0.5 and abs(row @ fb - b.nbytes[k]) <= 0.5:
            coef[k] = row
            continue
        if term[k] >= 0:  # a view's storage, or a shape no reading explains: its growth factor
            coef[k, term[k]] = a.nbytes[k] / fa[term[k]]
            continue
        raise ScalingError(f"a tensor's bytes grow with the input size as no sum of the features "
                           f"{', '.join(feature_set.names)} does ({int(a.nbytes[k])} bytes at {tuple(size_a)}, "
                           f"{int(b.nbytes[k])} at {tuple(size_b)})")
    return coef


def work_coefficients(works_a: list, works_b: list, size_a: tuple, size_b: tuple, feature_set,
                      light_weights: dict | None = None):
    """A block's work at any input size from its ops' work at the two probe sizes
    (``RawStep.op_works``): ``(heavy, light)``, coefficients over the features of the work in its
    compute-heavy ops and in the others, each of the others' weighted by ``light_weights`` of its
    kind (``blocks.light_op_class``; 1 where not given). Each op's dims are read as a polynomial
    in the size's variables (``_polynomial``, as a tensor's bytes are), else its work is taken to
    follow the feature that grew by the same factor. None when the ops differ between the two
    sizes or an op's work follows no feature."""
    if len(works_a) != len(works_b) or any(x[0] != y[0] for x, y in zip(works_a, works_b)):
        return None
    fa, fb = feature_set.of(size_a), feature_set.of(size_b)
    reading = _Reading(size_a, size_b, feature_set)
    coef = np.zeros((2, len(fa)))
    weights = light_weights or {}
    for (heavy, dims_a, factor, kind), (_, dims_b, _, _) in zip(works_a, works_b):
        row = reading.row(dims_a, dims_b, factor)
        if row is None:  # the growth factor of its whole work
            work_a, work_b = factor * math.prod(dims_a), factor * math.prod(dims_b)
            term = term_of(np.array([work_a], dtype=float), np.array([work_b], dtype=float), fa, fb)[0]
            if term < 0:
                return None
            row = np.zeros(len(fa))
            row[term] = work_a / fa[term]
        if heavy:
            coef[0] += row
        else:
            coef[1] += row * weights.get(kind, 1.0)
    return coef[0], coef[1]


def structure_difference(a: RawStep, b: RawStep) -> str | None:
    """Why the two probes did not run the same ops on the same storages, or None."""
    if a.points != b.points or len(a.nbytes) != len(b.nbytes):
        return (f"the op sequence changed with the input size ({len(a.trace.live)} and {len(b.trace.live)} ops, "
                f"{len(a.nbytes)} and {len(b.nbytes)} storages)")
    if [m[0] for m in a.marks] != [m[0] for m in b.marks] or not np.array_equal(a.mark_points, b.mark_points):
        return "the blocks ran in another order at the other input size"
    settled_ = ~_comm(a) & ~_comm(b)  # a collective's buffers die where its worker lets go (``settled``)
    if not (np.array_equal(a.born, b.born) and np.array_equal(a.died[settled_], b.died[settled_])):
        return "tensors lived at other ops at the other input size"
    if not (np.array_equal(a.trace.recompute, b.trace.recompute)
            and np.array_equal(a.trace.autocast, b.trace.autocast)):
        return "the op sequence changed with the input size (recomputes or autocast)"
    if a.dropped != b.dropped:
        return "the data filter dropped other blocks at the other input size"
    if a.twins != b.twins:
        return "other blocks ran without a measuring run at the other input size"
    return None


def _comm(raw: RawStep) -> np.ndarray:
    """Which of ``raw``'s storages were a collective's buffers (none when not recorded)."""
    return raw.comm if raw.comm is not None else np.zeros(len(raw.nbytes), dtype=bool)


def settled(raws: list) -> list:
    """``raws`` (steps alike: the same storages) with each collective's buffer (``RawStep.comm``:
    FSDP's all-gather and reduce-scatter buffers) dying at the latest point it died at in any of
    them, and the live bytes at every point raised to match. Such a buffer is held by the process
    group's worker thread until it lets go, a few ops after the step's last reference or not, from
    run to run; its bytes do not depend on the input size, and the latest death bounds the step's
    live bytes from above."""
    if any(r.comm is None or len(r.nbytes) != len(raws[0].nbytes) or r.points != raws[0].points for r in raws):
        return raws  # not alike (``structure_difference`` says how)
    # A storage that outlived the step's ops in one of them and not in another was let go of by
    # something that ran on its own time (the root's reduce-scatter buffer, held by its work):
    # as a collective's buffer, it dies at the latest.
    ends = np.array([r.died >= r.points for r in raws])
    comm = np.any([r.comm for r in raws], axis=0) | (ends.any(axis=0) & ~ends.all(axis=0))
    if not comm.any():
        return raws
    latest = np.max([r.died for r in raws], axis=0)
    return [_died_at(dataclasses.replace(r, comm=comm), np.where(comm, latest, r.died)) for r in raws]


def _died_at(raw: RawStep, died: np.ndarray) -> RawStep:
    """``raw`` with its storages dying at ``died`` (never earlier than they did), its trace and
    marks' live bytes raised by what lives longer."""
    extra = np.zeros(raw.points + 1)
    longer = died > raw.died
    np.add.at(extra, raw.died[longer], raw.nbytes[longer])
    np.add.at(extra, died[longer], -raw.nbytes[longer])
    extra = np.cumsum(extra)[: raw.points]
    trace = Trace(raw.trace.live + extra[raw.op_points], raw.trace.recompute, raw.trace.autocast)
    marks = [(label, index, live + float(extra[p])) for (label, index, live), p in zip(raw.marks, raw.mark_points)]
    return dataclasses.replace(raw, marks=marks, trace=trace, died=died)


def _recomputed(raw: RawStep, at: dict, i: int):
    """Block ``i``'s recompute in backward: live bytes above its backward's start, or None."""
    if ("bwd", i) not in at:
        return None
    start, stop = backward_stretch(raw.marks, at, i)
    return raw.trace.ops(start, stop, at[("bwd", i)][1], recompute=True)


class Mismatch(NamedTuple):
    """A block that did not run as the block it was taken for (``twin_difference``,
    ``run_difference``): which, which it was taken for, and why, in words."""

    block: int
    twin: int
    why: str


def twin_difference(raw: RawStep) -> Mismatch | None:
    """Why a block run without a measuring run (``RawStep.twins``) is not like its twin, or None.
    Its forward must run as its twin's: the recompute of it in backward the same ops at the same
    bytes above the backward's start (what it saves, and what a tensor allocated before then
    holds), and its checkpointed run the same bytes above its entry (what it allocates after the
    last tensor it saves, where torch's recompute stops early). Under autocast no block is run so
    (``ShuttlingCollector.run``): a twin's checkpointed run would cast its weights, its twin's not.
    What it holds checkpointed and its backward's other ops are measured, not taken from the twin
    (they differ at the ends of a stack)."""
    at = {label: (index, live) for label, index, live in raw.marks}

    def checkpointed(i):
        start = at[("dropped", i)][0] if ("dropped", i) in at else at[("enter", i)][0]
        return raw.trace.ops(start, at[("ckpt", i)][0], at[("enter", i)][1])

    for i, twin in sorted(raw.twins.items()):
        mine, theirs = _recomputed(raw, at, i), _recomputed(raw, at, twin)
        if mine is None or theirs is None or not np.array_equal(mine, theirs):
            return Mismatch(i, twin, f"block {i}'s forward, recomputed, runs other ops than block {twin}'s, "
                                     "which has the same parameters")
        mine, theirs = checkpointed(i), checkpointed(twin)
        if (mine is None) != (theirs is None) or (mine is not None and not np.array_equal(mine, theirs)):
            return Mismatch(i, twin, f"block {i}'s forward holds other bytes than block {twin}'s, which has the same parameters")
    return None


def run_difference(raw: RawStep, runs, twins: dict) -> Mismatch | None:
    """Why a probe that left layers out (``runs``) cannot stand for them, or None: the template
    and the layer after the left-out ones must recompute as the group's measured layer does (what
    ``twin_difference`` checks of blocks run as twins, here also under autocast, where none is)."""
    at = {label: (index, live) for label, index, live in raw.marks}
    for template, skipped in runs:
        leader = twins[template]
        theirs = _recomputed(raw, at, leader)
        for i in (template, skipped[-1] + 1):
            mine = _recomputed(raw, at, i)
            if mine is None or theirs is None or not np.array_equal(mine, theirs):
                return Mismatch(i, leader, f"block {i}'s forward, recomputed, runs other ops than block {leader}'s, "
                                           "which has the same parameters")
    return None


def deeper_by_one(runs) -> list:
    """``runs`` with the first left-out layer of each run kept (it stands for the rest)."""
    return [(skipped[0], tuple(skipped[1:])) for _, skipped in runs if len(skipped) > 1]


def raw_sample(raw: RawStep, num_blocks: int, runs=(), partial_keep: dict | None = None):
    """The sample of one probe step at its own size, written out for every block when it left
    layers out (``Deepening``): ``(blocks, step, shape)``; the partial levels keep what
    ``partial_keep`` says (``PlanRunner.partial_keep``; the probe's own ``partial_prefixes`` where
    not given)."""
    per_block = {**raw.per_block, **selective_bytes(raw, raw.nbytes, None, partial_keep)}
    if not runs:
        return build_sample(raw.marks, raw.trace, num_blocks, per_block, raw.dropped, raw.twins)
    deepening = Deepening(raw, num_blocks, runs)
    live = np.empty(raw.points)
    live[raw.op_points] = raw.trace.live
    live[raw.mark_points] = [value for _, _, value in raw.marks]
    live = live + deepening.extra_terms(raw.nbytes[:, None], raw.points)[0]
    trace = Trace(live[raw.op_points], raw.trace.recompute, raw.trace.autocast)
    marks = [(label, index, float(live[p])) for (label, index, _), p in zip(raw.marks, raw.mark_points)]
    return deepening.sample(marks, trace, per_block, raw.nbytes)


SELECTIVE_QUANTITIES = kept_quantities("selective")
"""What the probes measure of a block checkpointed selectively (``selective_bytes``)."""


def _kept_and_taken(raw: RawStep) -> list:
    """Per block, where a selective checkpoint of it keeps compute-heavy outputs and where its
    recompute takes them back, from the probe's checkpointed run and its recompute: ``(start,
    stop, backward, end, kept, taken)`` (its forward's and its backward's points, the heavy
    storages its forward made that the recompute makes again — in forward order, the ones kept
    (``blocks._selective_contexts``) — and the points where it makes them), or None where unknown.

    Torch's selective checkpointing keeps a heavy op's outputs (aliases of the same storages) from
    the forward until its recompute comes to that op and takes them instead of running it. The
    recompute remakes the heavy outputs in forward order, so the k-th kept output is taken back
    where the probe's recompute made its k-th heavy output (of the same shape; otherwise nothing
    is derived). It stops once the last saved tensor is packed again (non-reentrant checkpointing's
    early stop), before a block's last matmul: that output and any after it are not kept."""
    if raw.heavy is None:
        return [None] * len(raw.per_block["saved_bytes"])
    point = {label: p for (label, _, _), p in zip(raw.marks, raw.mark_points)}
    recomputed_at = np.zeros(raw.points + 1, dtype=bool)
    recomputed_at[raw.op_points[raw.trace.recompute]] = True
    remade = raw.heavy & recomputed_at[np.minimum(raw.born, raw.points)]
    out = []
    for i in range(len(raw.per_block["saved_bytes"])):
        start, stop = point.get(("dropped", i), point.get(("enter", i))), point.get(("ckpt", i))
        backward = point.get(("bwd", i))
        if start is None or stop is None or backward is None:
            out.append(None)
            continue
        end = _stretch_stop(raw, point, i)
        made = np.flatnonzero(raw.heavy & (raw.born >= start) & (raw.born < stop))
        again = np.flatnonzero(remade & (raw.born >= backward) & (raw.born < end))
        if len(again) > len(made) or any(raw.shapes[k] != raw.shapes[m] for k, m in zip(again, made)):
            out.append(None)  # the recompute made other heavy outputs than the forward: not paired
            continue
        out.append((start, stop, backward, end, made[:len(again)], raw.born[again]))
    return out


def selective_keeps(raw: RawStep, num_blocks: int, stand_in: dict) -> list:
    """Per block, how many compute-heavy outputs a selective checkpoint keeps (``PlanRunner.
    selective_keep``): those its recompute takes back (``_kept_and_taken``); a block the probe did
    not run takes the block standing in for it. None where unknown."""
    own = [None if pairing is None else len(pairing[4]) for pairing in _kept_and_taken(raw)]
    return _stood_in(own, num_blocks, stand_in)


def _stood_in(own: list, num_blocks: int, stand_in: dict) -> list:
    return [own[stand_in[i]] if own[i] is None and i in stand_in else own[i] for i in range(num_blocks)]


class Prefixes(NamedTuple):
    """A block's partial selective levels (``features.PARTIAL_LEVELS``): for each, the heavy
    outputs it keeps (the first ``kept[k]``, made by its first ``ops[k]`` heavy ops), None where the
    block has no such level; the heavy ops its recompute takes back (``taken_ops``) and those its
    forward runs (``forward_ops``)."""

    kept: tuple
    ops: tuple
    taken_ops: int
    forward_ops: int


PARTIAL_FRACTIONS = (0.75, 0.5, 0.25)
"""Where the partial levels keep a block's heavy outputs: the op boundary nearest to these
fractions of the bytes a selective checkpoint of it holds beyond a whole one, at the probe's size."""


def partial_prefixes(raw: RawStep, num_blocks: int, stand_in: dict, pairings: list | None = None) -> list:
    """Per block, its ``Prefixes`` (a block not run takes its stand-in's), or None where unknown.

    A partial level keeps the heavy outputs of the block's first heavy ops only (whole ops: torch's
    selective checkpointing decides per op) and its recompute runs the heavy ops after them again:
    less memory than ``selective`` for more time. Where a level frees nothing beyond
    ``selective`` or falls on another level's boundary, the block has no such level."""
    own = []
    for pairing in _kept_and_taken(raw) if pairings is None else pairings:
        if pairing is None:
            own.append(None)
            continue
        start, stop, _, _, made, taken_at = pairing
        born = raw.born[made]
        op_of = np.concatenate(([0], np.cumsum(born[1:] != born[:-1]))) if len(made) else np.zeros(0, int)
        extra = np.cumsum(np.where(raw.died[made] < taken_at, raw.nbytes[made], 0.0))
        total = float(extra[-1]) if len(extra) else 0.0
        # Op boundaries inside the kept outputs: keep the first ``c`` of them.
        bounds = [c for c in range(1, len(made)) if op_of[c] != op_of[c - 1] and 0 < extra[c - 1] < total]
        chosen = []
        for fraction in PARTIAL_FRACTIONS:
            if bounds:
                c = min(bounds, key=lambda c: (abs(extra[c - 1] - fraction * total), c))
                if c not in chosen:
                    chosen.append(c)
        chosen.sort(reverse=True)
        chosen += [None] * (len(PARTIAL_LEVELS) - len(chosen))
        forward = raw.born[np.flatnonzero(raw.heavy & (raw.born >= start) & (raw.born < stop))]
        own.append(Prefixes(tuple(chosen), tuple(None if c is None else int(op_of[c - 1]) + 1 for c in chosen),
                            int(op_of[-1]) + 1 if len(made) else 0, len(np.unique(forward))))
    return _stood_in(own, num_blocks, stand_in)


def partial_keeps(prefixes: list) -> dict:
    """``PlanRunner.partial_keep`` from ``partial_prefixes``: ``{block: {level: heavy outputs kept}}``."""
    return {i: {level: kept for level, kept in zip(PARTIAL_LEVELS, prefix.kept) if kept is not None}
            for i, prefix in enumerate(prefixes) if prefix is not None}


def selective_bytes(raw: RawStep, storage_bytes: np.ndarray, pairings: list | None = None,
                    partial_keep: dict | None = None) -> dict:
    """What a block checkpointed selectively holds beyond one checkpointed whole, at the size whose
    storages have ``storage_bytes``: its kept outputs (``_kept_and_taken``, or ``pairings`` when
    already taken from ``raw``: they do not depend on the size) wherever the probe had
    let them go and the checkpoint still holds them. Per block (NaN or None where unknown), for
    ``selective`` and each partial level (``partial_keep``, ``partial_keeps``: the first of them
    kept; from ``raw``'s own ``partial_prefixes`` when not given), ``<kept set>_``:

    - ``extra_bytes``: those the probe let go of before the recompute takes them back,
      held from the block's forward to its backward (one still alive in the probe, the block's
      output, is counted twice until it dies there: an upper bound);
    - ``fwd_kept``: after each op of the checkpointed run, those it had freed;
    - ``recompute_pending`` / ``bwd_pending``: after each recompute op and
      each other op of the block's backward, those the probe no longer holds and the recompute
      has not taken back yet.

    ``collector.build_sample`` adds the last three to ``ckpt_fwd_peak_bytes``,
    ``recompute_peak_bytes`` and ``bwd_peak_bytes`` (the ``<kept set>_*_peak_bytes``)."""
    n = len(raw.per_block["saved_bytes"])
    result = {}
    for kept_set in KEPT_SETS:
        result[f"{kept_set}_extra_bytes"] = np.full(n, np.nan)
        for name in ("fwd_kept", "recompute_pending", "bwd_pending"):
            result[f"{kept_set}_{name}"] = np.full(n, None, dtype=object)
    if raw.heavy is None or len(raw.heavy) != len(storage_bytes):
        return result
    pairings = _kept_and_taken(raw) if pairings is None else pairings
    if partial_keep is None:
        partial_keep = partial_keeps(partial_prefixes(raw, n, {}, pairings))
    for i, pairing in enumerate(pairings):
        if pairing is None:
            continue
        start, stop, backward, end, made, taken_at = pairing
        counts = [len(made)] + [partial_keep.get(i, {}).get(level) for level in PARTIAL_LEVELS]
        for kept_set, count in zip(KEPT_SETS, counts):
            if count is None or count > len(made):  # fewer taken back at this size: not known here
                continue
            outlived = raw.died[made[:count]] < taken_at[:count]
            kept, died, released = made[:count][outlived], raw.died[made[:count]][outlived], taken_at[:count][outlived]
            result[f"{kept_set}_extra_bytes"][i] = float(storage_bytes[kept].sum())

            def held_at(points, kept=kept, died=died, released=released):
                return ((died <= points[:, None]) & (released > points[:, None])).astype(float) @ storage_bytes[kept]

            result[f"{kept_set}_fwd_kept"][i] = held_at(raw.op_points[(raw.op_points > start) & (raw.op_points < stop)])
            stretch = (raw.op_points > backward) & (raw.op_points < end)
            result[f"{kept_set}_recompute_pending"][i] = held_at(raw.op_points[stretch & raw.trace.recompute])
            result[f"{kept_set}_bwd_pending"][i] = held_at(raw.op_points[stretch & ~raw.trace.recompute])
    return result


def sample_difference(a, b) -> str | None:
    """Where two samples ``(blocks, step, shape)`` of one size differ beyond float rounding (a
    byte), or None; times are not compared."""
    pairs = [(f"block {i}'s {q}", x, y) for q in a[0] if q != "fwd_ms"
             for i, (x, y) in enumerate(zip(a[0][q], b[0][q]))]
    pairs += [(q, a[1][q], b[1][q]) for q in a[1]]
    for where, x, y in pairs:
        if (x is None) != (y is None) or (x is not None and (len(x) != len(y) or not np.allclose(x, y, rtol=1e-9, atol=1.0, equal_nan=True))):
            return where
    return None


class ScaledStep:
    """One probe step scaled to any size: the live bytes at each point of the step as a linear
    function of the size's features (``live(features)``), and the per-block quantities measured
    directly (saved bytes, resident bytes, released bytes) likewise."""

    def __init__(self, a: RawStep, size_a: tuple, b: RawStep, size_b: tuple, feature_set, num_blocks: int,
                 runs=(), partial_keep: dict | None = None):
        reason = structure_difference(a, b)
        if reason is not None:
            raise ScalingError(reason)
        self.feature_set = feature_set
        self.raw = a
        self.num_blocks = num_blocks
        self.deepening = Deepening(a, num_blocks, runs) if runs else None
        self.pairings = _kept_and_taken(a)  # what selective checkpoints keep: the same at every size
        # what the partial levels keep (``partial_keeps``; the probe's own where not given)
        self.partial_keep = partial_keeps(partial_prefixes(a, num_blocks, {}, self.pairings)) \
            if partial_keep is None else partial_keep
        self.size_a, self.size_b = tuple(size_a), tuple(size_b)
        self.shapes = (a.shapes, b.shapes)  # what ``side_multiple`` reads
        self.image = len(size_a) - 1 > len(feature_set.lengths(size_a))  # (B, H, W): one length, H * W
        fa, fb = feature_set.of(size_a), feature_set.of(size_b)
        self.fa = fa
        coef = coefficients(a, b, size_a, size_b, feature_set)
        self.coef = coef
        # Each feature's bytes per unit, summed over the storages alive at each point.
        diff = np.zeros((a.points + 1, len(fa)))
        np.add.at(diff, a.born, coef)
        np.add.at(diff, a.died, -coef)
        self.terms = np.cumsum(diff, axis=0)[: a.points].T
        rebuilt = fa @ self.terms
        recorded = np.empty(a.points)
        recorded[a.op_points] = a.trace.live
        recorded[a.mark_points] = [live for _, _, live in a.marks]
        if a.points and np.abs(rebuilt - recorded).max() > 0.5:
            raise ScalingError("the probe's storages do not add up to its live bytes (a storage counted twice?)")
        if self.deepening is not None:
            self.terms = self.terms + self.deepening.extra_terms(coef, a.points)
        self.per_block = {}
        for quantity in ("saved_bytes", "resident_bytes", "release_bytes"):
            va, vb = a.per_block[quantity], b.per_block[quantity]
            known = ~(np.isnan(va) | np.isnan(vb))
            scalar_term = np.full(len(va), -1)
            scalar_term[known] = term_of(va[known], vb[known], fa, fb)
            self.per_block[quantity] = (np.where(known, va, np.nan), scalar_term)
        unknown = self.per_block["resident_bytes"][1] < 0
        if (unknown & ~np.isnan(a.per_block["resident_bytes"])).any():
            raise ScalingError("what a block leaves live until the forward ends grows as no feature does")

    def varied(self) -> tuple:
        """Which dimensions of the input size differ between the probes (the others must stay at
        the probes' value in every size this describes)."""
        return tuple(x != y for x, y in zip(self.size_a, self.size_b))

    def sample(self, size: tuple):
        """The sample the collector would have measured at ``size``: ``(blocks, step, shape)``."""
        f = self.feature_set.of(size)
        live = f @ self.terms
        a = self.raw
        scale = f / np.where(self.fa > 0, self.fa, 1.0)
        trace = Trace(live[a.op_points], a.trace.recompute, a.trace.autocast)
        marks = [(label, index, float(live[p])) for (label, index, _), p in zip(a.marks, a.mark_points)]
        per_block = {"fwd_ms": np.full(len(a.per_block["fwd_ms"]), np.nan)}
        for quantity, (values, term) in self.per_block.items():
            per_block[quantity] = np.where(term >= 0, values * scale[np.maximum(term, 0)], np.nan)
        storage_bytes = self.coef @ f
        per_block.update(selective_bytes(a, storage_bytes, self.pairings, self.partial_keep))
        if self.deepening is not None:
            blocks, step, shape = self.deepening.sample(marks, trace, per_block, storage_bytes)
        else:
            blocks, step, shape = build_sample(marks, trace, self.num_blocks, per_block, a.dropped, a.twins)
        for quantity in ("fwd_ms", "saved_bytes", "release_bytes"):  # not measured at this size: no value
            blocks[quantity] = [None if v is None or np.isnan(v).any() else v for v in blocks[quantity]]
        return blocks, step, shape

    def _batch_power(self) -> int:
        """The highest power of the batch size among the features."""
        variables, powers = exponents(self.feature_set)
        return max((p[variables.index("B")] for p in powers), default=0) if "B" in variables else 0

    def sizes(self, max_size: tuple) -> list:
        """Sizes to write samples at: in each dimension the probes varied, both probes' values and
        the largest (``max_size``), enough for the estimator's features to be determined at every
        size that keeps the other dimensions; the others at the probes' value."""
        axes = []
        for d, varies in enumerate(self.varied()):
            values = {self.size_a[d], self.size_b[d], int(max_size[d])} if varies else {self.size_a[d]}
            if d == 0 and varies and self._batch_power() >= 2:  # the batch's square needs a third batch size
                for extra in (1, 2, 3):
                    if len(values) < 3:
                        values.add(extra)
            axes.append(sorted(values))
        grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, len(axes))
        return [tuple(int(v) for v in point) for point in grid]


class Deepening:
    """A probe step that left out layers of a stack (``blocks.stack_runs``: ``[(template,
    skipped)]``) written out as the step with every layer. Each left-out layer would have run as
    its template (the layer before them, alike in parameters and settings), so it would have
    made a copy of each of the template's storages, and the copies would have lived as the
    template's do: what a layer's forward holds until the blocks' forward ends (autocast's cast
    weights) or until its own backward, what it hands to the next layer (its output, held by
    that layer's checkpoint) until that layer's backward, what it leaves live to the step's end
    (its weights' gradients). ``extra_terms`` adds the copies to the live bytes at every point of
    the probe; ``sample`` writes each left-out layer's quantities as its template's, less, in its
    backward, what the copies before it no longer hold there. A storage of the template that
    lives otherwise (freed by a block further off) raises ``ScalingError``, and the probes run
    every layer instead."""

    def __init__(self, raw: RawStep, num_blocks: int, runs):
        self.num_blocks = num_blocks
        self.runs = [(template, tuple(skipped)) for template, skipped in runs]
        self.skipped = {i: template for template, skipped in self.runs for i in skipped}
        self.kept = [i for i in range(num_blocks) if i not in self.skipped]
        self.raw_twins = dict(raw.twins)
        self.position = {i: k for k, i in enumerate(self.kept)}
        if raw.dropped:
            raise ScalingError(f"the data filter dropped blocks {sorted(raw.dropped)} in a probe that left layers out")
        order = [label[1] for label, _, _ in raw.marks if label[0] == "enter"]
        backward = [label[1] for label, _, _ in raw.marks if label[0] == "bwd"]
        if order != self.kept or backward != order[::-1]:
            raise ScalingError("the blocks did not run in order, forward and back, in a probe that left layers out")
        point = {label: p for (label, _, _), p in zip(raw.marks, raw.mark_points)}
        forward_end, backward_start, end = point[("ckpt", order[-1])], point[("bwd", order[-1])], point[("end",)]
        self.intervals = []  # per run: [(storage, first point, last point + 1)] of the copies' lives
        self.let_go = []  # per run: the storages each copy no longer holds in a later copy's backward
        self.arrivals = []  # per run: the block after the copies, and the storages whose copies its entry holds
        for template, _ in self.runs:
            after, before = (self.kept[self.kept.index(template) + k] for k in (1, -1))
            enter, bwd, bwd_before = point[("enter", after)], point[("bwd", template)], point[("bwd", before)]
            born, died = raw.born, raw.died
            in_forward = (born >= point[("enter", template)]) & (born < enter)
            in_backward = (born >= bwd) & (born < bwd_before)
            lasting = (in_forward | in_backward) & (died >= end)
            head = in_forward & (died >= forward_end) & (died <= backward_start)
            held = in_forward & (died > point[("bwd", after)]) & (died <= bwd_before) & ~lasting
            local = in_forward & (died <= enter)
            stop = _stretch_stop(raw, point, before)
            stray = (in_forward & ~(local | head | held | lasting)) | (in_backward & ~lasting & (died > stop))
            if stray.any():
                raise ScalingError(f"block {template} leaves tensors to blocks further off than its neighbours")
            intervals = [(k, enter, died[k]) for k in np.flatnonzero(head)]
            intervals += [(k, enter, bwd) for k in np.flatnonzero(held)]
            intervals += [(k, enter if in_forward[k] else bwd, raw.points) for k in np.flatnonzero(lasting)]
            self.intervals.append(intervals)
            self.let_go.append(np.flatnonzero(head | lasting))
            self.arrivals.append((after, np.flatnonzero(in_forward & ~local)))

    def extra_terms(self, coef: np.ndarray, points: int) -> np.ndarray:
        """The copies' bytes per feature at every point (features x points), to add to the probe's."""
        diff = np.zeros((points + 1, coef.shape[1]))
        for (_, skipped), intervals in zip(self.runs, self.intervals):
            for k, first, stop in intervals:
                diff[first] += len(skipped) * coef[k]
                diff[stop] -= len(skipped) * coef[k]
        return np.cumsum(diff, axis=0)[:points].T

    def sample(self, marks: list, trace, per_block: dict, storage_bytes: np.ndarray):
        """``build_sample`` of the probe's blocks (its live bytes with the copies'), written out
        for every block (``storage_bytes``: each storage's bytes at the sample's size)."""
        def relabel(label):
            return (label[0], self.position[label[1]]) if len(label) == 2 else label

        kept_marks = [(relabel(label), index, live) for label, index, live in marks]
        kept_per_block = {q: v[self.kept] for q, v in per_block.items()}
        twins = {self.position[i]: self.position[t] for i, t in self.raw_twins.items()}
        blocks, step, shape = build_sample(kept_marks, trace, len(self.kept), kept_per_block, {}, twins)
        # The copies are added at the entry of the block after them: the template's forward ends
        # there, and the gap before that block is measured from there.
        for (template, skipped), (after, arriving) in zip(self.runs, self.arrivals):
            jump = len(skipped) * float(storage_bytes[arriving].sum())
            t, a = self.position[template], self.position[after]
            for q, sign, k in (("ckpt_bytes", -1, t), ("plain_bytes", -1, t), ("gap_peak_bytes", 1, a)):
                if blocks[q][k] is not None:
                    blocks[q][k] = blocks[q][k] + sign * jump
        source = [self.position[self.skipped.get(i, i)] for i in range(self.num_blocks)]
        full = {q: [None if v[k] is None else np.array(v[k], dtype=float) for k in source] for q, v in blocks.items()}
        for (_, skipped), let_go in zip(self.runs, self.let_go):
            gone = float(storage_bytes[let_go].sum())
            for j, i in enumerate(skipped, start=1):
                for q in ("bwd_peak_bytes", "recompute_peak_bytes",
                          *(q for kept_set in KEPT_SETS for q in kept_quantities(kept_set)[2:])):
                    if full[q][i] is not None:
                        full[q][i] = full[q][i] - j * gone
        if shape is None:
            return full, step, None
        return full, step, type(shape)(tuple(range(self.num_blocks)), shape.backward_reversed)


def _stretch_stop(raw: RawStep, point: dict, block: int) -> int:
    """The point that ends block ``block``'s backward stretch (``collector.backward_stretch``)."""
    start = point[("bwd", block)]
    return min(p for (label, _, _), p in zip(raw.marks, raw.mark_points)
               if p > start and label[0] in ("bwd", "bwd_end", "end"))
