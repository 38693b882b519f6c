"""Memory meters: where memory figures come from (the CUDA allocator, or a simulated device).

Usage::

    meter = build_meter("auto", budget_bytes=2 * 2**30, device=device)
    with meter.activate():                 # for the whole run
        meter.track(model, optimizer)      # storages that existed before activate()
        with meter.step() as mem:          # one training iteration
            model(**batch).loss.backward()
        mem.peak_bytes                     # peak since the step started
"""

import contextlib
from dataclasses import dataclass

import torch


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


class Meter:
    """The interface every meter implements; ``step()`` is shared."""

    kind: str = ""
    budget_bytes: int | None = None

    def activate(self):
        """Context manager that turns the meter (and its budget) on for the whole run."""
        raise NotImplementedError

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
        """Start a new peak window at the current live bytes."""
        raise NotImplementedError

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
            self._finish_step(mem)

    def _finish_step(self, mem: StepMemory) -> None:
        """Hook for meter-specific figures."""


# Imported after Meter and StepMemory exist: the implementations subclass them.
from mimose_cli.memory.cuda import CudaMeter  # noqa: E402
from mimose_cli.memory.saved import SavedBytesCounter  # noqa: E402
from mimose_cli.memory.simulated import SimulatedMeter  # noqa: E402

METER_KINDS = ("auto", "simulated", "cuda")


def build_meter(kind: str = "auto", budget_bytes: int | None = None, device=None) -> Meter:
    """Build the meter for ``device``: "auto" is "cuda" on a CUDA device, else "simulated"."""
    device = torch.device("cpu" if device is None else device)
    if kind not in METER_KINDS:
        raise ValueError(f"unknown meter {kind!r}; expected one of {', '.join(METER_KINDS)}")
    if budget_bytes is not None and budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive or None, got {budget_bytes!r}")
    if kind == "auto":
        kind = "cuda" if device.type == "cuda" else "simulated"
    if kind == "simulated":
        return SimulatedMeter(budget_bytes)
    if not torch.cuda.is_available():
        raise ValueError(
            "meter 'cuda' needs a CUDA GPU, but torch.cuda.is_available() is False; "
            "use meter 'simulated' (or 'auto') to run on the CPU"
        )
    if device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return CudaMeter(budget_bytes, device)


__all__ = ["Meter", "StepMemory", "SavedBytesCounter", "SimulatedMeter", "CudaMeter", "build_meter"]
