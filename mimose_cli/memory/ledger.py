"""The count of live storage bytes shared by the simulated device and the collector's probe."""

import weakref


class _StorageRef(weakref.ref):
    """A weak reference to a storage that remembers its dictionary key and counted bytes."""

    __slots__ = ("key", "nbytes", "counted", "index")


class StorageLedger:
    """Live bytes of the storages seen so far, each counted once while it is alive.

    A weak reference per storage takes its bytes back out when the storage is freed. Keyed by
    ``id(storage)``: an id is only reused after its storage died, and the weakref callback
    removes the entry during that death, so keys never go stale. Written for torch, which has no
    allocator to ask on the CPU; the CUDA meter reads the caching allocator instead.
    """

    def __init__(self):
        self.live = 0
        self.refs: dict[int, _StorageRef] = {}

    def add(self, storage, counted: bool = True) -> int:
        """Count ``storage`` if new (as 0 bytes when not ``counted``: weights, copies that are
        not the model's), or a change in its size (``resize_``, ``set_``); returns the bytes
        added."""
        ref = self.refs.get(id(storage))
        if ref is None:
            ref = _StorageRef(storage, self._free)
            ref.key = id(storage)
            ref.nbytes = storage.nbytes() if counted else 0
            ref.counted = counted
            self.refs[ref.key] = ref
            self.live += ref.nbytes
            return ref.nbytes
        if not ref.counted:
            return 0
        nbytes = storage.nbytes()
        if nbytes == ref.nbytes:
            return 0
        delta, ref.nbytes = nbytes - ref.nbytes, nbytes
        self.live += delta
        return max(delta, 0)

    def _free(self, ref: _StorageRef) -> None:
        if self.refs.get(ref.key) is ref:
            del self.refs[ref.key]
            self.live -= ref.nbytes


class HostLedger(StorageLedger):
    """Host memory that offloaded copies hold (``Meter.host_copy``): counted apart from the
    device's, since on the CPU host and device are one memory and only this count tells them
    apart; with its own peak."""

    def __init__(self):
        super().__init__()
        self.peak = 0

    def add(self, storage, counted: bool = True) -> int:
        added = super().add(storage, counted)
        self.peak = max(self.peak, self.live)
        return added

    def reset_peak(self) -> None:
        self.peak = self.live
