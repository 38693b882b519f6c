"""The collector's per-op probe: live storage bytes after every op, on any device."""

import contextlib

import torch

from mimose_cli.memory.ledger import StorageLedger
from mimose_cli.torch_private import TorchDispatchMode, tree_leaves


def _autocast_on() -> bool:
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


class LiveProbe(TorchDispatchMode):
    """Live storage bytes after every op (``trace``), and for each op whether ``flag()`` held
    (``flags``: the collector asks whether a checkpoint was recomputing) and whether autocast was
    on (``autocast``). Storages passed to ``ignore`` (weights, existing gradients) or first seen
    ``uncounted()`` are never counted. It counts as the simulated device does (one
    ``StorageLedger``), but from zero and on any device: a CUDA step is probed the same way."""

    def __init__(self, flag=lambda: False):
        super().__init__()
        self.ledger = StorageLedger()
        self.trace: list = []
        self.flags: list = []
        self.autocast: list = []
        self._flag = flag
        self._counting = True

    @property
    def live(self) -> int:
        return self.ledger.live

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
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.layout is torch.strided and not leaf.is_meta:
                self.ledger.add(leaf.untyped_storage(), self._counting)
        if not self._counting:
            return out
        self.trace.append(self.ledger.live)
        self.flags.append(self._flag())
        self.autocast.append(_autocast_on())
        return out
