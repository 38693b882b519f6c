"""Mimose's probe layout: which blocks are alike (``twin_blocks``), and the middle layers of a
long stack a probe step may leave out (``stack_runs``, ``left_out``)."""

import contextlib

import numpy as np
from torch import nn


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

