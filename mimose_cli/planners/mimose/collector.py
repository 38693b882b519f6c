"""Mimose's shuttling online collector and its data filter.

During the sheltered phase every block runs twice: once plainly to measure it (the bytes
autograd saves, the live bytes it adds, its forward peak and time), then, after those outputs
are dropped, checkpointed, which is what the step keeps. Only block outputs stay resident, so
the sheltered phase fits wherever full checkpointing does, plus a copy of one block's
inputs while it is measured. The measuring run works on that copy and puts the block's buffers
back, and the RNG state is restored between the two runs, so the step computes exactly what an
unplanned step computes, even for a block that modifies an input in place or updates BatchNorm
statistics.

Live bytes come from a probe (``memory.probe.LiveProbe``, counting storages on the simulated
device's ledger) active only during measured steps. It records the live bytes after every op;
marks at block entries and at the gradient of every block output cut that trace into the
stretches the estimator fits: each block's forward (plain and checkpointed), its recompute and
backward, and the embeddings/head/tail around them. So it sees what saved-tensor hooks cannot:
the transient peaks, on any device.
"""

import contextlib
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from mimose_cli.memory import SavedBytesCounter, synchronize
from mimose_cli.memory.probe import LiveProbe
from mimose_cli.planners.mimose.features import BLOCK_QUANTITIES, KEPT_SETS, STEP_QUANTITIES, Releases, kept_quantities
from mimose_cli.planners.ops import COMPUTE_HEAVY_OPS, heavy_op_work, light_op_class
from mimose_cli.planners.runners import BlockRunner, inside_checkpoint, recomputing, run_checkpointed
from mimose_cli.planners.snapshots import RngState, restored_buffers
from mimose_cli.torch_private import autocast_enabled, fsdp_unsharded_params, tree_leaves, tree_map

OP_QUANTITIES = ("heavy_ms", "light_ms", "ops", "heavy_ops")
"""What a block's measuring run says of its ops (``RawStep.op_ms``)."""


def _op_counts(probe: LiveProbe) -> tuple:
    """The probe's running totals of ``OP_QUANTITIES``."""
    return probe.heavy_ms, probe.light_ms, len(probe.trace), probe.heavy_count


def drop_reason(name: str, checkpointed: set, parents: list, children: list, *,
                calls: int = 0, in_checkpoint: bool = False) -> str | None:
    """The data filter: why the sample of block ``name`` cannot be used, or None.

    The paper's three rules, over the module tree: a block is dropped when it was itself
    checkpointed while measured, when a parent (an enclosing module) was, or when a child (a
    module inside it) was; ``checkpointed`` holds the names of such modules (Hugging Face's
    ``gradient_checkpointing`` flag), and ``in_checkpoint`` says a checkpoint region was
    running when the block was entered (the block or a parent checkpointed by user code).
    It is also dropped when its memory cannot be attributed cleanly: the block ran more than
    once in the step (``calls``: shared weights, reentrant use). The collector adds two more
    such cases: the forward produced no tensor that needs a gradient (``no_grad_output``), or
    its measuring run did not fit the budget (``no_room``).
    """
    if in_checkpoint or name in checkpointed:
        return "checkpointed"
    if any(p in checkpointed for p in parents):
        return "parent_checkpointed"
    if any(c in checkpointed for c in children):
        return "child_checkpointed"
    if calls > 0:
        return "called_twice"
    return None


def _first_grad_tensor(value):
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if isinstance(value, (list, tuple)):
        return next((t for t in map(_first_grad_tensor, value) if t is not None), None)
    if isinstance(value, dict):
        return _first_grad_tensor(list(value.values()))
    return None


class _Copy(torch.autograd.Function):
    """A tensor with ``tensor``'s size, strides and offset on ``storage``, requiring grad as
    ``tensor`` does: a function's output, not a leaf, so a block may modify it in place."""

    @staticmethod
    def forward(ctx, tensor, storage):
        return tensor.new_empty(0).set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _copies(tree):
    """``tree`` with its tensors on copies of their storages, for the measuring run to modify in
    place if the block does. A storage is copied once and whole, and each tensor rebuilt on it,
    so the copies alias as the inputs do and hold the same bytes (an expanded mask stays
    expanded, a saved view counts its whole storage). Parameters (and other tensor subclasses)
    stay: the probe and the saved bytes counter leave parameters out by their storage."""
    storages = {}

    def copy(value):
        if type(value) is not torch.Tensor or value.layout is not torch.strided:
            return value
        storage = value.untyped_storage()
        if id(storage) not in storages:
            storages[id(storage)] = (storage, storage.clone())  # the original kept: ids stay unique
        return _Copy.apply(value, storages[id(storage)][1])

    return tree_map(copy, tree)


