"""The applier: finding checkpointable blocks, and the one place that runs them differently.

``StepRouter`` (through ``BlockRouter``, which replaces each block's ``forward``) hands every call
to the ``BlockRunner`` in force: ``PlanRunner`` (every planner's default) checkpoints the blocks
in the plan; a planner that measures (Mimose's collector, Sublinear's profiler) or evicts (DTR)
puts its own runner in force (``Policy.runner_for``, ``StepRouter.using``).
"""

import contextlib
import fnmatch
import functools
import math
import time

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, get_device_states, set_device_states

from mimose_cli.planners.features import PARTIAL_LEVELS
from mimose_cli.torch_private import top_saved_tensors_hook_name, tree_leaves


@functools.cache  # asked at every block call: a failed import is not cached by Python
def _hf_checkpoint_layer_type():
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # older transformers: fall back to the ModuleList rule
        return None
    return GradientCheckpointingLayer


def _is_hf_checkpoint_layer(module: nn.Module) -> bool:
    layer_type = _hf_checkpoint_layer_type()
    return layer_type is not None and isinstance(module, layer_type)


def _outermost(named: list) -> list:
    """Drop modules nested inside another selected module (a block is never inside a block)."""
    names = [n for n, _ in named]
    return [(n, m) for n, m in named if not any(n.startswith(o + ".") for o in names if o != n)]


def _units_like(model: nn.Module, unit: type) -> list:
    """Every child of class ``unit`` of the model's ``ModuleList``s and ``Sequential``s, in forward
    (registration) order, outermost (a list of one such child counts too)."""
    found, seen = [], set()
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            prefix = f"{name}." if name else ""
            for i, child in enumerate(module):
                if type(child) is unit and id(child) not in seen:  # a module in two lists: one block
                    seen.add(id(child))
                    found.append((f"{prefix}{i}", child))
    return _outermost(found)


def _repeated_unit(model: nn.Module) -> list:
    """The layers of the model's most repeated unit. Candidates are the classes the model's
    homogeneous ``ModuleList``/``Sequential``s hold (two or more children of one class). A class is
    a part of another candidate's unit, not a unit, when every instance of that other holds the
    same number of it, or some hold none (the q/k/v projections of a stack's layers, the experts of
    its every layer or every other one, the convolutions of a residual block); of the rest, the one
    with the most layers in all of its lists wins, a tie going to the inner class. So a ResNet's or
    a ConvNeXt's stages, whose depths differ, give way to the layers inside them, every stage's;
    stages of equal depth stay the blocks (name the layers with ``model.blocks`` to go finer)."""
    kinds = []  # the classes homogeneous lists hold, in the order met
    for _, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
            held = {type(child) for child in module}
            if len(held) == 1 and next(iter(held)) not in kinds:
                kinds.append(next(iter(held)))
    units = {kind: _units_like(model, kind) for kind in kinds}

    def within(kind, outer) -> list:  # how many of ``kind`` each ``outer`` holds
        return [sum(name.startswith(o + ".") for name, _ in units[kind]) for o, _ in units[outer]]

    def part_of(kind, outer) -> bool:
        counts = within(kind, outer)
        return outer is not kind and any(counts) and (len(set(counts)) == 1 or 0 in counts)

    kinds = [k for k in kinds if not any(part_of(k, outer) for outer in units)]
    if not kinds:
        return []
    most = max(len(units[k]) for k in kinds)
    tied = [k for k in kinds if len(units[k]) == most]
    unit = next((k for k in tied if any(outer is not k and any(within(k, outer)) for outer in tied)), tied[0])
    return units[unit]


def discover_blocks(model: nn.Module, pattern: str | list | None = None) -> list:
    """Return ``[(name, module), ...]`` in forward order.

    A glob ``pattern`` over module names (or a list of globs: modules any of them matches) wins;
    else Hugging Face ``GradientCheckpointingLayer``s; else the layers of the model's most repeated
    unit (``_repeated_unit``: a stack's layers, every stage's layers of a CNN).
    """
    if pattern:
        globs = [pattern] if isinstance(pattern, str) else list(pattern)
        for glob in globs:
            if not any(n and fnmatch.fnmatchcase(n, glob) for n, _ in model.named_modules()):
                raise ValueError(
                    f"blocks={glob!r} (model.blocks in a recipe) matches no module; module names look like "
                    f"{[n for n, _ in list(model.named_modules())[1:6]]}"
                )
        return _outermost([(n, m) for n, m in model.named_modules()
                           if n and any(fnmatch.fnmatchcase(n, glob) for glob in globs)])
    found = _outermost([(n, m) for n, m in model.named_modules() if _is_hf_checkpoint_layer(m)])
    if found:
        return found
    found = _repeated_unit(model)
    if not found:
        raise ValueError(
            "no checkpointable blocks found (no GradientCheckpointingLayer and no homogeneous "
            "ModuleList); name them with a glob over module names, blocks='encoder.layer.*' "
            "(model.blocks in a recipe)"
        )
    return found


