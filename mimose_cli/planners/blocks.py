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


# A plan: one entry of ``CHOICES`` per block, in block order, e.g. ("keep", "recompute",
# "selective", "partial2", "offload"). Plain tuples, so that a plan is its own JSON form.

CHECKPOINTED = (SELECTIVE, *PARTIAL_LEVELS, RECOMPUTE)
"""The choices that checkpoint a block (its backward recomputes some or all of its forward)."""
CHOICE_LEVEL = {choice: min(k, CHOICES.index(RECOMPUTE)) for k, choice in enumerate(CHOICES)}
"""Each choice's level, as Mimose's scheduler and timeline count them (``features.LEVELS``): by
what it frees, keep 0, selective 1, partial1-3 2-4, recompute 5, and offload 5 too (its bytes
bounded as recomputed)."""


def recomputed(blocks, num_blocks: int) -> tuple:
    """The plan recomputing the blocks at the indices ``blocks`` and keeping the others."""
    chosen = set(blocks)
    return tuple(RECOMPUTE if i in chosen else KEEP for i in range(num_blocks))


def recompute_first(k: int, num_blocks: int) -> tuple:
    """The plan recomputing the first ``k`` of ``num_blocks`` blocks and keeping the rest."""
    return (RECOMPUTE,) * k + (KEEP,) * (num_blocks - k)


def checkpointed(plan) -> tuple:
    """The indices of the blocks ``plan`` checkpoints (``CHECKPOINTED``: not kept, not offloaded)."""
    return tuple(i for i, choice in enumerate(plan) if choice in CHECKPOINTED)


def plan_levels(plan) -> list:
    """``plan``'s level per block (``CHOICE_LEVEL``)."""
    return [CHOICE_LEVEL[choice] for choice in plan]


def plan_of_levels(levels) -> tuple:
    """The plan of levels per block (``CHOICE_LEVEL``; the recompute level recomputes)."""
    return tuple(CHOICES[level] for level in levels)


def offloading(plan, offloaded) -> tuple:
    """``plan`` with the blocks it recomputes offloaded instead where ``offloaded`` (a mask over
    blocks) says so: the cheaper way of freeing them."""
    return tuple(OFFLOAD if choice == RECOMPUTE and off else choice for choice, off in zip(plan, offloaded))


def plan_of_fields(num_blocks: int, plan=(), selective=(), offload=(), partial=()) -> tuple:
    """The plan the previous release wrote as four fields (old ``metrics.jsonl``, ``plans.jsonl``
    and plan caches): ``plan`` the blocks checkpointed, ``selective`` those of them checkpointed
    selectively, ``partial`` ``[block, level]`` those checkpointed partially, ``offload`` blocks
    outside ``plan`` offloaded. Fields that disagree are read as that release's runner ran them: a
    block of ``plan`` is selective before partial and never offloaded, one outside it is never
    selective or partial."""
    in_plan, selective, offload, partial = set(plan), set(selective), set(offload), dict(partial)
    named = in_plan | selective | offload | set(partial)
    if any(not 0 <= i < num_blocks for i in named) or not set(partial.values()) <= set(PARTIAL_LEVELS):
        raise ValueError(f"plan {list(plan)} (selective {sorted(selective)}, offload {sorted(offload)}, partial "
                         f"{sorted(partial.items())}) names no plan of {num_blocks} blocks")

    def choice(i):
        if i not in in_plan:
            return OFFLOAD if i in offload else KEEP
        return SELECTIVE if i in selective else partial.get(i, RECOMPUTE)

    return tuple(choice(i) for i in range(num_blocks))


def check_plan(plan, num_blocks: int) -> tuple:
    """``plan`` as a tuple, or ValueError in one line where it is not one of ``CHOICES`` per block."""
    if isinstance(plan, str) or not isinstance(plan, (tuple, list)):
        raise ValueError(f"plan {plan!r} is not one choice per block: give a tuple such as "
                         f"{recompute_first(1, num_blocks)}")
    if len(plan) != num_blocks:
        raise ValueError(f"plan {tuple(plan)} has {len(plan)} choices for {num_blocks} blocks: give one per block")
    unknown = sorted({repr(choice) for choice in plan if choice not in CHOICES})
    if unknown:
        raise ValueError(f"plan {tuple(plan)} holds unknown choice(s) {', '.join(unknown)}: use {', '.join(CHOICES)}")
    return tuple(plan)
