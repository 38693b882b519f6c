"""DTR (Kirisame et al., ICLR 2021) at block granularity: evict under pressure, recompute on demand.

Every block's forward runs under ``saved_tensors_hooks`` whose pack stores each saved tensor in
the block's ``_Holder`` and hands autograd a small handle. When memory would exceed the budget,
whole blocks are evicted (their held tensors dropped) in order of DTR's heuristic
``cost / (memory × staleness)``; when backward unpacks a handle of an evicted block, the block is
recomputed from its stashed inputs with the RNG and autocast state of its first run, and the
recomputation's saved tensors refill the holder by pack index (as non-reentrant
``torch.utils.checkpoint`` refills its frame). A block's stashed inputs are dropped once backward
has used all it saved.
Nothing survives the step: every batch decides again, which is what makes DTR reactive.

When to evict: as DTR does, on demand, when an allocation would not fit. On a meter that supports
it (the simulated device) DTR registers a pressure handler for the step, so every allocation
(blocks, head, loss, backward temporaries) can evict. The CUDA caching allocator has no such hook,
so there (and without a meter) DTR evicts ahead of time: before a block runs (room for as much as
the previous block held) and at each pack (room for the largest saved tensor seen); allocations
outside that reserve can still run out of memory on CUDA.

Pitfalls handled (docs/BASELINES.md):
  - inputs changed in place after the block ran would recompute different values: input
    version counters are checked before recomputing and a clear error is raised;
  - BatchNorm running statistics would be updated twice: the block's buffers are restored
    after each recomputation;
  - a recomputation must save the same tensors in the same order (same count, shapes, dtypes);
    a mismatch (data-dependent control flow, a kernel choosing another algorithm) raises.
Boundary tensors (a block's inputs) are kept, not evicted: DTR's equivalence-class variant is
not implemented.
"""

import contextlib
import itertools
import time
import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks

from mimose_cli.memory import storage_bytes, storage_ids
from mimose_cli.planners.base import Planner
from mimose_cli.planners.blocks import KEEP, recomputed
from mimose_cli.planners.contract import NO_CONTEXT, Decision, Policy
from mimose_cli.planners.parts import PlannerParts
from mimose_cli.planners.runners import BlockRunner
from mimose_cli.planners.snapshots import RngState, restored_buffers
from mimose_cli.torch_private import tensor_version, tree_leaves, tree_map

_AUTOCAST_DEVICES = ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",)


class _Handle:
    """What autograd holds instead of a saved tensor; dies when backward has used it."""

    __slots__ = ("holder", "index", "__weakref__")

    def __init__(self, holder, index):
        self.holder = holder
        self.index = index


class _Holder:
    """One block call's saved tensors, stashed inputs and replay state, for one step."""

    def __init__(self, index, forward, args, kwargs, exclude_storages):
        self.index = index
        self.forward = forward
        self.args, self.kwargs = args, kwargs
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.input_versions = [(t, tensor_version(t)) for t in inputs]
        self.exclude = exclude_storages | storage_ids((args, kwargs))
        self.rng = RngState(sorted({t.device for t in inputs if t.is_cuda}, key=str))
        self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in _AUTOCAST_DEVICES]
        self.tensors = weakref.WeakKeyDictionary()  # live handle -> tensor; empty when evicted
        self.handles: list = []  # weak references to the handles, by pack index
        self.live_handles = 0
        self.meta: list = []  # (shape, dtype) by pack index, to check recomputation
        self.complete = False
        self.bytes = 0  # evictable bytes when the forward finished
        self.cost_ms = 0.0
        self.last_access = 0

    def held_bytes(self) -> int:
        """Bytes eviction would free: unique storages held, parameters and inputs excluded."""
        return storage_bytes(list(self.tensors.values()), self.exclude)

    def add_handle(self, handle) -> None:
        self.handles.append(weakref.ref(handle, self._handle_died))
        self.live_handles += 1

    def _handle_died(self, _ref) -> None:
        # Backward has used everything this block saved: its stashed inputs go now, as a
        # checkpoint frame drops its inputs, not at the end of the step.
        self.live_handles -= 1
        if self.live_handles == 0 and self.complete:
            self.release()

    def release(self) -> None:
        """Drop the held tensors and stashed inputs: once backward is done with the block, and
        for every block at the end of the step.

        Autograd nodes that backward never ran keep their handles, and through them reference
        cycles (held tensor -> grad_fn -> handle -> holder) that would keep this memory alive
        until the garbage collector happens to run, i.e. into the next step.
        """
        self.tensors.clear()
        self.args = self.kwargs = None
        self.input_versions = []


