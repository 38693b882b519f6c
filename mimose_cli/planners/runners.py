"""The applier: the one place that runs blocks differently.

``StepRouter`` (through ``BlockRouter``, which replaces each block's ``forward``) hands every call
to the ``BlockRunner`` in force: ``PlanRunner`` (every planner's default) checkpoints the blocks
in the plan; a planner that measures (Mimose's collector, Sublinear's profiler) or evicts (DTR)
puts its own runner in force (``Policy.runner_for``, ``StepRouter.using``).
"""

import contextlib
import copy
import functools
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mimose_cli.planners.blocks import (
    KEEP,
    OFFLOAD,
    PARTIAL_LEVELS,
    RECOMPUTE,
    SELECTIVE,
    _is_hf_checkpoint_layer,
    check_plan,
)
from mimose_cli.planners.compiled import refuse_selective_plan
from mimose_cli.planners.ops import COMPUTE_HEAVY_OPS
from mimose_cli.planners.snapshots import restored_buffers
from mimose_cli.torch_private import top_saved_tensors_hook_name, tree_leaves

_CHECKPOINT_HOOKS = ("_checkpoint_hook", "_recomputation_hook")


def inside_checkpoint(markers=_CHECKPOINT_HOOKS) -> bool:
    """True while a ``torch.utils.checkpoint`` region (forward or recompute) is running."""
    name = top_saved_tensors_hook_name()
    return bool(name) and any(marker in name for marker in markers)


def recomputing() -> bool:
    """True while backward recomputes a checkpointed region (asked after every op a probe sees)."""
    return "_recomputation_hook" in top_saved_tensors_hook_name()