def twin_blocks(blocks: list, first_leads: bool = True) -> dict:
    """``{block index: index of an earlier block like it}``: blocks of the same class with the same
    parameters and buffers (names, shapes, dtypes, whether they need gradients), the layers of a
    homogeneous stack. Each group's first block stands for the later ones; with ``first_leads``
    off its second does and the first is left on its own, for a stack whose first layer runs
    otherwise (its input needs no gradient: frozen embeddings, a LoRA model; the plain probe step
    sees that, ``collector.InputReleases.input_grads``). Alike in these, blocks usually run the
    same ops on the same bytes; whoever relies on it checks it (``planners.scaling``)."""
    groups: dict = {}
    for index, (_, module) in enumerate(blocks):
        signature = (type(module),
                     tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()),
                     tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers()))
        groups.setdefault(signature, []).append(index)
    lead = 0 if first_leads else 1
    return {index: group[lead] for group in groups.values() for index in group[lead + 1:]}


def alike_mean(values, twins: dict) -> np.ndarray:
    """``values`` per block with each group of alike blocks (``twin_blocks``: the layers of a
    stack, which run the same ops on the same bytes) given the group's mean: one step's timing
    noise between them averaged out, so that which of them a plan takes follows their order, not
    which happened to time fastest."""
    values = np.asarray(values, dtype=float)
    lead = np.array([twins.get(i, i) for i in range(len(values))])
    return np.array([values[lead == lead[i]].mean() for i in range(len(values))])


def first_runs_otherwise(twins: dict, input_grads: dict) -> str | None:
    """Why a group's first block cannot stand for the others (``twin_blocks``): its tensor inputs
    need gradients otherwise than its first twin's, as a plain probe step saw them
    (``input_grads``: block -> whether each tensor input needed one); None where none differs."""
    firsts = {}
    for index, leader in sorted(twins.items()):
        firsts.setdefault(leader, index)
    for leader, first in firsts.items():
        if leader in input_grads and first in input_grads and input_grads[leader] != input_grads[first]:
            return f"block {leader}'s inputs need gradients otherwise than block {first}'s"
    return None


def _settings(module: nn.Module) -> list:
    """The plain attributes (numbers, strings, flags, tuples of them) of ``module`` and of every
    module inside it, by name, but those that number a layer's place (``layer_idx``, ``index``,
    ``*_id``): what makes blocks alike in parameters run otherwise (``attention_type``, a
    ``sliding_window``, ``is_causal``)."""
    plain = (bool, int, float, str, type(None))

    def usable(name, value):
        if name.endswith(("idx", "index", "_id")) or name.startswith("__"):
            return False
        return isinstance(value, plain) or (isinstance(value, tuple) and all(isinstance(v, plain) for v in value))

    return [(prefix, sorted((k, v) for k, v in vars(sub).items() if usable(k, v)))
            for prefix, sub in module.named_modules()]


def _hooks(module: nn.Module) -> list:
    """How many forward, forward-pre, backward and backward-pre hooks each module inside
    ``module`` has: code that runs with a layer and may keep what it sees."""
    return [(prefix, len(sub._forward_hooks), len(sub._forward_pre_hooks), len(sub._backward_hooks),
             len(sub._backward_pre_hooks)) for prefix, sub in module.named_modules()]