def _slot_bytes(inputs, slots) -> int:
    """The storage bytes of the tensor leaves of ``inputs`` at positions ``slots``, each storage once."""
    if not slots:
        return 0
    storages = {}
    for slot, leaf in enumerate(tree_leaves(inputs)):
        if slot in slots and isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            storages[id(storage)] = storage.nbytes()
    return sum(storages.values())


def _fresh_casts(forward):
    """``forward`` for the checkpointed run that follows a measuring run under autocast: it casts
    the weights afresh rather than taking the casts the measuring run left in autocast's cache.
    Those carry the measuring run's graph (each cast's backward node), which autograd orders
    before the checkpointed run's own nodes by creation, so the weights' gradients would be
    written at the end of the block's backward instead of op by op as in a planned step: the
    sample under-counted a checkpointed block's backward where weight gradients weigh most (0.4 %
    of a bf16 step of two rows). The recompute in backward runs as torch runs it."""
    def run(*args, **kwargs):
        if recomputing():
            return forward(*args, **kwargs)
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            return forward(*args, **kwargs)
        finally:
            torch.set_autocast_cache_enabled(cache)
    return run


class InputReleases(BlockRunner):
    """The runner of a plain probe step: sees which inputs of the blocks (tensors among their
    ``args`` and ``kwargs``, not the model's parameters or buffers) are freed between one block's
    call and the next block's, and which blocks took each (``end`` returns the ``Releases``). Run
    plainly under autocast, a layer saves the casts of its hidden state, not the state; an
    attention bias is added to the scores and not saved: once the model's loop moves on, nothing
    holds them, where a checkpoint would until its backward. What the model keeps (its
    embeddings' output in a local until the blocks return, hidden states it returns) is not
    freed and not counted as let go of; nor is what is freed after the last block's call (the
    head's forward may still hold it)."""

    def __init__(self, model, num_blocks: int):
        self.model = model
        self.num_blocks = num_blocks

    def begin(self, info=None, inputs=None) -> None:
        self.active = True
        tensors = [*self.model.parameters(), *self.model.buffers()]
        self.exclude = {id(t.untyped_storage()) for t in tensors if t.layout is torch.strided and not t.is_meta}
        self.pending: dict = {}  # id(storage) -> (weak reference, [(block, slot)])
        self.freed: list = []  # [(block, slot)] of each input freed between two block calls
        self.input_grads: dict = {}
        """Block -> whether each of its tensor inputs needed a gradient, at its first call: a
        stack's first layer whose input needs none (frozen embeddings) runs otherwise than the
        next (``blocks.first_runs_otherwise``)."""

    def run(self, index: int, forward, args, kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        self._settle()
        self._note(index, args, kwargs)
        return forward(*args, **kwargs)

    def _note(self, index: int, args, kwargs) -> None:
        leaves = tree_leaves((args, kwargs))
        self.input_grads.setdefault(index, tuple(leaf.requires_grad for leaf in leaves if isinstance(leaf, torch.Tensor)))
        for slot, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor) or leaf.layout is not torch.strided or leaf.is_meta:
                continue
            storage = leaf.untyped_storage()
            if id(storage) in self.exclude:
                continue
            ref, uses = self.pending.get(id(storage), (None, None))
            if ref is None or ref() is None:
                ref, uses = self.pending[id(storage)] = (weakref.ref(storage), [])
            uses.append((index, slot))

    def _settle(self) -> None:
        for key, (ref, uses) in list(self.pending.items()):
            if ref() is None:
                del self.pending[key]
                self.freed.append(uses)

    def end(self, info=None) -> Releases:
        self.active = False  # what is freed after the last block's call is not counted
        releases = Releases.none(self.num_blocks)
        for uses in self.freed:
            last = uses[-1][0]
            releases.consumers[last, [block for block, _ in uses]] = True
            releases.slots.setdefault(last, set()).update(slot for block, slot in uses if block == last)
        self.pending, self.freed = {}, []
        return releases


