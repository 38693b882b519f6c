"""The simulated device: an exact count of live tensor storages, with a budget.

On the CPU there is no allocator to ask, so every ATen op's outputs go through a
``TorchDispatchMode`` that counts each untyped storage's bytes once while it is alive (a
weak reference decrements the count when the storage is freed). The peak is sampled after
every op, i.e. with the op's inputs and outputs alive at once, as a GPU allocator sees it.

What a dispatch mode cannot see, and so is not counted:
  - scratch memory an op allocates and frees inside its kernel (GPU workspaces);
  - storages created before ``activate()``, in other processes (DataLoader workers) or by
    ``torch.from_numpy``, unless passed to ``track()`` (or written in place later, when
    they are counted on first sight);
  - fragmentation and the allocator's rounding (the CUDA meter sees those).

Memory pressure (``set_pressure_handler``, what DTR's on-demand eviction uses): the budget is
checked after an op has computed its outputs, so the handler is called with the op's outputs
already counted and frees memory after the fact; the op fails only if the live count is still
over the budget when the handler returns. A GPU allocator would free first and allocate
second; the live set that results is the same, because a handler can only free tensors nothing
else references (never the running op's inputs), and the peak is sampled after the handler, as a
GPU would see it. The handler is never re-entered: called from an op, it runs inside
``__torch_dispatch__`` where this mode is off, so ops it runs are not counted; called from a
storage resize, what it allocates is counted and checked with the rest once it returns.
"""

import contextlib

import torch

from mimose_cli.memory.ledger import StorageLedger
from mimose_cli.memory.meter import Meter
from mimose_cli.torch_private import TorchDispatchMode, get_untyped_storages
from mimose_cli.units import format_bytes

_TENSOR = torch.Tensor
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class _Ledger(StorageLedger):
    """The shared storage count (``StorageLedger``) with a peak, a budget and the pressure
    handler; the budget check lives here."""

    def __init__(self, budget_bytes: int | None):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.peak = 0
        self.pressure_handler = None
        self._relieving = False

    def commit(self, added: int) -> None:
        """Record a new peak, or raise if the bytes just added broke the budget.

        Over the budget, the pressure handler is asked to free the excess first, and the
        budget checked again after it returns. The caller drops its references before the
        exception propagates, so the weakref callbacks take the failed allocation back out of
        ``live``.
        """
        if self._relieving:
            return  # allocated by the handler itself (a storage resize): the outer commit checks
        if self._over_budget() and self.pressure_handler is not None:
            self._relieving = True
            try:
                self.pressure_handler(self.live - self.budget_bytes)
            finally:
                self._relieving = False
        if self._over_budget():
            # Built by a function, not held in a local: a local would make a cycle with the
            # traceback and keep the failed step's tensors alive until the garbage collector runs.
            raise _out_of_memory(added, self.live, self.budget_bytes)
        if self.live > self.peak:
            self.peak = self.live

    def _over_budget(self) -> bool:
        return self.budget_bytes is not None and self.live > self.budget_bytes


def _out_of_memory(added: int, live: int, budget_bytes: int) -> torch.OutOfMemoryError:
    error = torch.OutOfMemoryError(
        f"simulated device out of memory: tried to allocate {format_bytes(added)} "
        f"(live {format_bytes(live - added)}) with a budget of {format_bytes(budget_bytes)}")
    error.reached_bytes = live  # what the step tried to hold (out-of-memory recovery reports it)
    return error


def _add_outputs(ledger: _Ledger, out) -> int:
    """Count the storages of an op's outputs (a tensor or nested lists/tuples of them)."""
    if isinstance(out, _TENSOR):
        if type(out) in _PLAIN_TENSORS:  # the fast path: almost every output
            if out.layout is not torch.strided or out.is_meta:
                return 0  # sparse/nested have no single storage; meta tensors have no memory
            return ledger.add(out.untyped_storage())
        return _add_subclass(ledger, out)
    if isinstance(out, (list, tuple)):
        return sum(_add_outputs(ledger, item) for item in out)
    return 0


def _add_subclass(ledger: _Ledger, tensor) -> int:
    """Tensor subclasses: count the storages they wrap, never the meta ones of fake tensors."""
    if tensor.layout is not torch.strided:
        return 0
    storages = get_untyped_storages(tensor)
    return sum(ledger.add(st) for st in storages if st.device.type != "meta")


class _HostSide:
    """Stands in for the device's ledger while an offloaded copy is made (``host_copy``): the
    storages it makes are marked as not the device's (counted as 0 bytes there, also when an op
    writes them later), and the host's count takes them instead."""

    def __init__(self, ledger: _Ledger):
        self.ledger = ledger

    def add(self, storage, counted: bool = True) -> int:
        return self.ledger.add(storage, counted=False)