class RecomputeClock:
    """Time spent recomputing checkpointed blocks in backward; ``take()`` returns and resets it.

    On CUDA it records events (no synchronisation while the step runs) and resolves them in
    ``take()``. A recompute that torch stops early (once backward has what it needs) is timed
    up to that point.
    """

    def __init__(self):
        self._ms = 0.0
        self._events: list = []

    def timed(self, forward):
        @functools.wraps(forward)
        def run(*args, **kwargs):
            if not recomputing():
                return forward(*args, **kwargs)
            device = next((t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
            if device is not None and device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                try:
                    return forward(*args, **kwargs)
                finally:
                    end.record()
                    self._events.append((start, end))
            begin = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self._ms += (time.perf_counter() - begin) * 1e3
        return run

    def take(self) -> float:
        """Milliseconds recomputed since the last ``take()``."""
        for start, end in self._events:
            end.synchronize()
            self._ms += start.elapsed_time(end)
        ms, self._ms, self._events = self._ms, 0.0, []
        return ms


def _buffers_kept_in_recompute(module: nn.Module, forward):
    """``forward``, putting ``module``'s buffers back after backward recomputes it, so that a
    step advances BatchNorm statistics once, in its forward, under every plan. The recompute
    runs with the statistics its forward advanced, as under torch's checkpoint alone; a BatchNorm
    in training normalises with the batch's own, so it computes the same values. The snapshot
    lives only while the block is recomputed."""
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not recomputing():
            return forward(*args, **kwargs)
        with restored_buffers(module):
            return forward(*args, **kwargs)
    return run



def _selective_contexts(keep: int | None = None):
    """Torch's selective checkpoint contexts for one checkpointed call: the compute-heavy ops'
    outputs kept, the rest recomputed; with ``keep``, only the first ``keep`` output tensors of
    heavy ops (in forward order) are kept. Non-reentrant checkpointing stops recomputing once the
    last saved tensor is packed again — for a matmul, its input, before it runs — so a block's
    last matmul (a pre-norm layer's, whose output only the residual add reads) is never rerun and
    an output kept for it would only be held until the block's backward is over: the probes count
    the heavy outputs the recompute does take back (``scaling.selective_keeps``), and those are
    kept."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    seen = 0

    def policy(ctx, op, *args, **kwargs):
        nonlocal seen
        if op not in COMPUTE_HEAVY_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        out = ctx.op_output
        seen += 1 if isinstance(out, torch.Tensor) else sum(isinstance(t, torch.Tensor) for t in tree_leaves(out))
        return CheckpointPolicy.MUST_SAVE if keep is None or seen <= keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def run_checkpointed(forward, args, kwargs, clock: RecomputeClock | None = None, choice: str = RECOMPUTE,
                     keep: int | None = None):
    """Run ``forward`` under non-reentrant checkpointing with RNG state preserved: all of it
    recomputed in backward, or (``choice`` ``SELECTIVE``) all but the compute-heavy ops' outputs,
    which are kept (the first ``keep`` of them: ``_selective_contexts``); a ``clock`` times the
    recomputation."""
    if clock is not None:
        forward = clock.timed(forward)
    extra = {}
    if choice == SELECTIVE:
        extra["context_fn"] = functools.partial(_selective_contexts, keep)
    elif choice != RECOMPUTE:
        raise ValueError(f"choice={choice!r} cannot be checkpointed; expected {SELECTIVE!r} or {RECOMPUTE!r}")
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


def run_block(choice: str, forward, args, kwargs, clock: RecomputeClock | None = None, offload_hooks=None,
              keep: int | None = None):
    """The one place a block is run as a plan chose (``CHOICES``), in training; an ``OFFLOAD``
    block runs under ``offload_hooks()`` (``PlanRunner.offload_hooks``), a ``SELECTIVE`` one keeps
    the first ``keep`` heavy outputs (all when None), a partial one (``PARTIAL_LEVELS``) is a
    selective checkpoint given the ``keep`` of its level. A choice is one of ``CHOICES`` whatever
    the planner, and each is applied here alone."""
    if choice == KEEP or not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if choice == OFFLOAD:
        assert offload_hooks is not None, "an OFFLOAD block needs the hooks that move its saved tensors"
        with offload_hooks():
            return forward(*args, **kwargs)
    if choice in PARTIAL_LEVELS:
        assert keep is not None, "a partial checkpoint needs how many heavy outputs it keeps"
        choice = SELECTIVE
    return run_checkpointed(forward, args, kwargs, clock, choice, keep)


# The keyword arguments Hugging Face's GradientCheckpointingLayer clears when it checkpoints
# (transformers/modeling_layers.py: ``cache`` in 5.x, ``past_key_value(s)`` in 4.x, ``layer_past``).
_CACHE_KWARGS = ("cache", "past_key_value", "past_key_values", "layer_past")


def training_kwargs(module: nn.Module, kwargs: dict) -> dict:
    """``kwargs`` as a ``GradientCheckpointingLayer`` passes them on when it checkpoints in
    training: ``use_cache`` off and, unless the layer only reads its cache
    (``_can_checkpoint_with_cache``), no cache. Other blocks' ``kwargs`` are returned as given."""
    if not (_is_hf_checkpoint_layer(module) and module.training and torch.is_grad_enabled()):
        return kwargs
    kwargs = dict(kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    if not getattr(module, "_can_checkpoint_with_cache", False):
        kwargs.update({name: None for name in _CACHE_KWARGS if kwargs.get(name) is not None})
    return kwargs


class BlockRunner:
    """Runs every block call of a step (``run``), between ``begin(info, inputs)`` and ``end(info)``
    (or ``abort()`` when the step raised); ``inputs`` is the step's batch when known. ``end`` returns what the runner measured (a collector's
    sample) or None, and may fill in the step's ``StepInfo`` (DTR: what it evicted)."""

    active = False
    runs_compiled = False
    """Whether it runs compiled blocks compiled (``compiled.CompiledBlocks``): only the plan
    runner; a runner that measures or evicts (Mimose's collector, its probes, DTR) hooks into the
    block's ops, which Dynamo would trace into the graph, so it gets the eager forward."""

    def begin(self, info, inputs=None) -> None:
        self.active = True

    def run(self, index: int, forward, args, kwargs):
        raise NotImplementedError

    def end(self, info):
        self.active = False
        return None

    def abort(self) -> None:
        self.active = False


class PlanRunner(BlockRunner):
    """Checkpoints the blocks of the current plan (``use``), in training; runs the others as they
    are, and nothing under ``no_grad``. It runs only while the planner applies a plan (a step, a
    probe: ``StepRouter.using``); between steps the blocks run as they are. A ``clock`` times
    recomputation in backward."""

    runs_compiled = True

    def __init__(self, clock: RecomputeClock | None = None, offload_hooks_for_plan=None):
        self.clock = clock
        self.plan: tuple = ()
        """The plan in force: one of ``CHOICES`` per block (a block past its end is kept)."""
        self._offload_hooks_for_plan = offload_hooks_for_plan
        """Called once for each plan that offloads: returns what makes the
        ``memory.offload.OffloadHooks`` of one offloaded block's call."""
        self.offload_hooks = None
        """What makes one offloaded block call's hooks, for the plan in force (None: none offloads)."""
        self.selective_keep: dict = {}
        """Per block, how many compute-heavy outputs a selective checkpoint of it keeps: those its
        recompute takes back, as the probes counted them (``scaling.selective_keeps``); a block not
        in it keeps them all."""
        self.partial_keep: dict = {}
        """Per block, how many compute-heavy outputs each partial level keeps, ``{level: count}``
        (``scaling.partial_prefixes``); a block not in it has none."""
        self.compiled_blocks = False
        """Whether the blocks run compiled (``compiled.CompiledBlocks``): no selective or partial
        checkpoint then, whose policy watches each op run."""

    def checked(self, plan, num_blocks: int) -> tuple:
        """``plan`` as a tuple, or ValueError in one line where it is not one of ``CHOICES`` per
        block (``blocks.check_plan``), takes a partial level the probes found no outputs for, or
        checkpoints compiled blocks selectively (``compiled.refuse_selective_plan``)."""
        plan = check_plan(plan, num_blocks)
        if self.compiled_blocks:
            refuse_selective_plan(plan)
        missing = [(i, choice) for i, choice in enumerate(plan)
                   if choice in PARTIAL_LEVELS and choice not in self.partial_keep.get(i, {})]
        if missing:
            raise ValueError(f"plan {plan} checkpoints blocks {missing} partially, but the probes found no such "
                             "level for them: choose selective or recompute there")
        return plan

    def use(self, plan) -> None:
        """Put a plan in force, as its callers checked it (``checked``: ``PlannerParts.set_plan``,
        ``Planner``'s decisions)."""
        self.plan = tuple(plan)
        offloads = OFFLOAD in self.plan and self._offload_hooks_for_plan is not None
        self.offload_hooks = self._offload_hooks_for_plan() if offloads else None

    def choice(self, index: int) -> str:
        """What the plan in force does with block ``index`` (``CHOICES``)."""
        return self.plan[index] if index < len(self.plan) else KEEP

    def begin(self, info, inputs=None) -> None:
        super().begin(info)
        self.use(info.plan)

    def run(self, index, forward, args, kwargs):
        choice = self.choice(index)
        keep = self.partial_keep[index][choice] if choice in PARTIAL_LEVELS else self.selective_keep.get(index)
        return run_block(choice, forward, args, kwargs, self.clock, self.offload_hooks, keep)


class StepRouter:
    """Which runner runs the blocks: the one ``using`` put in force (a step's, a probe's; the
    innermost where they nest), so that precedence is where the runner is put in force, not in a
    rule here. Outside, every block runs as it is: no plan, no cost. It owns the one hook into the
    model's blocks (``BlockRouter``). The blocks hold it, and it holds its ``owner`` (the planner):
    a planner dropped without ``close()`` stays attached to the model while its hooks are in the
    blocks, so another is refused (``usage.claim``) rather than stacked on them."""

    def __init__(self, blocks: list, owner=None, compiled=None):
        self.owner = owner
        self._in_force: list = []
        self._hooks = BlockRouter(blocks, self._route, compiled)

    @contextlib.contextmanager
    def using(self, runner: "BlockRunner"):
        """Run the blocks called inside with ``runner``."""
        self._in_force.append(runner)
        try:
            yield runner
        finally:
            popped = self._in_force.pop()
            assert popped is runner, "runners put in force must leave in the reverse order"

    def _route(self, index, forward, args, kwargs):
        if self._in_force:
            runner = self._in_force[-1]
            if not getattr(runner, "runs_compiled", False):  # a runner of its own (sublinear's profiler): eager
                forward = getattr(forward, "eager", forward)
            return runner.run(index, forward, args, kwargs)
        return forward(*args, **kwargs)

    def remove(self) -> None:
        """Give the blocks their own forwards back."""
        self._hooks.remove()


class BlockRouter:
    """Replaces each block's ``forward`` with ``route(index, forward, args, kwargs)``
    (``RoutedForward``).

    The one hook point for every planner (``StepRouter`` hands each call to the runner in force). ``remove()`` restores the original forwards.

    In training, a Hugging Face layer gets the keyword arguments it would get under Hugging
    Face's own checkpointing (``training_kwargs``), whatever the runner: a block that appends to a
    key/value cache cannot be run twice (the collector) or recomputed, and a cache the step never
    reads would make the blocks' memory differ between the runs the planners compare. The
    ``forward`` a runner gets leaves the block's buffers as they were when a checkpoint recomputes
    it (``_buffers_kept_in_recompute``); with ``compiled`` (``compiled.CompiledBlocks``) it runs
    the block's compiled forward.
    """

    def __init__(self, blocks: list, route, compiled=None):
        self.blocks = blocks
        for index, (_, module) in enumerate(blocks):
            module.forward = RoutedForward(index, module, module.forward, route, compiled)

    def remove(self) -> None:
        for _, module in self.blocks:
            if "forward" in module.__dict__:
                del module.forward


class RoutedForward:
    """A block's ``forward`` while a planner is attached: each call goes to the planner's
    ``route``.

    It is an attribute of the block, so ``copy.deepcopy`` and ``pickle`` (``torch.save``) of the
    model meet it, and its route belongs to this block and this planner alone: a copy routed
    through it would run the original block's forward, with the original's weights, its backward
    filling the original's gradients. So a copy takes ``plain``, the forward the block had before
    the planner attached, copied along with the block (a bound method: the copy's own ``forward``
    bound to the copy). A deep copy or a saved model is the plain model, planned by nothing; the
    planner stays attached to the original. Deciding it here, on the one object the planner puts
    in a block, covers every copy of the model, of one block, and pickle, with nothing to undo
    when the planner closes.
    """

    def __init__(self, index: int, module: nn.Module, plain, route, compiled=None):
        self._index, self._module, self._route = index, module, route
        self._plain = plain
        # Compiled blocks (``compiled.CompiledBlocks``): the block's own forward is what is
        # compiled, so that the checkpoint and this router stay outside Dynamo's graph.
        self._forward = _buffers_kept_in_recompute(module, plain)
        if compiled is not None:
            eager = self._forward
            self._forward = _buffers_kept_in_recompute(module, compiled.forward_for(module, plain))
            self._forward.eager = eager  # for the runners that measure (``BlockRunner.runs_compiled``)

    def __call__(self, *args, **kwargs):
        return self._route(self._index, self._forward, args, training_kwargs(self._module, kwargs))

    def __deepcopy__(self, memo):
        return copy.deepcopy(self._plain, memo)

    def __reduce_ex__(self, protocol):
        return self._plain.__reduce_ex__(protocol)