class ShuttlingCollector(BlockRunner):
    """The runner of a measured step: runs each block twice and turns the step's timeline into a
    sample (``end``)."""

    def __init__(self, model, blocks: list, clock=None):
        self.model = model
        self.clock = clock
        self.blocks = blocks
        names = [name for name, _ in blocks]
        modules = dict(model.named_modules())
        self.block_names = names
        self.parents = {i: [n for n in modules if n and name.startswith(n + ".")] for i, name in enumerate(names)}
        self.children = {i: [n for n in modules if n.startswith(name + ".")] for i, name in enumerate(names)}
        self.modules = modules
        self.collector_ms = 0.0
        self.active = False
        self.lifetimes = False
        """Whether the probe writes down storage lifetimes (``end`` then returns a ``RawStep``)."""
        self.releases = Releases.none(len(blocks))
        """The inputs a plain run lets go of (``InputReleases``): their bytes are measured."""
        self.twins: dict = {}
        """``{block: the earlier block like it}`` (``blocks.twin_blocks``) whose measuring run is
        skipped once that block was measured in the step: its forward quantities are taken as
        that block's (``build_sample``). Set for probe steps, whose scaling checks it holds."""

    def begin(self, info=None, inputs=None) -> None:
        """Start a measured step: the probe, the marks. The step's batch (``inputs``) is part of
        its start, as the weights are: not counted when an op aliases it (a saved-tensor hook's
        ``detach`` of the images a convolution saves)."""
        self.probe = LiveProbe(flag=recomputing, lifetimes=self.lifetimes, heavy_ops=COMPUTE_HEAVY_OPS,
                               heavy_work=heavy_op_work if self.lifetimes else None, light_class=light_op_class)
        # Gradients already live (accumulation in a loop of the user's) are not ignored: the
        # probe counts each when backward first writes into it, as if it were allocated then,
        # so samples with and without them agree.
        batch = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)] if inputs is not None else []
        self.probe.ignore([*self.model.parameters(), *self.model.buffers(), *batch])
        self.probe.__enter__()
        self.active = True  # from here on ``abort`` leaves the probe, also when the rest of begin raises
        # Which modules checkpoint themselves, and the weights' storages the saved-bytes
        # counter leaves out, are read once a step (every block's call asks).
        self.checkpointed = {n for n, m in self.modules.items() if getattr(m, "gradient_checkpointing", False) is True}
        # Under FSDP2 the weights a graph saves are the unsharded parameters the units gathered.
        self.counter = SavedBytesCounter(exclude=[*self.model.parameters(), *fsdp_unsharded_params(self.model)],
                                         pin=True)
        self.marks: list = []
        self.mark_points: list = []
        self.calls = [0] * len(self.blocks)
        self.order: list = []  # block indices in the order the forward entered them
        self.dropped: dict = {}
        self.twin_of: dict = {}  # the twins run without a measuring run this step
        self.fwd_ms = np.full(len(self.blocks), np.nan)
        self.saved = np.full(len(self.blocks), np.nan)
        self.resident = np.full(len(self.blocks), np.nan)
        self.release_bytes = np.full(len(self.blocks), np.nan)
        self.op_ms = {q: np.full(len(self.blocks), np.nan) for q in (*OP_QUANTITIES, "saved_storages")}
        self.op_works: dict = {}  # block -> its measuring run's ops' work (``LiveProbe.works``)

    def mark(self, label) -> None:
        self.marks.append((label, len(self.probe.trace), self.probe.live))
        self.mark_points.append(self.probe.point())

    def run(self, index: int, forward, args, kwargs):
        """Measure, drop, restore RNG, run checkpointed."""
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        reason = drop_reason(self.block_names[index], self.checkpointed,
                             self.parents[index], self.children[index],
                             calls=self.calls[index], in_checkpoint=inside_checkpoint())
        self.calls[index] += 1
        if index not in self.order:
            self.order.append(index)
        self.release_bytes[index] = _slot_bytes((args, kwargs), self.releases.slots.get(index, ()))
        if reason is not None:
            self.dropped[index] = reason
            if inside_checkpoint():
                return forward(*args, **kwargs)  # the enclosing checkpoint decides what is kept
            return self._checkpointed_only(index, forward, args, kwargs)  # its neighbours stay attributable
        twin = self.twins.get(index)
        # Under autocast a twin's checkpointed run casts its weights, its twin's did not (its
        # measuring run had): the two cannot be compared op for op, so the twin is measured.
        if (twin is not None and twin not in self.dropped and not np.isnan(self.saved[twin])
                and not autocast_enabled()):
            self.twin_of[index] = twin
            return self._checkpointed_only(index, forward, args, kwargs)
        return self._shuttle(index, forward, args, kwargs)

    def _checkpointed_only(self, index, forward, args, kwargs):
        """The block run checkpointed, without a measuring run, between its marks."""
        self.mark(("enter", index))
        out = run_checkpointed(forward, args, kwargs, self.clock)
        self.mark(("ckpt", index))
        self._hook_backward(index, args, out)
        return out

    def _shuttle(self, index, forward, args, kwargs):
        start = time.perf_counter()
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        self.mark(("enter", index))
        rng = RngState([device])
        usable = self._measure(index, forward, args, kwargs, device)
        # What the measuring run saved that outlives its graph is held by someone else: under
        # autocast, the cast weights its cache keeps until the forward ends, which a block run
        # plainly holds until its backward when its ops save them.
        self.resident[index] = self.counter.live_bytes()
        self.mark(("dropped", index))
        rng.restore()
        self.collector_ms += (time.perf_counter() - start) * 1e3
        out = run_checkpointed(_fresh_casts(forward) if autocast_enabled() else forward, args, kwargs, self.clock)
        self.mark(("ckpt", index))
        if not usable:
            self.dropped.setdefault(index, "no_grad_output")
        self._hook_backward(index, args, out)
        return out

    def _measure(self, index, forward, args, kwargs, device) -> bool:
        """The measuring run: its time, saved bytes and ``plain`` mark. It runs on copies of the
        inputs and the block's buffers are put back afterwards, so that the run the step keeps
        sees what a plain step's block sees (an input the block modifies in place, BatchNorm
        statistics); its outputs are dropped. Returns whether an output needs a gradient (the
        sample is usable).

        Running a block plainly needs more memory than checkpointing it, so the measuring run
        may not fit a budget that full checkpointing holds: then the block is left unmeasured
        at this size (``no_room``, no ``plain`` mark) and the step goes on checkpointed."""
        with contextlib.ExitStack() as stack:
            # The copies and the snapshot are the collector's, not the block's: the probe does
            # not count them, so the block's bytes are still measured from the level at its
            # entry; a copy has its input's storage size, so a saved input counts as before.
            try:
                with self.probe.uncounted():
                    stack.enter_context(restored_buffers(self.blocks[index][1]))
                    args, kwargs = _copies((args, kwargs))
                self.counter.reset()
                synchronize(device)
                begin = time.perf_counter()
                before, works = _op_counts(self.probe), len(self.probe.works)
                with self.counter:
                    out = forward(*args, **kwargs)
            except torch.OutOfMemoryError:
                self.dropped[index] = "no_room"
                return False
            synchronize(device)
            self.fwd_ms[index] = (time.perf_counter() - begin) * 1e3
            for quantity, value, then in zip(OP_QUANTITIES, _op_counts(self.probe), before):
                self.op_ms[quantity][index] = value - then
            self.op_works[index] = self.probe.works[works:]
            self.saved[index] = self.counter.bytes
            self.op_ms["saved_storages"][index] = self.counter.storages
            self.mark(("plain", index))
            return _first_grad_tensor(out) is not None

    def _hook_backward(self, index: int, args, out) -> None:
        """Mark the start of this block's backward (its output's gradient) and, for the block
        the forward ran first, the end of it (its input's gradient)."""
        output = _first_grad_tensor(out)
        if output is None:
            self.dropped[index] = "no_grad_output"
            return
        output.register_hook(self._backward_hook(("bwd", index)))
        if self.order[:1] == [index]:  # the first block run: its input's gradient ends backward
            first = _first_grad_tensor(args)
            if first is not None:
                first.register_hook(self._backward_hook(("bwd_end",)))

    def _backward_hook(self, label):
        def hook(grad):
            if self.active:
                self.mark(label)
        return hook

    def end(self, info=None):
        """Close the step; returns ``(blocks, step, shape)`` for the estimator (see
        ``build_sample``), or None when no block could be measured; with ``lifetimes`` the
        step's ``RawStep`` instead (``planners.scaling`` turns two of them into samples)."""
        self.mark(("end",))
        self.active = False
        probe, self.probe = self.probe, None
        probe.__exit__(None, None, None)
        if len(self.dropped) == len(self.blocks) or not self.marks:
            return None
        trace = Trace(np.array(probe.trace, dtype=float), np.array(probe.flags, dtype=bool),
                      np.array(probe.autocast, dtype=bool))
        per_block = {"saved_bytes": self.saved, "fwd_ms": self.fwd_ms, "resident_bytes": self.resident,
                     "release_bytes": self.release_bytes}
        if probe.lifetimes:  # the step began with lifetimes on (they may be off again by now)
            ledger = probe.ledger
            died = [probe.points if d is None else d for d in ledger.died]
            return RawStep(list(self.marks), np.array(self.mark_points, dtype=np.int64), trace,
                           np.array(probe.op_points, dtype=np.int64), per_block, dict(self.dropped),
                           np.array(ledger.nbytes, dtype=float), np.array(ledger.born, dtype=np.int64),
                           np.array(died, dtype=np.int64), probe.points, list(ledger.shapes),
                           dict(self.twin_of), np.array(ledger.heavy, dtype=bool), dict(self.op_ms),
                           dict(self.op_works), np.isin(np.arange(len(died)), sorted(ledger.comm)))
        return build_sample(self.marks, trace, len(self.blocks), per_block, self.dropped, self.twin_of)

    def abort(self) -> None:
        """The step raised (out of memory): leave the probe, keep nothing."""
        if self.active:
            self.active = False
            probe, self.probe = self.probe, None
            probe.__exit__(None, None, None)