def stack_runs(blocks: list, twins: dict) -> tuple:
    """Runs of a stack's layers a probe step may leave out, ``[(template, (skipped, ...))]``,
    and why a group of layers alike was not left out (or ""). In each group of blocks alike
    (``twin_blocks``: the block that stands for them and its twins), the layers between the first
    twin (the template) and the group's last are left out when they follow one another in forward
    (index) order in the list that holds the template and the last, with the template's settings
    (``_settings``) and hooks; the template, run as the left-out layers would be (without a
    measuring run), stands for them (``planners.scaling``), and the group's leader and last, which
    may run otherwise (the ends of a stack), still run. None are left out where too few would be
    to pay for the probe step that checks them (a stack of 5)."""
    groups: dict = {}
    for index, leader in sorted(twins.items()):
        groups.setdefault(leader, []).append(index)
    runs, reasons = [], []
    for members in groups.values():
        if len(members) < 3:
            continue
        template, skipped, last = members[0], tuple(members[1:-1]), members[-1]
        if list(range(template, last + 1)) != [template, *skipped, last]:
            reasons.append(f"blocks {template}..{last} alike are not one after another")
            continue
        parents = {blocks[i][0].rpartition(".")[0] for i in (template, *skipped, last)}
        if len(parents) != 1:
            reasons.append(f"blocks {template}..{last} alike are not in one list")
            continue
        settings, hooks = _settings(blocks[template][1]), _hooks(blocks[template][1])
        differs = next((i for i in skipped if _settings(blocks[i][1]) != settings), None)
        if differs is not None:
            reasons.append(f"block {differs} is set up otherwise than block {template}, which has the same parameters")
            continue
        hooked = next((i for i in skipped if _hooks(blocks[i][1]) != hooks), None)
        if hooked is not None:
            reasons.append(f"block {hooked} has other hooks than block {template}, which has the same parameters")
            continue
        runs.append((template, skipped))
    left = sum(len(skipped) for _, skipped in runs)
    # Two probe steps with ``left`` layers fewer, and one more step to check them, cost less than
    # two with every layer when 3 * left > the blocks + 2 (the embeddings and head about one more).
    if runs and 3 * left <= len(blocks) + 2:
        return [], "; ".join([*reasons, f"leaving {left} of {len(blocks)} layers out would not pay for the step that checks it"])
    return runs, "; ".join(reasons)


@contextlib.contextmanager
def left_out(model: nn.Module, blocks: list, skipped) -> None:
    """The blocks ``skipped`` (indices into ``blocks``) taken out of the lists that hold them
    while the context runs, so that the model's loop over a list runs only the others; put back
    on exit. A ``ModuleList`` is renumbered from 0 meanwhile (it is indexed by position); a
    ``Sequential`` keeps the others' names."""
    skipped = set(skipped)
    containers: dict = {}
    for index in sorted(skipped):
        parent = blocks[index][0].rpartition(".")[0]
        container = model.get_submodule(parent) if parent else model
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"block {blocks[index][0]} is not in a ModuleList or Sequential")
        containers[id(container)] = container
    saved = [(container, container._modules) for container in containers.values()]
    gone = {id(blocks[i][1]) for i in skipped}
    try:
        for container, modules in saved:
            kept = [m for m in modules.values() if id(m) not in gone]
            container._modules = ({str(k): m for k, m in enumerate(kept)} if isinstance(container, nn.ModuleList)
                                  else {name: m for name, m in modules.items() if id(m) not in gone})
        yield
    finally:
        for container, modules in saved:
            container._modules = modules


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


def buffer_snapshot(module: nn.Module | None, only=None) -> list:
    """``(buffer, copy)`` for ``module``'s buffers (those ``only(buffer)`` accepts), for
    ``restore_buffers``."""
    if module is None:
        return []
    return [(b, b.detach().clone()) for b in module.buffers() if only is None or only(b)]


def restore_buffers(snapshot: list) -> None:
    """Put the buffers of a ``buffer_snapshot`` back as they were."""
    with torch.no_grad():
        for buffer, saved in snapshot:
            buffer.copy_(saved)


@contextlib.contextmanager
def restored_buffers(module):
    """Put ``module``'s buffers (BatchNorm statistics) back as they were on exit."""
    snapshot = buffer_snapshot(module)
    try:
        yield
    finally:
        restore_buffers(snapshot)


class RngState:
    """The CPU generator's state and that of each CUDA device given, to be put back with
    ``restore()`` (torch.utils.checkpoint's own device-state helpers)."""

    def __init__(self, devices=()):
        self.device_list = list(devices)
        cuda = [torch.empty(0, device=d) for d in self.device_list if torch.device(d).type == "cuda"]
        self.cpu = torch.get_rng_state()
        self.devices = get_device_states(*cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        set_device_states(*self.devices)


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


KEEP, SELECTIVE, RECOMPUTE, OFFLOAD = "keep", "selective", "recompute", "offload"
"""What a plan does with a block: keep every activation its backward needs; keep only what the
compute-heavy ops produce and recompute the rest in backward (``COMPUTE_HEAVY_OPS``, through
torch's selective activation checkpointing), or only what its first heavy ops produce
(``features.PARTIAL_LEVELS``, "partial1" keeping the most); keep only its inputs and recompute its
forward; or run it as it is with what autograd saves inside it held in host memory until backward
brings it back (``memory.offload``: no recompute, two copies)."""
CHOICES = (KEEP, SELECTIVE, *PARTIAL_LEVELS, RECOMPUTE, OFFLOAD)

_aten = torch.ops.aten
COMPUTE_HEAVY_OPS = frozenset(
    op for op in (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
                  _aten.convolution.default, _aten._scaled_dot_product_flash_attention.default,
                  _aten._scaled_dot_product_efficient_attention.default,
                  _aten._scaled_dot_product_cudnn_attention.default,
                  getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None) and
                  _aten._scaled_dot_product_flash_attention_for_cpu.default)
    if op is not None)
