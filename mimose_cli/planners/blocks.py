"""Blocks: finding the modules a plan checkpoints as units, and what a plan may do with each
(``CHOICES``). The one place that runs them differently is ``planners.runners``."""

import fnmatch
import functools

from torch import nn

PARTIAL_LEVELS = ("partial1", "partial2", "partial3")
"""Partial selective checkpoints, "partial1" keeping the most: a selective checkpoint that keeps
only the first heavy ops' outputs (``runners.run_block``; which outputs, Mimose's probes find)."""


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


KEEP, SELECTIVE, RECOMPUTE, OFFLOAD = "keep", "selective", "recompute", "offload"
"""What a plan does with a block: keep every activation its backward needs; keep only what the
compute-heavy ops produce and recompute the rest in backward (``COMPUTE_HEAVY_OPS``, through
torch's selective activation checkpointing), or only what its first heavy ops produce
(``features.PARTIAL_LEVELS``, "partial1" keeping the most); keep only its inputs and recompute its
forward; or run it as it is with what autograd saves inside it held in host memory until backward
brings it back (``memory.offload``: no recompute, two copies)."""
CHOICES = (KEEP, SELECTIVE, *PARTIAL_LEVELS, RECOMPUTE, OFFLOAD)


def selectable(blocks: list) -> list:
    """Whether each block may be checkpointed selectively: not when it holds buffers (BatchNorm
    statistics), whose restore before its recompute torch's selective checkpointing refuses."""
    return [next(block.buffers(), None) is None for _, block in blocks]