class _StorageMode(TorchDispatchMode):
    """Counts the output storages of every op; raises out-of-memory past the budget."""

    def __init__(self, ledger: _Ledger):
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        added = _add_outputs(self.ledger, out)
        if added:
            try:
                self.ledger.commit(added)
            except BaseException:  # out of memory, or an error in the pressure handler
                del out  # free the failed allocation before the traceback pins this frame
                raise
        return out


class SimulatedMeter(Meter):
    """An exact simulated device: live storage bytes, their peak, and a hard budget."""

    kind = "simulated"
    supports_pressure_handler = True

    def __init__(self, budget_bytes: int | None = None):
        super().__init__()
        self._ledger = _Ledger(budget_bytes)
        self._mode: _StorageMode | None = None

    @property
    def budget_bytes(self) -> int | None:
        """The simulated device's size; None is unlimited. May be changed between steps."""
        return self._ledger.budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, value: int | None) -> None:
        self._ledger.budget_bytes = value

    @contextlib.contextmanager
    def activate(self):
        """Count every op's outputs (and enforce the budget) inside this context."""
        if self._mode is not None:
            raise RuntimeError("this simulated meter is already active")
        self._mode = _StorageMode(self._ledger)
        try:
            with _patched_storage_resize(self._ledger), self._mode:
                yield self
        finally:
            self._mode = None

    def host_copy(self, make):
        """``make()``'s tensor counted as host memory only: host and device are one memory here,
        so the copy is made with the device's ledger standing aside (``_HostSide``), and the
        device's peak is what a GPU's would be, the offloaded bytes left out."""
        if self._mode is None:
            return super().host_copy(make)
        self._mode.ledger = _HostSide(self._ledger)
        try:
            return super().host_copy(make)
        finally:
            self._mode.ledger = self._ledger

    @contextlib.contextmanager
    def unlimited(self):
        budget, self._ledger.budget_bytes = self._ledger.budget_bytes, None
        try:
            yield self
        finally:
            self._ledger.budget_bytes = budget

    def track(self, *objects) -> None:
        """Count storages that already exist; each storage is counted once however often seen.

        Accepts nn.Modules (parameters, buffers, grads), optimizers (state tensors), tensors
        (and their grads) and dicts/lists/tuples of these. Raises out-of-memory if they alone
        exceed the budget, as moving them onto a GPU of that size would.
        """
        added = sum(self._track_one(obj) for obj in objects)
        self._ledger.commit(added)

    def _track_one(self, obj) -> int:
        if isinstance(obj, torch.nn.Module):
            tensors = [*obj.parameters(), *obj.buffers()]
            return sum(self._track_one(t) for t in tensors)
        if isinstance(obj, torch.optim.Optimizer):
            return self._track_one(list(obj.state.values()))
        if isinstance(obj, _TENSOR):
            added = _add_outputs(self._ledger, obj)
            grad = obj.grad if obj.is_leaf else None  # only leaves hold a .grad
            return added + (self._track_one(grad) if grad is not None else 0)
        if isinstance(obj, dict):
            return self._track_one(list(obj.values()))
        if isinstance(obj, (list, tuple)):
            return sum(self._track_one(item) for item in obj)
        return 0

    def set_pressure_handler(self, handler) -> None:
        """Call ``handler(need_bytes)`` before failing an allocation; see the module docstring."""
        if self._ledger.pressure_handler is not None:
            raise RuntimeError("this simulated meter has a pressure handler already; clear it first")
        self._ledger.pressure_handler = handler

    def clear_pressure_handler(self) -> None:
        self._ledger.pressure_handler = None

    def current_bytes(self) -> int:
        return self._ledger.live

    def peak_bytes(self) -> int:
        return self._ledger.peak

    def reset_peak(self) -> None:
        self._ledger.peak = self._ledger.live
        self.host.reset_peak()


@contextlib.contextmanager
def _patched_storage_resize(ledger: _Ledger):
    """Follow ``UntypedStorage.resize_``, which does not go through the dispatcher."""
    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        if id(storage) not in ledger.refs:
            return original(storage, size)
        old_nbytes = storage.nbytes()
        result = original(storage, size)
        added = ledger.add(storage)
        if added:
            try:
                ledger.commit(added)
            except torch.OutOfMemoryError:
                # A failed allocation leaves the storage as it was, as on a GPU.
                original(storage, old_nbytes)
                ledger.add(storage)
                raise
        return result

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original
