"""Measuring blocks at one input size, and the peak-memory model the static planners share.

``BlockProfiler`` runs one forward pass in which every saved tensor is dropped as soon as autograd
saves it (the pass is never backwarded), so measuring costs about one block of memory whatever
the budget. Inside each block it counts the unique storages the block saves, parameters and the
block's own inputs excluded: those are exactly the bytes checkpointing the block frees, since a
checkpointed block keeps its inputs. The pass runs under a forked RNG with the model's buffers
restored afterwards, so a planner that measures does not change the training run.
"""

import contextlib
import time
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_leaves

from mimose_cli.planners.base import Planner
from mimose_cli.planners.blocks import restored_buffers


@dataclass
class BlockProfile:
    """Measured per-block activation bytes and forward ms at one input size.

    ``fixed_bytes`` is everything at the step's peak that no plan changes (weights, optimizer state,
    gradients, activations outside the blocks, backward transients); 0 when no meter is attached,
    in which case the budget applies to the blocks' activations alone.
    """

    input_size: tuple
    act_bytes: list
    fwd_ms: list
    fixed_bytes: int = 0

    def peak_bytes(self, plan) -> int:
        """Modelled peak of a step with ``plan`` checkpointed: the larger of the activations kept
        at the end of forward and, for each checkpointed block, the kept activations before it
        plus its own, which backward recomputes once the later blocks are freed."""
        plan = set(plan)
        kept = [0 if i in plan else b for i, b in enumerate(self.act_bytes)]
        peak, before = sum(kept), 0
        for i, size in enumerate(self.act_bytes):
            if i in plan:
                peak = max(peak, before + size)
            before += kept[i]
        return self.fixed_bytes + peak

    @property
    def none_peak_bytes(self) -> int:
        return self.peak_bytes(())

    def recompute_ms(self, plan) -> float:
        return sum(self.fwd_ms[i] for i in plan)


def tensor_storages(tree) -> set:
    """Storage addresses of the tensors in a (nested) structure."""
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


def run_model(model, batch):
    """Call ``model`` on a batch the way the training loop does (dict → keyword arguments)."""
    return model(**batch) if isinstance(batch, dict) else model(batch)


def loss_of(output) -> torch.Tensor:
    """The scalar to backward from a model output: ``.loss`` when there is one, else a sum."""
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    if isinstance(output, (tuple, list)):
        output = output[0]
    if hasattr(output, "logits"):
        output = output.logits
    return output.float().sum()


def _sync(batch) -> None:
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            torch.cuda.synchronize(leaf.device)
            return


@contextlib.contextmanager
def side_effect_free(model, batch):
    """Fork the RNG and restore the model's buffers (BatchNorm statistics) on exit."""
    devices = sorted({leaf.device.index or 0 for leaf in tree_leaves(batch)
                      if isinstance(leaf, torch.Tensor) and leaf.is_cuda})
    with torch.random.fork_rng(devices=devices, device_type="cuda"), restored_buffers(model):
        yield


def to_model_device(model, batch):
    """Move a (dict) batch to the device of the model's parameters."""
    device = next(model.parameters()).device
    if isinstance(batch, dict):
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return batch.to(device)


class BlockProfiler:
    """Measures every block's saved activation bytes and forward time in one forward pass.

    The owning planner forwards its ``route`` here while ``active``.
    """

    def __init__(self, model, num_blocks: int):
        self.model = model
        self.num_blocks = num_blocks
        self.active = False
        self._params = set()
        self._act_bytes: list = []
        self._fwd_ms: list = []
        self._batch = None

    def measure(self, batch, repeats: int = 2) -> tuple:
        """Return ``(act_bytes, fwd_ms)`` per block; time is the minimum over ``repeats`` passes."""
        self._params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self._act_bytes = [0] * self.num_blocks
        self._fwd_ms = [float("inf")] * self.num_blocks
        self._batch = batch
        self.active = True
        try:
            with side_effect_free(self.model, batch), torch.enable_grad():
                for _ in range(repeats):
                    with saved_tensors_hooks(_drop, _unreachable):
                        run_model(self.model, batch)
        finally:
            self.active = False
            self._batch = None  # the batch is the caller's; keep no device memory after measuring
        return list(self._act_bytes), list(self._fwd_ms)

    def route(self, index, forward, args, kwargs):
        exclude = self._params | tensor_storages((args, kwargs))
        held = {}  # alive until the block ends, so a freed address cannot be counted twice

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in exclude:
                held[storage.data_ptr()] = tensor

        _sync(self._batch)
        start = time.perf_counter()
        try:
            with saved_tensors_hooks(pack, _unreachable):
                out = forward(*args, **kwargs)
            _sync(self._batch)
            self._fwd_ms[index] = min(self._fwd_ms[index], (time.perf_counter() - start) * 1e3)
            self._act_bytes[index] = sum(t.untyped_storage().nbytes() for t in held.values())
        finally:
            # Autograd keeps ``pack`` (and so ``held``) with the graph: a cycle through C++ that
            # the garbage collector cannot see. Clearing ``held`` breaks it, out of memory included.
            held.clear()
        return out


def _drop(tensor):
    return None


def _unreachable(packed):
    raise RuntimeError("a profiling pass is never backwarded")


def probe_plan(num_blocks: int) -> tuple:
    """The plan a calibration step runs: every block but the last. Recomputing the last block
    frees nothing (backward needs it at once), and leaving it plain puts a real backward of a
    block at the peak, which a checkpointed one hides (recomputation stops early and frees what
    backward has used)."""
    return tuple(range(num_blocks - 1))


def probe_step(planner, batch):
    """One forward and backward on ``batch`` that the training run never sees: RNG forked,
    buffers restored, the gradients put back as they were (the probe starts from none), the
    meter's peak reset afterwards. Returns the probe's peak (0 without a meter), or None when it
    ran out of memory."""
    meter = planner.meter
    params = list(planner.model.parameters())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    if meter is not None:
        meter.reset_peak()
    try:
        with side_effect_free(planner.model, batch), torch.enable_grad():
            loss_of(run_model(planner.model, batch)).backward()
        return meter.peak_bytes() if meter is not None else 0
    except torch.OutOfMemoryError:
        return None
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        if meter is not None:
            meter.reset_peak()


def measure_fixed_bytes(planner, batch, act_bytes) -> int:
    """Run one side-effect-free step with ``probe_plan`` and return its measured peak less the
    modelled activations of that plan: the part of the peak no plan changes.

    Needs the planner's meter; returns 0 without one. The probe (``probe_step``) does not count
    as the step's peak.
    """
    if planner.meter is None:
        return 0
    plan = probe_plan(planner.num_blocks)
    saved_plan = planner.plan
    planner.set_plan(plan)
    try:
        peak = probe_step(planner, batch)
    finally:
        planner.set_plan(saved_plan)
    if peak is None:  # nothing fits: make every plan but "all" look infeasible
        return planner.limit_bytes or 0
    return peak - BlockProfile((), act_bytes, [0.0] * len(act_bytes)).peak_bytes(plan)


class ProfilingPlanner(Planner):
    """A planner that measures its blocks with a ``BlockProfiler`` (sublinear): while the
    profiler runs, blocks are routed through it instead of the plan."""

    def __init__(self, model, budget=None, **kwargs):
        super().__init__(model, budget, **kwargs)
        self.profiler = self.measurer = BlockProfiler(model, self.num_blocks)