"""Ops whose outputs a ``selective`` block keeps: the matmuls, convolutions and fused attention
kernels (their recompute costs most per byte); pointwise ops, norms, softmax and dropout are
recomputed."""


LIGHT_OP_CLASSES = ("pointwise", "transcendental", "softmax", "random")
"""How fast an op other than a compute-heavy one writes its elements, by kind: arithmetic, copies
and norms (``pointwise``, the reference), activations built on exp, erf or tanh
(``transcendental``), a softmax, random numbers (dropout's mask). Their rates per element differ by
up to ten times on a CPU (a dropout's Bernoulli draw against an add), so a block's light work is
counted per kind (``light_op_class``) at each kind's rate (``choices.work_rates_ms``)."""
_LIGHT_CLASS = {
    **dict.fromkeys(("gelu", "silu", "tanh", "exp", "erf", "sigmoid", "log", "mish", "softplus", "elu",
                     "gelu_", "silu_", "tanh_", "exp_", "sigmoid_", "elu_"), "transcendental"),
    **dict.fromkeys(("_softmax", "_safe_softmax", "softmax", "_log_softmax", "log_softmax"), "softmax"),
    **dict.fromkeys(("bernoulli", "bernoulli_", "native_dropout", "rand", "rand_like", "uniform_", "normal_",
                     "randn", "randn_like"), "random"),
}


def light_op_class(func) -> str:
    """The kind (``LIGHT_OP_CLASSES``) of an op that is not compute-heavy, by its name."""
    return _LIGHT_CLASS.get(func.overloadpacket.__name__, "pointwise")


