"""The static plan a Hugging Face user would pick: checkpoint every n-th block, the largest stride
whose largest batch fits the budget.

transformers' ``gradient_checkpointing_enable(every_n_layers=n)`` checkpoints the layers whose
index is a multiple of ``n`` (``layer_index % n == 0``); a user who wants the fastest run that
fits tries strides until the longest batch no longer runs out of memory. ``prepare`` does that
search before training: each stride, largest first, is measured on one side-effect-free step at
the recipe's largest input (as the pre-flight measures full checkpointing), and the first whose
peak, plus what the optimizer's first step will allocate, fits is applied to every batch.
"""

import time

from mimose_cli.planners.base import Planner
from mimose_cli.planners.blocks import recomputed
from mimose_cli.planners.contract import NO_CONTEXT, Decision, Policy, StepContext
from mimose_cli.planners.trial import probe_with_plan, to_model_device
from mimose_cli.planners.usage import warn_user


def stride_plan(num_blocks: int, every_n_layers: int) -> tuple:
    """The blocks transformers checkpoints for ``every_n_layers``: indices divisible by it."""
    return tuple(i for i in range(num_blocks) if i % every_n_layers == 0)


class EveryNPolicy(Policy):
    """One stride for every batch: ``every_n_layers`` when given, else the largest that fits."""

    name = "hf-every-n"

    def __init__(self, parts):
        super().__init__(parts)
        self.every_n_layers = parts.options.every_n_layers
        self.static_plan: tuple | None = None
        self.prepare_ms = 0.0
        self.stride_peaks: dict = {}  # stride -> measured peak at the largest input (None: out of memory)

    def prepare(self, make_batch, max_input_size: tuple, reserve_bytes: int = 0, step_fn=None) -> None:
        """Find the stride (unless given) and fix the plan; ``reserve_bytes`` is kept free for the
        optimizer's state."""
        start = time.perf_counter()
        if self.every_n_layers is None:
            self.every_n_layers = self._largest_fitting(make_batch, tuple(max_input_size), int(reserve_bytes))
        self.static_plan = stride_plan(self.parts.num_blocks, self.every_n_layers)
        self.prepare_ms = (time.perf_counter() - start) * 1e3

    def _largest_fitting(self, make_batch, size: tuple, reserve_bytes: int) -> int:
        if self.parts.limit_bytes is None:
            return max(self.parts.num_blocks, 1)  # no budget: the sparsest stride, one block
        if self.parts.meter is None:
            raise ValueError("hf-every-n measures the largest batch under each stride and needs a meter: "
                             "pass meter=, or every_n_layers= to fix the stride")
        batch = to_model_device(self.parts.model, make_batch(size))
        with self.parts.meter.unlimited():
            for stride in range(max(self.parts.num_blocks, 1), 0, -1):
                plan = recomputed(stride_plan(self.parts.num_blocks, stride), self.parts.num_blocks)
                peak = probe_with_plan(self.parts, batch, plan)
                self.stride_peaks[stride] = peak
                if peak is not None and peak + reserve_bytes <= self.parts.limit_bytes:
                    return stride
        warn_user(f"hf-every-n: no stride fits the largest input {size} in the budget; "
                  "checkpointing every block (every_n_layers=1)")
        return 1

    def decide(self, input_size: tuple, context: StepContext = NO_CONTEXT) -> Decision:
        if self.static_plan is None:
            if self.every_n_layers is None:
                raise RuntimeError("hf-every-n finds its stride for the largest input: call "
                                   "planner.prepare(make_batch, max_input_size) before the first step, "
                                   "or pass every_n_layers=")
            self.static_plan = stride_plan(self.parts.num_blocks, self.every_n_layers)
        return Decision(recomputed(self.static_plan, self.parts.num_blocks))

    def stats(self, counted: dict) -> dict:
        return {"every_n_layers": self.every_n_layers, "prepare_ms": self.prepare_ms,
                "static_plan": list(self.static_plan or ()),
                "stride_peaks": {str(k): v for k, v in self.stride_peaks.items()}}


def EveryN(model, budget=None, **options) -> Planner:
    """``Planner(model, EveryNPolicy, budget, **options)`` (``every_n_layers``: None finds the largest that fits)."""
    return Planner(model, EveryNPolicy, budget, **options)
