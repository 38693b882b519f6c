"""A block's saved activation bytes and forward time, measured in one forward pass."""

import time

import torch

from mimose_cli.memory.meter import synchronize
from mimose_cli.memory.saved import SavedBytesCounter, _never_unpacked
from mimose_cli.torch_private import tree_leaves


class BlockProfiler:
    """Measures every block's saved activation bytes and forward time in forward passes whose
    saved tensors are dropped as each block ends (they are never backwarded), so measuring costs
    about one block of memory whatever the budget.

    Inside each block it counts the unique storages the block saves, parameters and the block's
    own inputs excluded (``SavedBytesCounter``): exactly the bytes checkpointing the block frees,
    since a checkpointed block keeps its inputs. The owning planner routes its blocks here while
    ``active`` (``run``); ``measure`` runs the passes, the caller keeping them free of side
    effects (RNG, buffers).
    """

    def __init__(self, model, num_blocks: int):
        self.model = model
        self.num_blocks = num_blocks
        self.active = False
        self._act_bytes: list = []
        self._fwd_ms: list = []
        self._device = None

    def measure(self, forward, device, repeats: int = 2) -> tuple:
        """Run ``forward()`` (the model's forward on one batch) ``repeats`` times; return
        ``(act_bytes, fwd_ms)`` per block, time the minimum over the passes."""
        self._act_bytes = [0] * self.num_blocks
        self._fwd_ms = [float("inf")] * self.num_blocks
        self._device = device
        self.active = True
        try:
            for _ in range(repeats):
                # Outside the blocks too, nothing is kept for a backward that never comes.
                with torch.autograd.graph.saved_tensors_hooks(_drop, _never_unpacked):
                    forward()
        finally:
            self.active = False
        return list(self._act_bytes), list(self._fwd_ms)

    def run(self, index, forward, args, kwargs):
        counter = SavedBytesCounter(exclude=[*self.model.parameters(), *_tensors((args, kwargs))], keep=False)
        synchronize(self._device)
        start = time.perf_counter()
        try:
            with counter:
                out = forward(*args, **kwargs)
            synchronize(self._device)
            self._fwd_ms[index] = min(self._fwd_ms[index], (time.perf_counter() - start) * 1e3)
            self._act_bytes[index] = counter.bytes
        finally:
            # The block's saved tensors go now, as they would once it ends. Autograd keeps the
            # counter's pack hook (and so what it holds) with the graph: a cycle through C++ the
            # garbage collector cannot see, which this breaks, out of memory included.
            counter.reset()
        return out


def _tensors(tree) -> list:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _drop(_tensor):
    return None
