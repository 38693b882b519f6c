"""Finer plans: each block kept, checkpointed selectively or partially, or recomputed whole (``blocks.CHOICES``).

``ChoiceTimes`` says what recomputing a block costs under each choice at any input size, from
the probe steps' measuring runs (the time inside the compute-heavy ops and inside the others,
at the two probe sizes, and the work those ops do, which says how the times grow with the size)
and the per-op cost of a Python dispatch mode on this machine: a
selective checkpoint recomputes only the light ops, but torch runs a dispatch mode over every
op of the block in its forward and in its recompute. On a GPU the heavy ops dominate and a
selective recompute costs a fraction of a full one; on tiny CPU models the dispatch mode costs
more than the heavy ops, and the scheduler sees it.

``choice_plan_checked`` is the scheduler over the choices' levels (``features.LEVELS``): a
multiple-choice knapsack solved greedily (the upgrades that free the most bytes per ms, topped up
by the cheapest one that covers the rest, or the one upgrade that covers the excess alone where that costs less), each
round checked on the predicted timeline, then each upgrade taken back, last first, where the plan
still fits without it, and blocks recomputed whole (or partially) checkpointed at a level that
keeps more where that costs less.
"""

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from mimose_cli.memory import synchronize
from mimose_cli.memory.offload import OFFLOAD_MIN_BYTES, round_trip
from mimose_cli.memory.probe import writes_elements
from mimose_cli.planners.blocks import PARTIAL_LEVELS, plan_of_levels
from mimose_cli.planners.mimose.features import EXTRA_BYTES, KEEP_LEVEL, LEVELS, RECOMPUTE_LEVEL, SELECTIVE_LEVEL
from mimose_cli.planners.mimose.scaling import exponents, work_coefficients
from mimose_cli.planners.ops import light_op_class
from mimose_cli.torch_private import UncompiledDispatchMode, tree_leaves, without_dispatch_modes


