"""Every memory figure mimose uses comes from this package.

- ``meter``: the ``Meter`` interface and a step's ``StepMemory``; ``cuda`` (the caching
  allocator's figures), ``simulated`` (an exact count of live storages with a budget, from a
  dispatch mode) and ``allocator`` (the same at c10's CPU allocator, compiled code included).
- ``ledger``: ``StorageLedger``, the weak-reference count of live storages the simulated device
  and the collector's per-op probe (``probe.LiveProbe``) share.
- ``saved``: what autograd saves for backward (``SavedBytesCounter``), unique storage bytes,
  parameter bytes.
- ``profiler``: a block's saved bytes and forward time in one forward pass (``BlockProfiler``).
- ``offload``: what autograd saves in a block held in host memory until backward
  (``OffloadHooks``, the choice ``blocks.OFFLOAD``), and the copies' modelled time (``offload_ms``);
  a meter counts the host copies apart (``Meter.host_copy``, ``host_bytes``).

Usage::

    meter = build_meter("auto", budget_bytes=2 * 2**30, device=device)
    with meter.activate():                 # for the whole run
        meter.track(model, optimizer)      # storages that existed before activate()
        with meter.step() as mem:          # one training iteration
            model(**batch).loss.backward()
        mem.peak_bytes                     # peak since the step started
"""

import torch

from mimose_cli.memory.allocator import AllocatorMeter, allocator_or_fallback
from mimose_cli.memory.cuda import CudaMeter
from mimose_cli.memory.ledger import StorageLedger
from mimose_cli.memory.meter import Meter, StepMemory, synchronize
from mimose_cli.memory.saved import SavedBytesCounter, param_bytes, storage_bytes, storage_ids
from mimose_cli.memory.simulated import SimulatedMeter

METER_KINDS = ("auto", "simulated", "allocator", "cuda")
CPU_DEFAULT = "allocator"
"""What "auto" means on the CPU: the dispatch-mode meter ("simulated") or the counting allocator."""


def build_meter(kind: str = "auto", budget_bytes: int | None = None, device=None) -> Meter:
    """Build the meter for ``device``: "auto" is "cuda" on a CUDA device, else ``CPU_DEFAULT``.

    "simulated" counts tensor storages with a dispatch mode; "allocator" counts every allocation
    at c10's CPU allocator (``allocator.AllocatorMeter``), and falls back to "simulated" with a
    warning where it cannot be built."""
    device = torch.device("cpu" if device is None else device)
    if kind not in METER_KINDS:
        raise ValueError(f"unknown meter {kind!r}; expected one of {', '.join(METER_KINDS)}")
    if budget_bytes is not None and budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive or None, got {budget_bytes!r}")
    if kind == "auto":
        kind = "cuda" if device.type == "cuda" else CPU_DEFAULT
    if kind == "allocator":
        return allocator_or_fallback(budget_bytes)
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


__all__ = ["Meter", "StepMemory", "StorageLedger", "SavedBytesCounter", "SimulatedMeter", "AllocatorMeter",
           "CudaMeter",
           "build_meter", "param_bytes", "storage_bytes", "storage_ids", "synchronize"]