@dataclass
class Trace:
    """One sheltered step's live bytes after each op, which ops were recomputes, and which ran
    while training's autocast context was open (its cast weights cached; the head's backward
    starts after it closes).

    Parameter gradients allocated in backward stay in the values: the fit takes them as part of
    the step, which holds as long as the loop frees (or keeps) gradients the same way at every
    step; gradients already allocated at a step's start count twice, over- not under-predicting.
    """

    live: np.ndarray
    recompute: np.ndarray
    autocast: np.ndarray

    def ops(self, start: int, stop: int, reference: float, recompute=None, autocast=None):
        """Live bytes of ops ``start..stop-1`` above ``reference``, only the recomputes (or
        not) and only those under autocast (or not) when asked; None when there is no op."""
        values = self.live[start:stop] - reference
        keep = np.ones(len(values), dtype=bool)
        if recompute is not None:
            keep &= self.recompute[start:stop] == recompute
        if autocast is not None:
            keep &= self.autocast[start:stop] == autocast
        values = values[keep]
        return values if len(values) else None


@dataclass
class RawStep:
    """A measured step before it becomes a sample: the marks and the trace ``build_sample``
    takes, where each mark and each op sits in the sequence of points (``mark_points``,
    ``op_points``), and every counted storage's bytes and the points it lived in,
    ``born <= point < died``."""

    marks: list
    mark_points: np.ndarray
    trace: Trace
    op_points: np.ndarray
    per_block: dict
    dropped: dict
    nbytes: np.ndarray
    born: np.ndarray
    died: np.ndarray
    points: int
    shapes: list
    """Each storage's first tensor: ``(shape, element size)``, or None."""
    twins: dict
    """The blocks run without a measuring run, ``{block: the block like it}``."""
    heavy: np.ndarray | None = None
    """Whether each storage was first seen as a compute-heavy op's output
    (``blocks.COMPUTE_HEAVY_OPS``): what a selective checkpoint keeps (``scaling.selective_bytes``)."""
    op_ms: dict = field(default_factory=dict)
    """Per block, of its measuring run (``OP_QUANTITIES``): the ms inside compute-heavy ops
    (``heavy_ms``) and inside the others (``light_ms``), and how many ops it ran (``ops``,
    ``heavy_ops`` of them heavy), and the storages it saved (``saved_storages``: an offload's
    copies); NaN for blocks not measured."""
    op_works: dict = field(default_factory=dict)
    """``{block: [(heavy, dims, factor, gemm)]}``: the work of each op of its measuring run
    (``LiveProbe.works``; with ``lifetimes``)."""
    comm: np.ndarray | None = None
    """Whether each storage was a collective's buffer (``memory.probe._LifetimeLedger.comm``):
    FSDP's, whose death point varies from run to run (``scaling.settled``)."""