class DTRPolicy(Policy):
    """Dynamic tensor rematerialization over blocks; gradients equal those of ``none``.

    The policy decides nothing ahead of time (every block kept); its runner (``Rematerializer``)
    evicts and recomputes while the step runs, and reports the blocks it evicted as the step's
    plan, recomputed. ``cost_fn(holder) -> float`` replaces the measured forward ms as the eviction cost
    (deterministic costs for tests and experiments).
    """

    name = "dtr"
    adapts = False  # it evicts on demand already; a plan to retry with would not change its route

    def __init__(self, parts, *, cost_fn=None):
        super().__init__(parts)
        self.rematerializer = Rematerializer(parts, cost_fn)

    def decide(self, input_size, context=NO_CONTEXT):
        return Decision((KEEP,) * self.parts.num_blocks)

    def runner_for(self, info) -> "Rematerializer":
        return self.rematerializer

    def stats(self, counted: dict) -> dict:
        return dict(self.rematerializer.totals)


class Rematerializer(BlockRunner):
    """DTR's runner: every block's saved tensors held evictably, evicted under pressure by DTR's
    heuristic, recomputed when backward needs them. Reads the planner's ``parts``: budget, meter and
    blocks."""

    def __init__(self, parts: PlannerParts, cost_fn=None):
        self.parts = parts
        self.cost_fn = cost_fn
        self._params = set()
        self._holders: list = []
        self._clock = itertools.count(1)
        self._now = 0
        self._reserve_bytes = 0
        self._in_use = None  # the holder whose saved tensors backward is unpacking now
        self._on_demand = False
        self.events: list = []  # ("evict" | "recompute", block index) in order, this step
        self.totals = {"evictions": 0, "recomputations": 0, "recompute_ms": 0.0}

    def begin(self, info, inputs=None) -> None:
        super().begin(info)
        self._params = storage_ids(list(self.parts.model.parameters()))
        self._holders, self.events, self._reserve_bytes = [], [], 0
        self._step_recompute_ms = 0.0
        self._on_demand = (self._holders_enabled() and self.parts.meter is not None
                           and self.parts.meter.supports_pressure_handler)
        if self._on_demand:
            self.parts.meter.set_pressure_handler(self._relieve)

    def end(self, info):
        """The blocks evicted become the step's plan, recomputed; evictions and recomputations are counted."""
        info.plan = recomputed({index for kind, index in self.events if kind == "evict"}, self.parts.num_blocks)
        info.evictions = sum(1 for kind, _ in self.events if kind == "evict")
        info.recomputations = sum(1 for kind, _ in self.events if kind == "recompute")
        info.recompute_ms = self._step_recompute_ms
        self.totals["evictions"] += info.evictions
        self.totals["recomputations"] += info.recomputations
        self.totals["recompute_ms"] += self._step_recompute_ms
        self.abort()
        return None

    def abort(self) -> None:
        """End the step: no more pressure handler, every block's held tensors dropped."""
        super().abort()
        if self._on_demand:
            self.parts.meter.clear_pressure_handler()
        for holder in self._holders:
            holder.release()
        self._holders, self._in_use, self._on_demand = [], None, False

    def _tick(self, holder) -> None:
        self._now = next(self._clock)
        holder.last_access = self._now

    def run(self, index, forward, args, kwargs):
        if not self.active or not torch.is_grad_enabled() or not self._holders_enabled():
            return forward(*args, **kwargs)
        previous = next((h.bytes for h in reversed(self._holders) if h.complete), 0)
        self._make_room(self._ahead(previous), protect=None)  # the next block is likely as large
        holder = _Holder(index, forward, args, kwargs, self._params)
        self._holders.append(holder)

        def pack(tensor):
            handle = _Handle(holder, len(holder.handles))
            holder.add_handle(handle)
            holder.meta.append((tensor.shape, tensor.dtype))
            holder.tensors[handle] = tensor
            storage = tensor.untyped_storage()
            if id(storage) not in holder.exclude:
                self._reserve_bytes = max(self._reserve_bytes, storage.nbytes())
            self._tick(holder)
            self._make_room(self._ahead(self._reserve_bytes), protect=holder)
            return handle

        start = time.perf_counter()
        with saved_tensors_hooks(pack, self._unpack):
            out = forward(*args, **kwargs)
        holder.cost_ms = (time.perf_counter() - start) * 1e3
        holder.bytes = holder.held_bytes()
        holder.complete = True
        return out

    def _holders_enabled(self) -> bool:
        return self.parts.budget_bytes is not None

    def _ahead(self, need_bytes: int) -> int:
        """Room to make ahead of time: none when the meter evicts on demand (only the margin)."""
        return 0 if self._on_demand else need_bytes

    def _unpack(self, handle):
        holder = handle.holder
        self._in_use = holder  # its backward runs now: on-demand eviction must not take it
        if handle not in holder.tensors:
            self._rematerialize(holder)
        self._tick(holder)
        return holder.tensors[handle]

    def _tracked_bytes(self) -> int:
        if self.parts.meter is not None:
            return self.parts.meter.current_bytes()
        return sum(h.held_bytes() for h in self._holders)

    def _make_room(self, need_bytes: int, protect) -> None:
        """Evict blocks by the DTR heuristic until ``need_bytes`` more fit under the limit."""
        while self._tracked_bytes() + need_bytes > self.parts.limit_bytes:
            victim = self.choose_victim(protect)
            if victim is None:
                return
            self._evict(victim)

    def _relieve(self, need_bytes: int) -> None:
        """The meter's pressure handler: evict by the DTR heuristic until ``need_bytes`` are freed.

        Evicting a block frees less than it holds when something else still references its
        tensors (a block's output is the next one's input), hence the meter is read again.
        """
        target = self.parts.meter.current_bytes() - need_bytes
        while self.parts.meter.current_bytes() > target:
            victim = self.choose_victim(protect=None)
            if victim is None:
                return  # nothing left to evict: the meter raises out-of-memory
            self._evict(victim)

    def score(self, holder) -> float:
        """DTR's h(t) = cost / (memory × staleness); the smallest is evicted first."""
        cost = self.cost_fn(holder) if self.cost_fn is not None else holder.cost_ms
        staleness = self._now - holder.last_access + 1
        return cost / (max(holder.held_bytes(), 1) * staleness)

    def choose_victim(self, protect):
        """The block to evict next, or None: a finished one, never ``protect`` nor the block
        whose backward is running (whose saved tensors it is unpacking)."""
        candidates = [h for h in self._holders if h.complete and h is not protect
                      and h is not self._in_use and h.held_bytes() > 0]
        if not candidates:
            return None
        return min(candidates, key=lambda h: (self.score(h), h.index))

    def _evict(self, holder) -> None:
        holder.tensors.clear()
        self.events.append(("evict", holder.index))

    def _rematerialize(self, holder) -> None:
        """Recompute an evicted block and refill the tensors backward still needs."""
        if holder.args is None:
            raise RuntimeError("dtr: backward ran after planner.step() ended; run it inside")
        self._make_room(self._ahead(holder.bytes + self._reserve_bytes), protect=holder)
        _check_inputs_unchanged(holder)
        refill = _refill_hook(holder)
        start = time.perf_counter()
        module = self.parts.blocks[holder.index][1]
        with _replay_state(holder, module), saved_tensors_hooks(refill, _never_unpacked), torch.enable_grad():
            args, kwargs = tree_map(_detach, (holder.args, holder.kwargs))
            holder.forward(*args, **kwargs)
        if refill.count != len(holder.handles):
            raise RuntimeError(_nondeterministic(holder, f"saved {refill.count} tensors, first run "
                                                 f"saved {len(holder.handles)}"))
        elapsed = (time.perf_counter() - start) * 1e3
        self._step_recompute_ms += elapsed
        self.events.append(("recompute", holder.index))


