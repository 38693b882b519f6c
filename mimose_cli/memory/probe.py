"""The collector's per-op probe: live storage bytes after every op, on any device."""

import contextlib
import threading
import time

import torch

from mimose_cli.memory.ledger import StorageLedger
from mimose_cli.torch_private import UncompiledDispatchMode, autocast_open, tree_leaves


class _LifetimeLedger(StorageLedger):
    """The ledger, also writing down each counted storage's bytes and the points (see
    ``LiveProbe.point``) at which it was first seen and freed. A storage that changes size
    (``resize_``) ends one lifetime and starts another, so each lifetime has one size."""

    def __init__(self, probe):
        super().__init__()
        self.probe = probe
        self.nbytes: list = []
        self.born: list = []
        self.died: list = []
        self.shapes: list = []
        """The shape and element size of the tensor each storage was first seen with."""
        self.heavy: list = []
        """Whether each storage was first seen as the output of one of the probe's
        ``heavy_ops`` (what a selective checkpoint keeps)."""
        self.comm: set = set()
        """The lifetimes of storages a collective (``c10d``) read or wrote, or that another
        thread freed: FSDP's all-gather and reduce-scatter buffers and the process group's own,
        which its worker thread may hold a moment past the step's last reference, so that the
        point they die at varies from run to run."""
        self._thread = threading.get_ident()

    def _start(self, ref, tensor) -> None:
        ref.index = len(self.nbytes)
        self.nbytes.append(ref.nbytes)
        self.born.append(self.probe.points)
        self.died.append(None)
        self.shapes.append(None if tensor is None else (tuple(tensor.shape), tensor.element_size()))
        self.heavy.append(self.probe.heavy_now)

    def add(self, storage, counted: bool = True, tensor=None) -> int:
        ref = self.refs.get(id(storage))
        if ref is None:  # a new storage (most ops' outputs): a lifetime when it has bytes
            added = super().add(storage, counted)
            if added:
                self._start(self.refs[id(storage)], tensor)
            return added
        if not ref.counted:
            return 0
        before = ref.nbytes
        added = super().add(storage, counted)
        if ref.nbytes != before:  # resized: one lifetime ends, another starts
            if getattr(ref, "index", None) is not None:
                self.died[ref.index] = self.probe.points
            self._start(ref, tensor)
        return added

    def mark_comm(self, tensors) -> None:
        """Note the storages of ``tensors`` (a collective's) as ``comm``."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided and not tensor.is_meta:
                ref = self.refs.get(id(tensor.untyped_storage()))
                if ref is not None and getattr(ref, "index", None) is not None:
                    self.comm.add(ref.index)

    def _free(self, ref) -> None:
        if self.refs.get(ref.key) is ref and getattr(ref, "index", None) is not None:
            self.died[ref.index] = self.probe.points
            if threading.get_ident() != self._thread:
                self.comm.add(ref.index)
        super()._free(ref)


_aten = torch.ops.aten
_WRITES_NOTHING = frozenset((_aten._unsafe_view, _aten.empty_like, _aten.empty, _aten.empty_strided,
                             _aten.new_empty, _aten.new_empty_strided))
"""Ops that return a tensor without writing its elements (a view not marked one, allocations)."""


def writes_elements(func) -> bool:
    """Whether an op writes the elements of what it returns (not a view, not an allocation alone):
    the elements that count as a light op's work."""
    return not func.is_view and func.overloadpacket not in _WRITES_NOTHING