@dataclass
class StepShape:
    """How a sheltered step ran its blocks: ``order`` the block indices in forward order, and
    whether backward ran them in exactly the reverse of it (``backward_reversed``). Only then is
    a block's backward known to see just the blocks before it still holding their activations;
    otherwise its backward is measured and predicted above everything the forward held
    (an upper bound)."""

    order: tuple
    backward_reversed: bool


def build_sample(marks: list, trace: Trace, num_blocks: int, per_block: dict, dropped: dict,
                 twins: dict | None = None):
    """Per-block and step quantities (``{quantity: [array | None per block]}``, ``{quantity:
    array | None}``) and the step's ``StepShape`` from one step's marks ``(label, op index,
    live bytes)``. Dropped blocks and stretches a missing mark leaves unattributable are None;
    the shape is None when not every block ran. A block of ``twins`` ran only checkpointed: what
    its plain run would hold and peak at (above its entry) is its twin's."""
    twins = twins or {}
    per_block = dict(per_block)
    extras = {kept_set: per_block.pop(f"{kept_set}_extra_bytes", None) for kept_set in KEPT_SETS}
    # What a selective checkpoint holds beyond a full one after each op (``scaling.selective_bytes``).
    selective_more = {}
    for kept_set in KEPT_SETS:
        _, fwd, recompute, bwd = kept_quantities(kept_set)
        for base, q, name in (("ckpt_fwd_peak_bytes", fwd, "fwd_kept"), ("recompute_peak_bytes", recompute,
                              "recompute_pending"), ("bwd_peak_bytes", bwd, "bwd_pending")):
            selective_more[(base, q)] = per_block.pop(f"{kept_set}_{name}", None)
    at = {label: (index, live) for label, index, live in marks}
    blocks = {q: [None] * num_blocks for q in BLOCK_QUANTITIES}
    step = {q: None for q in STEP_QUANTITIES}
    order = []
    for label, _, _ in marks:
        if label[0] == "enter" and label[1] not in order:
            order.append(label[1])
    if len(order) != num_blocks or ("ckpt", order[-1]) not in at:
        return blocks, step, None
    entry = {i: at[("enter", i)][1] for i in order}
    after = dict(zip(order, [entry[i] for i in order[1:]] + [at[("ckpt", order[-1])][1]]))
    step["pre_bytes"] = np.array([entry[order[0]]])
    # No op before the first block (the model starts with a block): measured, and no event.
    step["pre_peak_bytes"] = trace.ops(0, at[("enter", order[0])][0], 0.0)
    if step["pre_peak_bytes"] is None:
        step["pre_peak_bytes"] = np.array([])
    for position, i in sorted(enumerate(order), key=lambda item: item[1] in twins):  # twins last
        following = order[position + 1] if position + 1 < num_blocks else None
        if i in twins and i not in dropped:
            _twin_forward(blocks, i, twins[i], at, entry[i], after[i], trace)
            blocks["release_bytes"][i] = np.array([per_block["release_bytes"][i]])
        elif i not in dropped:
            _block_forward(blocks, i, at, entry[i], after[i], trace, per_block)
        if following is not None and blocks["ckpt_bytes"][i] is not None and ("enter", following) in at:
            blocks["gap_peak_bytes"][following] = trace.ops(at[("ckpt", i)][0], *at[("enter", following)])
    for kept_set, extra in extras.items():  # a selective checkpoint also holds compute-heavy ops' outputs
        for i, ckpt in enumerate(blocks["ckpt_bytes"] if extra is not None else ()):
            if ckpt is not None and not np.isnan(extra[i]):
                blocks[f"{kept_set}_extra_bytes"][i] = np.array([extra[i]])
    shape = StepShape(tuple(order), _backward_order(marks) == order[::-1])
    _block_backward(blocks, step, at, entry, marks, trace, shape, dropped)
    for (base, q), more in selective_more.items():  # the same ops, holding the kept outputs too
        for i, peaks in enumerate(blocks[base] if more is not None else ()):
            if peaks is not None and more[i] is not None and len(more[i]) == len(peaks):
                blocks[q][i] = peaks + more[i]
    return blocks, step, shape


