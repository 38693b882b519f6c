"""Offloading (``blocks.OFFLOAD``): the tensors autograd saves inside a block moved to host memory
in forward and brought back to the device in backward, and the time those copies are modelled
to take.

Our own ``saved_tensors_hooks`` class rather than ``torch.autograd.graph.save_on_cpu`` or
torchtune's ``OffloadActivations``: neither keeps views of parameters on the device, copies a
storage saved twice (a ReLU's output, which the next matmul saves too) once, or counts the host
copies apart from the device on the simulated device, where host and device are one memory
(``Meter.host_copy``).
"""

import functools
import weakref

import torch

HOST_LINK_GB_PER_S = 25.0
"""Host <-> device copy bandwidth, GB/s (1e9 bytes) each way, that ``offload_ms`` models: what
pinned copies reach over PCIe 4.0 x16 (32 GB/s raw). Modelled, not measured, until a GPU
measures it (``benchmarks/offload.py``)."""

OFFLOAD_MIN_BYTES = 1024
"""Saved storages smaller than this stay on the device (a norm's per-row statistics, scalars):
each copy costs a launch and an event, about 10 us, the time ``HOST_LINK_GB_PER_S`` moves
~250 KB in, to free under a kibibyte. torchtune's ``OffloadActivations`` keeps the same floor."""


def offload_ms(nbytes: int) -> float:
    """Modelled time to move ``nbytes`` to host memory and back (two copies at
    ``HOST_LINK_GB_PER_S``), in milliseconds: what a scheduler weighs against a recompute."""
    return 2 * nbytes / (HOST_LINK_GB_PER_S * 1e9) * 1e3


@functools.cache
def _side_stream(device: torch.device):
    """One copy stream per CUDA device, so that copies overlap the compute stream's kernels."""
    return torch.cuda.Stream(device)


def _as_bytes(storage) -> torch.Tensor:
    """A flat ``uint8`` tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _copy_out(storage) -> torch.Tensor:
    """``storage``'s bytes in host memory. On CUDA: into pinned memory, on the side stream once
    the compute stream has produced them, the device memory kept from reuse until the copy is
    done (``record_stream``); the host buffer is not read until ``_copy_in``, queued behind it on
    the same stream."""
    source = _as_bytes(storage)
    if storage.device.type != "cuda":
        return source.clone()
    stream = _side_stream(storage.device)
    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(storage.device))
    with torch.cuda.stream(stream):
        host.copy_(source, non_blocking=True)
    source.record_stream(stream)
    return host


def _copy_in(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host``'s bytes back on ``device``, a new device allocation. On CUDA: allocated on the
    compute stream, copied on the side stream once the compute stream is done with what that
    memory held before, and waited for by the compute stream before backward reads it (the pinned
    buffer is kept from reuse until then by torch's host allocator)."""
    if device.type != "cuda":
        return host.clone()
    compute, stream = torch.cuda.current_stream(device), _side_stream(device)
    restored = torch.empty(host.numel(), dtype=torch.uint8, device=device)
    stream.wait_stream(compute)
    with torch.cuda.stream(stream):
        restored.copy_(host, non_blocking=True)
    compute.wait_stream(stream)
    return restored


class _HostCopy:
    """One device storage's bytes in host memory. ``restore()`` hands backward the device storage
    itself while something else still holds it (a kept block whose ReLU saved the output this
    block saves as its input, an encoder output every decoder layer saves, shared rotary tables):
    a copy brought back beside it would hold its bytes twice, more than the block recomputed
    would. Else it brings the bytes back, once for all the views backward unpacks while that copy
    lives. (A storage changed in place after it was saved fails a plain run's backward; saved-tensor
    hooks turn that check off, so a program that passes it sees the same bytes either way.)
    ``keep_original=False``: always the copy (``round_trip`` times it)."""

    def __init__(self, storage, meter, keep_original: bool = True):
        self.device = storage.device
        self.host = meter.host_copy(lambda: _copy_out(storage)) if meter is not None else _copy_out(storage)
        self._original = weakref.ref(storage) if keep_original else (lambda: None)
        self._restored = lambda: None  # a weak reference to the restored storage

    def restore(self):
        storage = self._original()
        if storage is not None:
            return storage
        storage = self._restored()
        if storage is None:
            storage = _copy_in(self.host, self.device).untyped_storage()
            self._restored = weakref.ref(storage)
        return storage


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Inside, every tensor autograd saves moves to host memory, one copy per storage, and comes
    back to the device when backward unpacks it. Left on the device: storages in ``resident``
    (``data_ptr``s of the model's parameters and buffers, which the model holds anyway, so that a
    copy would free nothing: a weight's transpose that a matmul saves among them), storages under
    ``OFFLOAD_MIN_BYTES`` and tensors without a single storage (sparse, nested). ``meter`` counts
    the host copies (``Meter.host_copy``). One instance per block call."""

    def __init__(self, resident: frozenset, meter=None):
        self._resident = resident
        self._meter = meter
        self._copies: dict = {}  # id(storage) -> (weak reference to it, its _HostCopy)
        super().__init__(self._pack, self._unpack)

    def __exit__(self, *exc_info):
        # The graph keeps each copy for as long as backward needs it; autograd keeps these hooks
        # (and so this table) as long as the graph lives, which must not keep the copies too.
        self._copies.clear()
        return super().__exit__(*exc_info)

    def _pack(self, tensor):
        if tensor.layout is not torch.strided or tensor.is_meta:
            return tensor
        storage = tensor.untyped_storage()
        if storage.nbytes() < OFFLOAD_MIN_BYTES or storage.data_ptr() in self._resident:
            return tensor
        ref, copy = self._copies.get(id(storage), (lambda: None, None))
        if ref() is not storage:  # new, or an id reused by a storage made since
            copy = _HostCopy(storage, self._meter)
            self._copies[id(storage)] = (weakref.ref(storage), copy)
        return copy, tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset()

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        copy, dtype, size, stride, offset = packed
        return torch.empty(0, dtype=dtype, device=copy.device).set_(copy.restore(), offset, size, stride)


def round_trip(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s storage moved to host memory and back as an offloaded block's saved tensor is
    (``_HostCopy``: the copy out, then ``restore``), uncounted: what ``choices.copy_costs_ms`` times."""
    return _HostCopy(tensor.untyped_storage(), None, keep_original=False).restore()


def resident_storages(model: torch.nn.Module) -> frozenset:
    """``data_ptr``s of ``model``'s parameters' and buffers' storages (``OffloadHooks``'s
    ``resident``)."""
    return frozenset(t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()))