class LiveProbe(UncompiledDispatchMode):
    """Live storage bytes after every op (``trace``), and for each op whether ``flag()`` held
    (``flags``: the collector asks whether a checkpoint was recomputing) and whether an autocast
    context was open, its cast weights still cached (``autocast``, ``torch_private.autocast_open``).
    Storages passed to ``ignore`` (weights, existing gradients) or first seen ``uncounted()`` are
    never counted. It counts as the simulated device does (one
    ``StorageLedger``), but from zero and on any device: a CUDA step is probed the same way.

    With ``lifetimes`` it also writes down every counted storage's bytes and when it lived, in
    *points*: each op's entry in the trace is one, and so is each ``point()`` a caller takes
    between ops (the collector's marks). So the live bytes at every point can be rebuilt as a
    sum over storages (``planners.scaling`` scales each storage with the input size). The time
    spent inside the ops themselves is summed apart for ``heavy_ops`` and the rest (``heavy_ms``,
    ``light_ms``): what recomputing a block with and without those ops' outputs kept costs; and
    the work of each op (``works``), which says how those times grow with the input size."""

    def __init__(self, flag=lambda: False, lifetimes: bool = False, heavy_ops=frozenset(), heavy_work=None,
                 light_class=lambda func: None):
        super().__init__()
        self.heavy_ops = heavy_ops
        """Ops timed apart (``heavy_ms``; the others in ``light_ms``) whose outputs' storages the
        lifetimes mark (``_LifetimeLedger.heavy``): the compute-heavy ops."""
        self.heavy_work = heavy_work
        """``heavy_work(func, args, out) -> (dims, factor, gemm)``: a heavy op's work (its
        floating-point operations, ``factor`` times the product of ``dims``, and the matmul it
        amounts to); None: the work is not written down."""
        self.light_class = light_class
        """``light_class(func)``: the kind of an op that is not heavy, written beside its work."""
        self.works: list = []
        """With ``heavy_work``, each op's work in the order they ran: ``(heavy, dims, factor, gemm)``;
        a heavy op's from ``heavy_work``, another's the elements of each tensor it returned (none for
        a view or an op that only allocates: ``writes_elements``), its ``light_class`` in place of
        ``gemm``."""
        self.heavy_now = False
        self.heavy_ms = 0.0
        self.light_ms = 0.0
        self.heavy_count = 0
        self.points = 0
        self.op_points: list = []
        """The point of each entry of ``trace`` (with ``lifetimes``)."""
        self.ledger = _LifetimeLedger(self) if lifetimes else StorageLedger()
        self.lifetimes = lifetimes
        self.trace: list = []
        self.flags: list = []
        self.autocast: list = []
        self._flag = flag
        self._counting = True

    @property
    def live(self) -> int:
        return self.ledger.live

    def point(self) -> int:
        """A point between ops (a mark): its index in the sequence of points."""
        self.points += 1
        return self.points - 1

    def __enter__(self):
        # FSDP allocates and frees the gathered parameters by resizing their storages, which
        # does not go through the dispatcher: followed here (as the simulated device does).
        original = torch.UntypedStorage.resize_
        ledger, probe = self.ledger, self

        def resize_(storage, size):
            result = original(storage, size)
            ledger.add(storage, probe._counting)
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        try:
            return super().__enter__()
        except BaseException:
            torch.UntypedStorage.resize_ = original
            raise

    def __exit__(self, *exc_info):
        try:
            return super().__exit__(*exc_info)
        finally:
            torch.UntypedStorage.resize_ = self._resize

    def ignore(self, tensors) -> None:
        for tensor in tensors:
            if tensor is not None and tensor.layout is torch.strided:
                self.ledger.add(tensor.untyped_storage(), counted=False)

    @contextlib.contextmanager
    def uncounted(self):
        """Copies no planned step makes: storages first seen inside are never counted, and the
        ops leave no entry in the trace (whose stretches are fitted op by op)."""
        self._counting = False
        try:
            yield
        finally:
            self._counting = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        ms = (time.perf_counter() - start) * 1e3
        # Most ops return one tensor or a flat tuple of them: no pytree walk for those.
        if type(out) is torch.Tensor:
            leaves = (out,)
        elif type(out) is tuple and all(type(leaf) is torch.Tensor for leaf in out):
            leaves = out
        else:
            leaves = tree_leaves(out)
        self.heavy_now = func in self.heavy_ops
        if self.heavy_now:
            self.heavy_ms += ms
            self.heavy_count += 1
            if self.heavy_work is not None:
                self.works.append((True, *self.heavy_work(func, args, out)))
        else:
            self.light_ms += ms
            if self.heavy_work is not None and writes_elements(func):
                kind = self.light_class(func)
                self.works.extend((False, tuple(leaf.shape), 1, kind) for leaf in leaves
                                  if isinstance(leaf, torch.Tensor))
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.layout is torch.strided and not leaf.is_meta:
                if self.lifetimes:
                    self.ledger.add(leaf.untyped_storage(), self._counting, leaf)
                else:
                    self.ledger.add(leaf.untyped_storage(), self._counting)
        if self.lifetimes and func.namespace == "c10d":
            self.ledger.mark_comm([*leaves, *tree_leaves((args, kwargs))])
        if not self._counting:
            return out
        self.trace.append(self.ledger.live)
        self.op_points.append(self.points)
        self.points += 1
        self.flags.append(self._flag())
        self.autocast.append(autocast_open())
        return out