def _backward_order(marks: list) -> list:
    return [label[1] for label, _, _ in marks if label[0] == "bwd"]


def _block_forward(blocks: dict, i: int, at: dict, entry: float, after: float, trace: Trace,
                   per_block: dict) -> None:
    """The block's forward quantities; ``per_block`` holds what the collector measured
    directly (saved bytes, forward ms, resident bytes), an array over blocks each."""
    enter, plain, dropped, ckpt = (at.get((kind, i)) for kind in ("enter", "plain", "dropped", "ckpt"))
    if None in (enter, plain, dropped, ckpt):
        return  # a mark is missing
    # Bytes still live once the measuring run's outputs are dropped (autocast's cast copies of
    # the weights, kept until the forward ends) count as the block's in both runs: the plain
    # run minus the checkpointed run is what checkpointing frees, whatever stayed behind.
    ckpt_bytes = after - entry
    for quantity, values in per_block.items():
        blocks[quantity][i] = np.array([values[i]])
    blocks["ckpt_bytes"][i] = np.array([ckpt_bytes])
    blocks["plain_bytes"][i] = np.array([ckpt_bytes + plain[1] - ckpt[1]])
    blocks["fwd_peak_bytes"][i] = trace.ops(enter[0], plain[0], entry)
    blocks["ckpt_fwd_peak_bytes"][i] = trace.ops(dropped[0], ckpt[0], entry)