class _PassThrough(UncompiledDispatchMode):
    """A dispatch mode that only runs each op: what any Python dispatch mode costs per op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _best_ms(fn, device="cpu") -> float:
    """The fastest of three runs of ``fn()`` on ``device``, in ms (queued kernels waited for)."""
    best = math.inf
    for _ in range(3):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, (time.perf_counter() - start) * 1e3)
    return best


def dispatch_costs_ms(ops: int = 400) -> tuple:
    """``(meter, mode)``: ms per op that the dispatch modes active now add (the simulated
    device's meter), and that one more Python dispatch mode adds (a selective checkpoint's),
    timed on tiny adds (the best of three runs each)."""
    x = torch.ones(4)

    def adds() -> None:
        for _ in range(ops):
            torch.add(x, x)

    def per_op() -> float:
        return _best_ms(adds) / ops

    active = per_op()
    with _PassThrough():
        moded = per_op()
    with without_dispatch_modes():
        bare = per_op()
    return max(active - bare, 0.0), max(moded - active, 0.0)


class _KindTimer(UncompiledDispatchMode):
    """Each op's ms (its kernels waited for on ``device``) and the elements it writes, summed per
    kind (``blocks.light_op_class``), counted as ``LiveProbe.works`` counts a light op's work."""

    def __init__(self, device):
        super().__init__()
        self.device = device
        self.ms: dict = {}
        self.elements: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        synchronize(self.device)
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        synchronize(self.device)
        if writes_elements(func):
            kind = light_op_class(func)
            self.ms[kind] = self.ms.get(kind, 0.0) + (time.perf_counter() - start) * 1e3
            self.elements[kind] = self.elements.get(kind, 0) + sum(
                t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def work_rates_ms(rows: int, inner: int, cols: int, device, dtype=torch.float32,
                  light_elements: int | None = None) -> tuple:
    """``(heavy, light)``: the ms per floating-point operation of a matmul ``(rows x inner) @
    (inner x cols)``, and per kind of light op (``blocks.LIGHT_OP_CLASSES``) the ms per element
    written by an add and a multiply, an activation, a softmax and a dropout over a tensor of
    ``light_elements`` (default: the matmul's output's), as the ops this device runs them as (a
    CPU's dropout is a Bernoulli draw, a divide and a multiply) count (the best of three runs
    each): the rates a block's ops run at once they are large, which the probes' few tokens are too
    small to show (their time is the ops' calls), and an op's rate per element grows once its
    tensors outgrow the caches. Call it with no dispatch mode active (the probes set the meter
    aside). Its random numbers come from a forked generator: training's dropout masks stay those
    of a run without it."""
    device = torch.device(device)
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        a = torch.randn(rows, inner, device=device, dtype=dtype)
        b = torch.randn(inner, cols, device=device, dtype=dtype)
        out = torch.mm(a, b)
        heavy = _best_ms(lambda: torch.mm(a, b, out=out), device) / (2.0 * rows * inner * cols)
        if light_elements is not None:
            out = torch.randn(max(1, light_elements // _LIGHT_ROW), _LIGHT_ROW, device=device, dtype=dtype)
        light: dict = {}
        for _ in range(3):
            timer = _KindTimer(device)
            with timer:
                torch.add(out, out)
                torch.mul(out, out)
                torch.nn.functional.gelu(out)
                torch.softmax(out, -1)
                torch.nn.functional.dropout(out, 0.1, True)
            for kind, ms in timer.ms.items():
                light[kind] = min(light.get(kind, math.inf), ms / max(timer.elements[kind], 1))
    return heavy, light


def probe_rates_ms(raw, size: tuple, max_size: tuple, device) -> tuple | None:
    """``work_rates_ms`` on the matmul the largest compute-heavy op of ``raw`` (a probe step at
    ``size``) amounts to (``blocks.heavy_op_work``'s ``gemm``: a linear layer's, a convolution's),
    in its dtype, its rows grown with the tokens to ``max_size`` and every operand capped at
    ``RATE_ELEMENTS`` elements, and the light ops on a tensor as large as their largest at
    ``max_size`` (as capped); None when the probe ran no such op."""
    gemms = [(factor * math.prod(dims), gemm) for works in raw.op_works.values()
             for heavy, dims, factor, gemm in works if heavy and gemm is not None]
    if not gemms:
        return None
    rows, inner, cols, dtype = max(gemms, key=lambda g: g[0])[1]
    rows = rows * math.prod(max_size) / math.prod(size)
    inner = min(inner, RATE_ELEMENTS // 64)
    rows = max(1, int(min(rows, RATE_ROWS, RATE_ELEMENTS // inner)))
    cols = max(1, min(cols, RATE_ELEMENTS // max(rows, inner)))
    # The light ops' largest tensor at ``max_size`` (an attention's scores, quadratic in the
    # length: grown by the tokens squared, an upper bound for the rest), capped as the operands.
    lights = [math.prod(dims) for works in raw.op_works.values() for heavy, dims, _, _ in works if not heavy]
    growth = max_size[0] / size[0] * (math.prod(max_size[1:]) / math.prod(size[1:])) ** 2
    light_elements = int(min(RATE_ELEMENTS, max(lights) * growth)) if lights else None
    return work_rates_ms(rows, inner, cols, device, dtype if dtype.is_floating_point else torch.float32,
                         light_elements)


def copy_costs_ms(device, small: int = 1 << 16, large: int = 1 << 23) -> tuple:
    """``(per storage, per byte)``: the ms an offloaded block's saved storage costs to move to host
    memory and back (``memory.offload.round_trip``: on CUDA pinned copies on the side stream, on
    the CPU a copy in the one memory), fitted through storages of ``small`` and ``large`` bytes on
    ``device`` (the best of three runs each). Timed back to back, so an upper bound of what a step
    pays where the copy out overlaps the compute. Call it with no dispatch mode active."""
    device = torch.device(device)
    times = []
    for nbytes in (small, large):
        tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        times.append(_best_ms(lambda tensor=tensor: round_trip(tensor), device))
    per_byte = max((times[1] - times[0]) / (large - small), 0.0)
    return max(times[0] - per_byte * small, 0.0), per_byte


_LIGHT_ROW = 256
"""The last dimension of the tensor the light ops' rates are timed on (a softmax's rows)."""
RATE_ROWS, RATE_ELEMENTS = 2048, 1 << 22
"""``probe_rates_ms``'s caps: rows (a rate no longer changes past a few thousand) and elements of
each operand (16 MiB in fp32), whatever the model's width or vocabulary."""


@dataclass
class ChoiceTimes:
    """Per block, the ms inside its compute-heavy ops and inside the others as ``a + r * work``,
    ``work`` the work those ops do at the input size: coefficients over the size's features
    (``heavy_work``, ``light_work``; floating-point operations of the heavy ops, elements the
    others write), exact from the ops' shapes at the two probe sizes
    (``scaling.work_coefficients``), so that a time grows as its ops' work does (an attention's
    quadratically in the length where its matmuls' outputs do not); ``r`` the ms per unit of work
    and ``a`` what the block's ops cost whatever their size, fitted through the two probes'
    measuring runs. Also its op counts and the per-op costs of the dispatch modes
    (``dispatch_costs_ms``)."""

    heavy: np.ndarray  # (blocks, 2): a, r
    light: np.ndarray
    heavy_work: np.ndarray  # (blocks, features)
    light_work: np.ndarray
    heavy_ops: np.ndarray
    light_ops: np.ndarray
    meter_ms: float
    mode_ms: float
    storages: np.ndarray | None = None
    """Per block, the storages its measuring run saved (``choices="offload"``: each is copied)."""
    copy_ms: tuple | None = None
    """``copy_costs_ms`` on the training device (``choices="offload"``); None: not timed."""
    partial_work: np.ndarray | None = None
    """``(blocks, partial levels, features)``: the work of the heavy ops each partial level
    (``features.PARTIAL_LEVELS``) runs again in its recompute; NaN where a block has no such level."""
    partial_ops: np.ndarray | None = None
    """``(blocks, partial levels)``: how many heavy ops each partial level runs again."""
    light_weights: dict | None = None
    """Per kind of light op (``blocks.LIGHT_OP_CLASSES``), its ms per element over a pointwise op's,
    as ``light_work`` counts it; None: every element alike."""

    @classmethod
    def from_probes(cls, raws: list, sizes: list, feature_set, stand_in: dict, costs: tuple,
                    rates: tuple | None = None, prefixes: list | None = None) -> "ChoiceTimes | None":
        """From the two probe steps (``RawStep.op_ms``, ``op_works``) at ``sizes``; a block not
        measured takes the values of ``stand_in[block]`` (the block like it that was). ``rates``:
        the ms per unit of work of the heavy ops and of each kind of light op (``work_rates_ms``: a
        device's, timed on ops as large as training's; a block's light work is counted in pointwise
        elements, each kind's at its rate over the pointwise one: ``light_weights``); without them,
        the slope between the two probes, pooled over the blocks, every light element alike. None
        when a block has no stand-in measured; ``storages`` None where the probes did not count
        them. ``prefixes`` (``scaling.partial_prefixes``): the partial levels' times too."""
        n = len(raws[0].per_block["saved_bytes"])
        values = {}
        for quantity in ("heavy_ms", "light_ms", "ops", "heavy_ops", "saved_storages"):
            v = np.array([raw.op_ms.get(quantity, np.full(n, np.nan)) for raw in raws], dtype=float)
            for i in range(n):
                if np.isnan(v[:, i]).any():
                    v[:, i] = v[:, stand_in.get(i, i)]
            values[quantity] = None if np.isnan(v).any() else v
        if any(values[q] is None for q in ("heavy_ms", "light_ms", "ops", "heavy_ops")):
            return None
        storages = values["saved_storages"]
        weights = None
        if rates is not None:
            unit = rates[1].get("pointwise", 0.0)
            weights = {kind: rate / unit for kind, rate in rates[1].items()} if unit > 0 else None
            rates = (rates[0], unit if unit > 0 else None)
        works = _block_works(raws, sizes, feature_set, stand_in, n, weights)
        if works is None:
            return None
        f = np.stack([feature_set.of(size) for size in sizes])  # (2, features)
        fits = [_rate_fit(values[q], f @ work.T, None if rates is None else rates[k])
                for k, (q, work) in enumerate(zip(("heavy_ms", "light_ms"), works))]
        ops, heavy_ops = values["ops"].mean(axis=0), values["heavy_ops"].mean(axis=0)
        partial = (None, None) if prefixes is None else _partial_works(raws, sizes, feature_set, stand_in, prefixes, n)
        return cls(fits[0], fits[1], works[0], works[1], heavy_ops, ops - heavy_ops, *costs,
                   storages=None if storages is None else storages.max(axis=0),
                   partial_work=partial[0], partial_ops=partial[1], light_weights=weights)

    def at(self, features: np.ndarray) -> tuple:
        """``(recompute ms, selective ms)`` per block at an input size whose features
        (``FeatureSet.of``) are ``features``."""
        heavy = np.maximum(self.heavy[:, 0] + self.heavy[:, 1] * (self.heavy_work @ features), 0.0)
        light = np.maximum(self.light[:, 0] + self.light[:, 1] * (self.light_work @ features), 0.0)
        ops = self.heavy_ops + self.light_ops
        recompute = heavy + light + ops * self.meter_ms
        selective = light + self.light_ops * self.meter_ms + 2 * ops * self.mode_ms
        return recompute, selective

    def partial_at(self, features: np.ndarray, selective_ms: np.ndarray | None = None) -> np.ndarray | None:
        """``(blocks, partial levels)``: the ms of each partial level's recompute at an input size
        whose features are ``features``, NaN where a block has no such level (None: not known): the
        selective recompute's (``selective_ms``, ``at``'s) and the heavy ops it runs again, each
        its share of the block's heavy ops' fixed cost and the rate times its work."""
        if self.partial_work is None:
            return None
        if selective_ms is None:
            selective_ms = self.at(features)[1]
        share = self.partial_ops / np.maximum(self.heavy_ops, 1.0)[:, None]
        heavy = self.heavy[:, :1] * share + self.heavy[:, 1:] * (self.partial_work @ features)
        return selective_ms[:, None] + np.maximum(heavy, 0.0) + self.partial_ops * self.meter_ms

    def offload_at(self, saved_bytes: np.ndarray) -> np.ndarray | None:
        """The ms offloading each block costs where it saves ``saved_bytes`` (the estimator's
        prediction at the input size): each of its storages moved out and back (``copy_ms``) and
        the meter's two ops per storage; None where the copies were not timed. Every storage is
        counted, those ``OffloadHooks`` leave on the device too: an upper bound."""
        if self.copy_ms is None or self.storages is None:
            return None
        per_storage, per_byte = self.copy_ms
        return self.storages * (per_storage + 2 * self.meter_ms) + per_byte * np.maximum(saved_bytes, 0.0)

    def state_dict(self) -> dict:
        return {"heavy": self.heavy.tolist(), "light": self.light.tolist(), "heavy_work": self.heavy_work.tolist(),
                "light_work": self.light_work.tolist(), "heavy_ops": self.heavy_ops.tolist(),
                "light_ops": self.light_ops.tolist(), "meter_ms": self.meter_ms, "mode_ms": self.mode_ms,
                "storages": None if self.storages is None else self.storages.tolist(),
                "copy_ms": None if self.copy_ms is None else list(self.copy_ms),
                "partial_work": None if self.partial_work is None else _plain(self.partial_work),
                "partial_ops": None if self.partial_ops is None else _plain(self.partial_ops),
                "light_weights": self.light_weights}

    @classmethod
    def from_state(cls, state: dict | None, feature_set) -> "ChoiceTimes | None":
        """What ``state_dict`` wrote; a state written before the work was known (times linear in
        the product of the size's dimensions) reads as work in the feature that is that product."""
        if not state:
            return None
        heavy, light = np.array(state["heavy"], dtype=float), np.array(state["light"], dtype=float)
        if "heavy_work" in state:
            works = np.array(state["heavy_work"], dtype=float), np.array(state["light_work"], dtype=float)
        else:
            variables, powers = exponents(feature_set)
            product = np.array([p == (1,) * len(variables) for p in powers], dtype=float)  # BL, BED
            works = np.tile(product, (len(heavy), 1)), np.tile(product, (len(light), 1))
        storages, copy_ms = state.get("storages"), state.get("copy_ms")
        partial_work, partial_ops = state.get("partial_work"), state.get("partial_ops")
        return cls(heavy, light, *works, np.array(state["heavy_ops"]), np.array(state["light_ops"]),
                   float(state["meter_ms"]), float(state["mode_ms"]),
                   None if storages is None else np.array(storages, dtype=float),
                   None if copy_ms is None else tuple(float(c) for c in copy_ms),
                   None if partial_work is None else np.array(partial_work, dtype=float),
                   None if partial_ops is None else np.array(partial_ops, dtype=float),
                   state.get("light_weights"))


def _plain(array: np.ndarray) -> list:
    """An array as nested lists for JSON, NaN as None (``np.array(..., dtype=float)`` reads it back)."""
    return np.where(np.isnan(array), None, array).tolist()


def _partial_works(raws: list, sizes: list, feature_set, stand_in: dict, prefixes: list, n: int) -> tuple:
    """``(partial_work, partial_ops)`` of ``ChoiceTimes``: per block and partial level
    (``scaling.Prefixes``), the work coefficients of the heavy ops its recompute runs again (the
    kept ops' successors up to the last the recompute takes back), from the two probes'
    ``op_works``. NaN where a block has no such level, or where its measuring run's heavy ops are
    not those its checkpointed run made outputs for (the ops could not be told apart)."""
    work = np.full((n, len(PARTIAL_LEVELS), len(feature_set.names)), np.nan)
    ops = np.full((n, len(PARTIAL_LEVELS)), np.nan)
    for i in range(n):
        source, prefix = (i if i in raws[0].op_works else stand_in.get(i, i)), prefixes[i]
        if prefix is None or source not in raws[0].op_works or source not in raws[1].op_works:
            continue
        heavy = [[w for w in raw.op_works[source] if w[0]] for raw in raws]
        if len(heavy[0]) != prefix.forward_ops:
            continue
        for k, kept_ops in enumerate(prefix.ops):
            if kept_ops is None:
                continue
            rows = work_coefficients(*(h[kept_ops:prefix.taken_ops] for h in heavy), *sizes, feature_set)
            if rows is not None:
                work[i, k], ops[i, k] = rows[0], prefix.taken_ops - kept_ops
    return work, ops


def _block_works(raws: list, sizes: list, feature_set, stand_in: dict, n: int, light_weights: dict | None = None):
    """Each block's ``(heavy, light)`` work coefficients (blocks x features, two arrays) from the
    two probes' ``op_works`` (``scaling.work_coefficients``, the light ops' weighted by kind), a
    block not measured taking its stand-in's; None when a block's cannot be read."""
    rows = {}
    for i in set(raws[0].op_works) & set(raws[1].op_works):
        rows[i] = work_coefficients(raws[0].op_works[i], raws[1].op_works[i], *sizes, feature_set, light_weights)
    found = [rows.get(i) or rows.get(stand_in.get(i, i)) for i in range(n)]
    if any(row is None for row in found):
        return None
    return np.stack([row[0] for row in found]), np.stack([row[1] for row in found])


def _rate_fit(ms: np.ndarray, work: np.ndarray, rate: float | None = None) -> np.ndarray:
    """``(blocks, 2)``: ``a`` per block and the rate ``r`` (one for all) of ``ms = a + r * work``,
    both ``(probes, blocks)``: ``r`` as given, else the pooled slope between the two probes (none
    where the work did not grow or the time fell); ``a`` the mean of each block's remainder (what
    its ops cost whatever their size: calls, dispatch), never below zero."""
    if rate is None:
        grew = work[1].sum() - work[0].sum()
        rate = max((ms[1].sum() - ms[0].sum()) / grew, 0.0) if grew > 0 else 0.0
    base = np.maximum((ms - rate * work).mean(axis=0), 0.0)
    return np.stack([base, np.full(len(base), rate)], axis=1)


def freeing_ms(recompute_ms: np.ndarray, offload_ms: np.ndarray | None) -> tuple:
    """``(ms, offloaded)``: per block, what freeing it whole costs (the recompute level's cost in
    ``choice_plan_checked``): its recompute, or its offload where that is cheaper, and which
    blocks that offloads (a bool mask; none without ``offload_ms``). The scheduler prices one
    level for both: an offloaded block holds no more device memory at any point of the step than
    a recomputed one, but for the small storages it keeps (``bounded_for_offload`` adds them), so
    the recompute level's predicted peaks bound it (docs/MIMOSE.md, "Offload in a plan")."""
    if offload_ms is None:
        return recompute_ms, np.zeros(len(recompute_ms), dtype=bool)
    offloaded = offload_ms < recompute_ms
    return np.where(offloaded, offload_ms, recompute_ms), offloaded


def bounded_for_offload(pred, offloaded: np.ndarray, storages: np.ndarray | None):
    """``pred`` (an ``estimator.Prediction``) with the blocks in ``offloaded`` bounded as offloaded
    rather than recomputed: such a block keeps on the device the saved storages ``OffloadHooks``
    leaves there (under ``OFFLOAD_MIN_BYTES``; at most ``storages``, all it saves), from its
    forward to its backward, where a checkpoint keeps none of them. What it holds checkpointed and
    its checkpointed forward's peak are raised by that much (a copy; ``pred`` itself unchanged):
    the recompute level's peaks then bound the offload at any size, the smallest too, where those
    storages can outweigh the inputs the checkpoint holds and the offload does not. Its
    selective level is raised as well (a few KiB per block: an upper bound)."""
    if storages is None or not offloaded.any():
        return pred
    kept = np.where(offloaded, storages * (OFFLOAD_MIN_BYTES - 1), 0.0)
    blocks = dict(pred.blocks)
    for quantity in ("ckpt_bytes", "ckpt_fwd_peak_bytes"):
        blocks[quantity] = blocks[quantity] + kept
    return dataclasses.replace(pred, blocks=blocks)


def priced_freeing(pred, recompute_ms: np.ndarray, offload_ms: np.ndarray | None, storages: np.ndarray | None) -> tuple:
    """``(pred, whole_ms, offloaded)``: each block freed whole at the cheaper of its recompute and
    its offload (``freeing_ms``), and ``pred`` with the blocks that offloads bounded as recomputed
    plus what they keep (``bounded_for_offload``): what Mimose's scheduler and the oracle's
    search plan a block freed whole on."""
    whole_ms, offloaded = freeing_ms(recompute_ms, offload_ms)
    return bounded_for_offload(pred, offloaded, storages), whole_ms, offloaded


def level_rows(pred, open_to: list, selective_ms: np.ndarray, partial_ms: np.ndarray, whole_ms: np.ndarray) -> tuple:
    """``(savings, costs)``: ``choice_plan_checked``'s rows over ``features.LEVELS`` for ``pred``
    (an ``estimator.Prediction``): a block kept frees and costs nothing; checkpointed selectively or
    at a partial level (``features.KEPT_SETS``) it frees what checkpointing it frees less the
    outputs that level keeps, where ``open_to`` (a mask over blocks per kept set) lets it and that is
    more than nothing (NaN: not a choice), for ``selective_ms`` and ``partial_ms`` (blocks x partial
    levels); freed whole, all of it, for ``whole_ms``."""
    whole = pred.savings
    rows = np.zeros((LEVELS, len(whole)))  # every kept set's row at once (a miss builds them)
    freed = whole - np.maximum([pred.blocks[quantity] for quantity in EXTRA_BYTES], 0.0)
    rows[SELECTIVE_LEVEL:RECOMPUTE_LEVEL] = np.where((freed > 0) & np.asarray(open_to, dtype=bool), freed, np.nan)
    rows[RECOMPUTE_LEVEL] = whole
    costs = np.zeros_like(rows)
    costs[SELECTIVE_LEVEL], costs[SELECTIVE_LEVEL + 1:RECOMPUTE_LEVEL], costs[RECOMPUTE_LEVEL] = (
        selective_ms, partial_ms.T, whole_ms)
    return rows, costs


def choice_plan_checked(savings: Sequence[Sequence[float]], costs: Sequence[Sequence[float]],
                        predict_peaks: Callable[[np.ndarray], np.ndarray], limit_bytes: float) -> tuple:
    """The least-recompute choices whose predicted peak fits: ``(plan, peak, fits)``, the plan one
    choice per block (``blocks.plan_of_levels``: none offloaded).

    ``savings[level][i]`` and ``costs[level][i]`` are what block ``i`` frees and costs under each
    level (``features.LEVELS``: keep, selective, the partial levels, recompute; or only keep,
    selective and recompute, the partial levels then left out; a level a block cannot take has NaN
    savings, one whose time is not known NaN costs: neither is chosen); ``predict_peaks(levels)``
    is the step's predicted peak for each row of ``levels`` (plans x blocks, a level per block:
    ``estimator.Timeline.level_peaks``). Each round upgrades
    blocks until their savings cover the excess (``_Upgrades.best``: the cheaper of the one upgrade
    that covers it alone and the best bytes-per-ms upgrades topped up; ties: the earlier block,
    whose savings last longest in backward), then predicts the whole plan again; once it fits, the
    upgrades are taken back, last first, each where the plan still fits without it and that costs
    no more, and blocks recomputed whole (or partially) are checkpointed at a level that keeps more
    instead where that costs less and still fits. Those two passes predict their plans in batches
    (``_each_that_fits``)."""
    save, cost = _all_levels(savings, np.nan), _all_levels(costs, 0.0)
    cost[KEEP_LEVEL] = 0.0  # a kept block costs nothing, whatever ``costs`` says
    np.copyto(save, -1.0, where=np.isnan(save) | np.isnan(cost))  # a level a block cannot take (or unpriced)
    cost[save < 0] = 0.0  # never priced
    # The per-upgrade bookkeeping reads Python lists, not numpy scalars (each read several times
    # slower), as a miss applies dozens of upgrades; the float64 arithmetic is the same.
    rows, prices = save.tolist(), cost.tolist()
    options = _Upgrades(save, cost)
    level = [KEEP_LEVEL] * save.shape[1]
    taken: list = []

    def predict(level: list) -> float:
        return float(predict_peaks(np.array([level]))[0])

    peak = predict(level)
    while not peak <= limit_bytes:  # (a peak that is not a number never fits)
        excess = peak - limit_bytes
        moved = False
        while excess > 0:
            upgrades = options.best(level, excess)
            if not upgrades:
                break
            for i, to in upgrades:
                excess -= rows[to][i] - max(rows[level[i]][i], 0.0)
                taken.append((i, level[i]))
                level[i] = to
            moved = True
        if not moved:  # no upgrade frees more by the savings: the rest recomputed, as the block greedy
            rest = [i for i, at in enumerate(level) if at < RECOMPUTE_LEVEL]
            if not rest:
                break
            taken += [(i, level[i]) for i in rest]
            level = [RECOMPUTE_LEVEL] * len(level)
        peak = predict(level)
    if not peak <= limit_bytes:
        return plan_of_levels(level), peak, False
    # Taken back last first where the plan still fits without them and that costs no more (a
    # recompute taken back to selective can cost more on a small CPU model); one that does not
    # fit is skipped, not the end of the pass: the upgrades before it may still be given back (a
    # base-width BERT: three layers selective and one recomputed, where one recomputed and one
    # selective fit, as the oracle found).
    level, peak = _each_that_fits(level, peak, reversed(taken), prices, predict_peaks, limit_bytes)
    # The greedy takes a whole recompute where its bytes per ms are best, though a level that keeps
    # more (selective, partial) costs less and may free enough: each such change tried, the one
    # giving up the fewest bytes first, where the plan still fits.
    lighter = [(i, to) for i, at in enumerate(level) if at > SELECTIVE_LEVEL for to in range(SELECTIVE_LEVEL, at)
               if rows[to][i] >= 0 and prices[to][i] < prices[at][i]]
    lighter.sort(key=lambda change: (rows[level[change[0]]][change[0]] - rows[change[1]][change[0]], change[0]))
    level, peak = _each_that_fits(level, peak, lighter, prices, predict_peaks, limit_bytes)
    return plan_of_levels(level), peak, True


def _all_levels(rows: Sequence[Sequence[float]], missing: float) -> np.ndarray:
    """``(LEVELS, blocks)``: ``choice_plan_checked``'s savings or costs, the partial levels filled
    with ``missing`` where only keep, selective and recompute are given."""
    rows = np.array(rows, dtype=float)  # a copy: the caller's rows stay as they are
    if len(rows) == LEVELS:
        return rows
    if len(rows) != 3:
        raise ValueError(f"expected {LEVELS} levels (or keep, selective and recompute), got {len(rows)}")
    full = np.full((LEVELS, rows.shape[1]), missing)
    full[[KEEP_LEVEL, SELECTIVE_LEVEL, RECOMPUTE_LEVEL]] = rows
    return full


def _each_that_fits(level: list, peak: float, changes: Iterable, prices: list, predict_peaks: Callable,
                    limit_bytes: float) -> tuple:
    """``(level, peak)`` after each of ``changes`` (``(block, level)``, in order) made where it
    costs no more (``prices[level][block]``, zero for a kept block) and the plan still fits with
    it, and skipped where not: what a walk predicting one change at a time chooses, in fewer
    calls. Each call predicts each change left alone on the plan so far and, once a change has
    fitted, the plans a walk would reach if the next ``_WALK`` fitted in turn: the walk goes on to
    the first of those that does not fit (skipped), or, where the very first does not, to the first
    of the others that fits alone (all skipped where none does). A pass where nothing fits takes one
    call of a plan per change."""

    def usable(plan: list, i: int, to: int) -> bool:
        return plan[i] != to and prices[to][i] <= prices[plan[i]][i]

    changes, walk_size = list(changes), 1
    while changes := [(i, to) for i, to in changes if usable(level, i, to)]:
        head = changes[:walk_size]
        walk, trial = [], level  # the plans if each fits in turn (None: skipped there, costs more)
        for i, to in head:
            if usable(trial, i, to):
                trial = trial.copy()
                trial[i] = to
                walk.append(trial)
            else:
                walk.append(None)
        # Each change left alone: rows of the plan so far with one level changed (built in numpy:
        # dozens of rows converted from lists cost more than predicting them).
        others = np.array(changes[1:], dtype=np.intp).reshape(-1, 2)
        alone = np.empty((len(others), len(level)), dtype=np.intp)
        alone[:] = level
        alone[np.arange(len(others)), others[:, 0]] = others[:, 1]
        walked = [plan for plan in walk if plan is not None]
        peaks = predict_peaks(np.concatenate((np.array(walked, dtype=np.intp), alone)))
        fits = peaks <= limit_bytes  # the rounds' test (a NaN peak does not fit)
        done, k = len(head), 0
        for index, plan in enumerate(walk):
            if plan is None:
                continue
            if not fits[k]:
                done = index + 1  # skipped: the plans after it were predicted on top of it
                break
            level, peak, k, walk_size = plan, float(peaks[k]), k + 1, _WALK
        if k == 0:  # the first did not fit: the first of the others that fits alone
            fitting = np.flatnonzero(fits[len(walked):])
            done = len(changes)  # none of them fits on this plan: each skipped
            if len(fitting):
                first = int(fitting[0])
                level, peak, done = alone[first].tolist(), float(peaks[len(walked) + first]), first + 2
                walk_size = _WALK
        changes = changes[done:]
    return level, peak


_WALK = 8
"""``_each_that_fits``: the changes one call walks through in turn."""


_TARGETS = np.arange(1, LEVELS)
_TARGET_LEVELS = tuple(_TARGETS.tolist())
_WIDTH = len(_TARGET_LEVELS)
_UPWARD_BLOCKS = (np.arange(LEVELS)[:, None] < _TARGETS)[:, None, :]
"""(from level, 1, to level): whether an upgrade goes up."""


class _Upgrades:
    """Every upgrade (a block to a higher level: selective, partial, recompute) from each level a
    block may be at: the bytes it frees more, the ms it costs more (at least 1 ns), whether it is
    open (to a higher level the block can take, freeing more) and its bytes per ms: worked out once
    per scheduling, as the savings and costs do not change, so that ``best`` reads a plan's
    upgrades with one ``take``. Flattened in block order, the lower target level first for a block."""

    def __init__(self, save: np.ndarray, cost: np.ndarray):
        n = save.shape[1]
        # (gain, extra, usable, rate; from level, block, to level): what an upgrade frees and
        # costs beyond what the block's level already does (``cost[KEEP_LEVEL]`` is zero: a kept
        # block costs nothing), block-major, selective first.
        tables = np.empty((4, LEVELS, n, _WIDTH))
        gain, extra, usable, rate = tables
        np.subtract(save[1:].T, np.maximum(save, 0.0)[:, :, None], out=gain)
        np.maximum(cost[1:].T - cost[:, :, None], 1e-9, out=extra)
        np.logical_and(_UPWARD_BLOCKS & (save[1:].T >= 0), gain > 0, out=usable)
        np.divide(gain, extra, out=rate)
        rate[usable == 0] = -np.inf
        self.tables = tables.reshape(4, -1)
        self.flat, self.width = np.arange(_WIDTH * n), _WIDTH * n
        self.starts = np.arange(n) * _WIDTH  # each block's first upgrade in a plan's row
        self.blocks = n

    def best(self, level: list, excess: float) -> list:
        """``[(block, level)]``: the upgrades with the most extra bytes per extra ms, best first
        (ties: the earlier block, then selective), one per block, as many as leave some excess (at
        least one), so that a caller takes them in one go; where an upgrade covers ``excess`` alone,
        the cheapest such one instead, unless those best-rate upgrades and the cheapest upgrade of
        another block that covers what they leave cost less together (two blocks checkpointed
        selectively rather than one recomputed whole). Empty when no upgrade frees more."""
        # (numpy's methods called directly: their wrappers cost as much as the arithmetic here)
        at = np.array(level).repeat(_WIDTH) * self.width + self.flat
        gain, extra, usable, rate = self.tables.take(at, axis=1)
        usable = usable > 0
        if not usable.any():
            return []
        covers = usable & (gain >= excess)
        any_covers = covers.any()
        if any_covers:
            single = int(np.where(covers, extra, np.inf).argmin())
            # Best-rate upgrades topped up are two blocks at least: never cheaper than the two
            # cheapest blocks' upgrades, so where the covering one costs no more, it is the answer.
            cheapest = np.where(usable, extra, np.inf).reshape(-1, _WIDTH).min(axis=1)
            cheapest = cheapest[cheapest.argpartition(1)[:2]] if len(cheapest) > 1 else cheapest
            if len(cheapest) < 2 or extra[single] <= cheapest.sum():
                return [(single // _WIDTH, _TARGET_LEVELS[single % _WIDTH])]
        # Each block's best-rate upgrade (ties: the lower level) and the usable ones best first
        # (ties: the earlier block), taken while what they free together leaves some excess: the
        # first that covers it (after the first) ends the list. Sums in order, as one by one.
        flats = self.starts + rate.reshape(-1, _WIDTH).argmax(axis=1)
        by_rate = rate[flats]
        flats = flats[(-by_rate).argsort(kind="stable")[: int((by_rate > -np.inf).sum())]]
        freed = np.add.accumulate(gain[flats])
        count = max(1, int(freed.searchsorted(excess)))
        flats, total = flats[:count], float(freed[count - 1])
        spent = float(np.add.accumulate(extra[flats])[-1])
        chosen = [(flat // _WIDTH, _TARGET_LEVELS[flat % _WIDTH]) for flat in flats.tolist()]
        if not any_covers:
            return chosen
        if total < excess:  # the rest covered by another block's cheapest upgrade that covers it alone
            others = np.ones(self.blocks, dtype=bool)
            others[flats // _WIDTH] = False
            rest = usable & (gain >= excess - total) & others.repeat(_WIDTH)
            if not rest.any():
                return [(single // _WIDTH, _TARGET_LEVELS[single % _WIDTH])]
            last = int(np.where(rest, extra, np.inf).argmin())
            chosen, spent = chosen + [(last // _WIDTH, _TARGET_LEVELS[last % _WIDTH])], spent + float(extra[last])
        return chosen if spent < extra[single] else [(single // _WIDTH, _TARGET_LEVELS[single % _WIDTH])]