def heavy_op_work(func, args, out) -> tuple:
    """A compute-heavy op's work as ``(dims, factor, gemm)``: its floating-point operations are
    ``factor`` times the product of ``dims`` (its output's shape and the length each element is a
    sum over: a matmul's inner dimension, a convolution's input channels and kernel; an
    attention's key length and head dims, scores and values; a causal one does half), which grows
    with the input size as the op's time does where the output does not (attention times values:
    output ``B·L·d``, work ``B·L²·d``); ``gemm`` is the matmul it amounts to, ``(rows, inner, cols, dtype)``, None for
    an attention (whose inner length is the sequence's)."""
    first = out if isinstance(out, torch.Tensor) else next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    name = func.overloadpacket.__name__
    if name in ("mm", "bmm", "addmm", "baddbmm"):
        inner = (args[0] if name in ("mm", "bmm") else args[1]).shape[-1]
        rows = first.numel() // first.shape[-1]
        return (*first.shape, inner), 2, (rows, inner, first.shape[-1], first.dtype)
    if name == "convolution":
        source, weight = (args[0], args[1]) if args[6] else (first, args[1])  # transposed: per input
        channels = weight.shape[1] if args[6] else weight.shape[0]
        inner = math.prod(weight.shape[2:]) * (weight.shape[1] if not args[6] else weight.shape[0] // args[8])
        rows = source.numel() // source.shape[1]
        return (*source.shape, *weight.shape[1:]), 2, (rows, inner, channels, first.dtype)
    query, key, value = args[:3]  # fused attention: scores (E) and the weighted sum of values (Ev)
    position = _IS_CAUSAL_ARG.get(name)
    causal = position is not None and len(args) > position and bool(args[position])
    return (*first.shape[:-1], key.shape[-2], query.shape[-1] + value.shape[-1]), 1 if causal else 2, None


_IS_CAUSAL_ARG = {"_scaled_dot_product_flash_attention": 4, "_scaled_dot_product_flash_attention_for_cpu": 4,
                  "_scaled_dot_product_efficient_attention": 6, "_scaled_dot_product_cudnn_attention": 6}
"""Where each fused attention kernel takes ``is_causal``: a causal kernel skips the keys past each
query, half the scores (torch's flop counter counts them all; the kernels' time halves)."""


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


def selectable(blocks: list) -> list:
    """Whether each block may be checkpointed selectively: not when it holds buffers (BatchNorm
    statistics), whose restore before its recompute torch's selective checkpointing refuses."""
    return [next(block.buffers(), None) is None for _, block in blocks]


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

    def __init__(self, clock: RecomputeClock | None = None, offload_hooks_for_plan=None):
        self.clock = clock
        self.plan: tuple = ()
        self._plan_set: frozenset = frozenset()
        self.selective: frozenset = frozenset()
        """Blocks of the plan checkpointed selectively (``SELECTIVE``) rather than recomputed whole."""
        self.offload: frozenset = frozenset()
        """Blocks outside the plan offloaded (``OFFLOAD``) rather than kept."""
        self._offload_hooks_for_plan = offload_hooks_for_plan
        """Called once for each plan that offloads: returns what makes the
        ``memory.offload.OffloadHooks`` of one offloaded block's call."""
        self.offload_hooks = None
        """What makes one offloaded block call's hooks, for the plan in force (None: none offloads)."""
        self.selective_keep: dict = {}
        """Per block, how many compute-heavy outputs a selective checkpoint of it keeps: those its
        recompute takes back, as the probes counted them (``scaling.selective_keeps``); a block not
        in it keeps them all."""
        self.partial: dict = {}
        """Blocks of the plan checkpointed partially: ``{block: level}`` (``PARTIAL_LEVELS``)."""
        self.partial_keep: dict = {}
        """Per block, how many compute-heavy outputs each partial level keeps, ``{level: count}``
        (``scaling.partial_prefixes``); a block not in it has none."""

    def use(self, plan, selective=(), offload=(), partial=()) -> None:
        """Put a plan in force, its choices one per block as its callers checked them
        (``parts.check_choices``: ``PlannerParts.set_plan``, ``Planner``'s decisions)."""
        self.plan = tuple(sorted(plan))
        self._plan_set = frozenset(self.plan)
        self.selective = frozenset(selective)
        self.partial = dict(partial)
        missing = [(i, level) for i, level in self.partial.items() if level not in self.partial_keep.get(i, {})]
        if missing:
            raise ValueError(f"blocks {missing} cannot be checkpointed partially: the probes found no such level")
        self.offload = frozenset(offload)
        self.offload_hooks = self._offload_hooks_for_plan() if self.offload and self._offload_hooks_for_plan else None

    def choice(self, index: int) -> str:
        """What the plan in force does with block ``index`` (``CHOICES``)."""
        if index not in self._plan_set:
            return OFFLOAD if index in self.offload else KEEP
        return SELECTIVE if index in self.selective else self.partial.get(index, RECOMPUTE)

    def choices(self, num_blocks: int) -> tuple:
        """The plan in force as one choice per block."""
        return tuple(self.choice(i) for i in range(num_blocks))

    def begin(self, info, inputs=None) -> None:
        super().begin(info)
        self.use(info.plan, info.selective, info.offload, info.partial)

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

    def __init__(self, blocks: list, owner=None):
        self.owner = owner
        self._in_force: list = []
        self._hooks = BlockRouter(blocks, self._route)

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
            return self._in_force[-1].run(index, forward, args, kwargs)
        return forward(*args, **kwargs)

    def remove(self) -> None:
        """Give the blocks their own forwards back."""
        self._hooks.remove()


class BlockRouter:
    """Replaces each block's ``forward`` with ``route(index, forward, args, kwargs)``.

    The one hook point for every planner (``StepRouter`` hands each call to the runner in force). ``remove()`` restores the original forwards.

    In training, a Hugging Face layer gets the keyword arguments it would get under Hugging
    Face's own checkpointing (``training_kwargs``), whatever the runner: a block that appends to a
    key/value cache cannot be run twice (the collector) or recomputed, and a cache the step never
    reads would make the blocks' memory differ between the runs the planners compare. The
    ``forward`` a runner gets leaves the block's buffers as they were when a checkpoint recomputes
    it (``_buffers_kept_in_recompute``).
    """

    def __init__(self, blocks: list, route):
        self.blocks = blocks
        for index, (_, module) in enumerate(blocks):
            forward = _buffers_kept_in_recompute(module, module.forward)
            module.forward = functools.partial(self._call, index, module, forward, route)

    @staticmethod
    def _call(index, module, forward, route, *args, **kwargs):
        return route(index, forward, args, training_kwargs(module, kwargs))

    def remove(self) -> None:
        for _, module in self.blocks:
            if "forward" in module.__dict__:
                del module.forward