def _twin_forward(blocks: dict, i: int, twin: int, at: dict, entry: float, after: float, trace: Trace) -> None:
    """A block run only checkpointed: its checkpointed run measured, the rest its twin's."""
    enter, ckpt = at.get(("enter", i)), at.get(("ckpt", i))
    if enter is None or ckpt is None or blocks["plain_bytes"][twin] is None:
        return
    for quantity in ("saved_bytes", "fwd_ms", "resident_bytes", "fwd_peak_bytes"):
        blocks[quantity][i] = blocks[quantity][twin]
    blocks["ckpt_bytes"][i] = np.array([after - entry])
    blocks["plain_bytes"][i] = blocks["ckpt_bytes"][i] + blocks["plain_bytes"][twin] - blocks["ckpt_bytes"][twin]
    blocks["ckpt_fwd_peak_bytes"][i] = trace.ops(enter[0], ckpt[0], entry)


def backward_stretch(marks: list, at: dict, i: int) -> tuple:
    """The ops ``start..stop-1`` of block ``i``'s backward (its recompute, then its gradients):
    from its output's gradient to the next backward mark."""
    start = at[("bwd", i)][0]
    stop = next(index for label, index, _ in marks if index >= start and label != ("bwd", i)
                and label[0] in ("bwd", "bwd_end", "end"))
    return start, stop


def _block_backward(blocks: dict, step: dict, at: dict, entry: dict, marks: list, trace: Trace,
                    shape: StepShape, dropped: dict) -> None:
    """Backward stretches: from a block's output gradient to the next backward mark. Each is
    measured above what the forward held at the block's entry when backward runs in reverse,
    else above everything the forward held; the tail likewise (absolute, or above the top)."""
    last = shape.order[-1]
    top = at[("ckpt", last)][1]
    if ("bwd", last) not in at:
        return  # backward never reached the last block's output: nothing attributable
    first_bwd = min(at[("bwd", i)][0] for i in shape.order if ("bwd", i) in at)
    # The head's forward runs under the user's autocast, its backward after it: the casts the
    # blocks left are freed in between, which the timeline adds back for blocks run plainly.
    for quantity, autocast in (("head_peak_bytes", True), ("head_bwd_peak_bytes", False)):
        values = trace.ops(at[("ckpt", last)][0], first_bwd, top, autocast=autocast)
        step[quantity] = np.array([]) if values is None else values  # empty: measured, no event
    for i in shape.order:
        if ("bwd", i) not in at:
            continue
        start, stop = backward_stretch(marks, at, i)
        if i not in dropped:
            reference = entry[i] if shape.backward_reversed else top
            blocks["bwd_peak_bytes"][i] = trace.ops(start, stop, reference, recompute=False)
            blocks["recompute_peak_bytes"][i] = trace.ops(start, stop, reference, recompute=True)
    end = at.get(("bwd_end",))
    if end is not None:
        step["tail_peak_bytes"] = trace.ops(end[0], len(trace.live), 0.0 if shape.backward_reversed else top)
    elif all(("bwd", i) in at for i in shape.order):
        # The first block's input needs no gradient (the model starts with a block): backward
        # ends inside the blocks' stretches, and there is no tail to measure.
        step["tail_peak_bytes"] = np.array([])
