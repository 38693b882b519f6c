"""The meter interface every memory figure comes from, and the figures of one step."""

import contextlib
from dataclasses import dataclass

import torch

from mimose_cli.memory.ledger import HostLedger


@dataclass
class StepMemory:
    """Memory figures of one training iteration, in bytes."""

    start_bytes: int = 0
    """Live bytes when the step began."""
    peak_bytes: int = 0
    """Highest live bytes between the start and the end of the step."""
    end_bytes: int = 0
    """Live bytes when the step ended."""
    activation_bytes: int = 0
    """Bytes held for backward; filled by the training loop from a SavedBytesCounter."""
    reserved_peak_bytes: int = 0
    """Peak bytes reserved by the CUDA caching allocator (0 on the simulated device)."""
    peak_host_bytes: int = 0
    """Highest host bytes offloaded copies held (``Meter.host_copy``): never the device's."""


class Meter:
    """The interface every meter implements; ``step()`` is shared."""

    kind: str = ""
    budget_bytes: int | None = None

    def __init__(self):
        self.host = HostLedger()
        """Host memory offloaded copies hold, apart from the device's (``host_copy``)."""

    def activate(self):
        """Context manager that turns the meter (and its budget) on for the whole run."""
        raise NotImplementedError

    @contextlib.contextmanager
    def unlimited(self):
        """Lift the budget inside (the whole device's memory on CUDA): to measure what a step
        would need, past the budget, before training. Figures are still counted."""
        raise NotImplementedError
        yield  # pragma: no cover

    def track(self, *objects) -> None:
        """Count storages that exist already: modules, optimizers, tensors, dicts/lists of them."""
        raise NotImplementedError

    def current_bytes(self) -> int:
        """Bytes live now."""
        raise NotImplementedError

    def peak_bytes(self) -> int:
        """Highest live bytes since the last ``reset_peak()``."""
        raise NotImplementedError

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes (the host's too)."""
        raise NotImplementedError

    def host_copy(self, make):
        """``make()``'s tensor, an offloaded copy: counted as host memory for as long as it lives
        (``host_bytes``), never as the device's. A meter that counts every op's outputs (the
        simulated device) must not see it made: see ``SimulatedMeter``."""
        tensor = make()
        self.host.add(tensor.untyped_storage())
        return tensor

    def host_bytes(self) -> int:
        """Host bytes offloaded copies hold now."""
        return self.host.live

    def peak_host_bytes(self) -> int:
        """Highest ``host_bytes`` since the last ``reset_peak()``."""
        return self.host.peak

    def reached_bytes(self, error: BaseException) -> int:
        """How much a step that raised ``error`` (out of memory) tried to hold: the simulated
        device says so in its error; the peak otherwise (a GPU's peak stops at what was granted)."""
        return max(self.peak_bytes(), getattr(error, "reached_bytes", 0))

    supports_pressure_handler: bool = False
    """Whether ``set_pressure_handler`` works: the meter can ask for memory to be freed before
    it reports out-of-memory (what DTR's on-demand eviction needs)."""

    def set_pressure_handler(self, handler) -> None:
        """Call ``handler(need_bytes)`` when an allocation would exceed the budget, before failing.

        ``need_bytes`` is how many bytes must be freed to fit; the handler frees what it can
        (drops references) and returns; the allocation fails only if it still does not fit.
        Meters without an allocator hook (CUDA: the caching allocator offers none to Python)
        raise NotImplementedError, so callers must check ``supports_pressure_handler`` and fall
        back to freeing memory ahead of time.
        """
        raise NotImplementedError(
            f"the {self.kind or type(self).__name__} meter cannot call a handler before an "
            "allocation fails; free memory ahead of time instead")

    def clear_pressure_handler(self) -> None:
        """Remove the handler set by ``set_pressure_handler``; out-of-memory fails at once again."""

    @contextlib.contextmanager
    def step(self):
        """Measure one training iteration; yields a StepMemory filled in on exit.

        The figures are filled in even when the step raises (e.g. out of memory), so a
        loop that retries the batch can still log what the failed attempt used.
        """
        mem = StepMemory(start_bytes=self.current_bytes())
        self.reset_peak()
        try:
            yield mem
        finally:
            mem.peak_bytes = self.peak_bytes()
            mem.end_bytes = self.current_bytes()
            mem.peak_host_bytes = self.peak_host_bytes()
            self._finish_step(mem)

    def _finish_step(self, mem: StepMemory) -> None:
        """Hook for meter-specific figures."""


def synchronize(device) -> None:
    """Wait for ``device``'s queued kernels (CUDA); nothing to wait for on the CPU. Timings that
    read the wall clock call this first."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
