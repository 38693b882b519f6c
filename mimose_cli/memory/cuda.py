"""The CUDA meter: the caching allocator's own figures, and its budget enforcement."""

import contextlib

import torch

from mimose_cli.memory.meter import Meter, StepMemory


class CudaMeter(Meter):
    """Reads ``torch.cuda.memory_allocated`` and friends for one device.

    The budget is enforced by the allocator itself through
    ``torch.cuda.set_per_process_memory_fraction``, so going over it raises a real
    ``torch.OutOfMemoryError``. The fraction caps *reserved* memory, which includes
    fragmentation, so a plan that fits exactly on the simulated device may still fail here.

    No pressure handler (``supports_pressure_handler`` is False): the caching allocator gives
    Python no hook between "this allocation does not fit" and the OutOfMemoryError, so DTR
    cannot evict on demand here and evicts ahead of time against a reserve instead.
    """

    kind = "cuda"

    def __init__(self, budget_bytes: int | None, device: torch.device):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.device = torch.device(device)

    @contextlib.contextmanager
    def activate(self):
        """Cap the allocator at the budget inside (the training loop: the whole run; a planner's
        own meter: each step, so that code between the steps is never capped); the full device
        again on exit. Cached memory past the budget is given back first: the allocator reuses
        cached blocks without checking the cap, so memory reserved between two steps (an
        evaluation) would otherwise let the next step exceed the budget."""
        if self.budget_bytes is None:
            yield self
            return
        if torch.cuda.memory_reserved(self.device) > self.budget_bytes:
            torch.cuda.empty_cache()
        self._cap()
        try:
            yield self
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def _cap(self) -> None:
        """Cap the allocator at ``budget_bytes`` (a fraction of the device's memory)."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        if self.budget_bytes > total:
            raise ValueError(
                f"budget of {self.budget_bytes} bytes exceeds the {total} bytes of {self.device}"
            )
        torch.cuda.set_per_process_memory_fraction(self.budget_bytes / total, self.device)

    @contextlib.contextmanager
    def unlimited(self):
        if self.budget_bytes is None:
            yield self
            return
        torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        try:
            yield self
        finally:
            torch.cuda.empty_cache()  # what the measurement reserved must not count against the budget
            self._cap()

    def track(self, *objects) -> None:
        """Nothing to do: the allocator already knows every storage on the device."""

    def current_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
        self.host.reset_peak()

    def _finish_step(self, mem: StepMemory) -> None:
        mem.reserved_peak_bytes = torch.cuda.max_memory_reserved(self.device)