def _refill_hook(holder):
    def refill(tensor):
        index = refill.count
        refill.count += 1
        if index >= len(holder.handles) or holder.meta[index] != (tensor.shape, tensor.dtype):
            raise RuntimeError(_nondeterministic(holder, f"saved tensor #{index} differs"))
        handle = holder.handles[index]()
        if handle is not None:  # else backward has used it already
            holder.tensors[handle] = tensor
    refill.count = 0
    return refill


def _nondeterministic(holder, what: str) -> str:
    return (f"dtr: recomputing block {holder.index} {what}; its forward must save the same "
            "tensors every time (no data-dependent branches); use another planner for it")


def _check_inputs_unchanged(holder) -> None:
    for tensor, version in holder.input_versions:
        if tensor_version(tensor) != version:
            raise RuntimeError(
                f"dtr: an input of block {holder.index} was modified in place after the block "
                "ran, so recomputing it would give other values; make the change out of place")


@contextlib.contextmanager
def _replay_state(holder, module):
    """The RNG and autocast state of the block's first run; the RNG as it was and the buffers of
    its ``module`` restored afterwards."""
    resume = RngState(holder.rng.device_list)
    try:
        with restored_buffers(module), contextlib.ExitStack() as stack:
            holder.rng.restore()
            for device_type, enabled, dtype in holder.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            yield
    finally:
        resume.restore()


def _detach(value):
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    return value


def _never_unpacked(_):
    raise RuntimeError("dtr: a recomputation's own graph is never backwarded")


def DTR(model, budget=None, **options) -> Planner:
    """``Planner(model, DTRPolicy, budget, **options)`` (``cost_fn``: eviction costs of your own)."""
    return Planner(model, DTRPolicy, budget, **options)
