"""Snapshots a step takes to be undone or repeated as it ran: module buffers (BatchNorm
statistics) and the RNG state (torch.utils.checkpoint's own device-state helpers)."""

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states


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

