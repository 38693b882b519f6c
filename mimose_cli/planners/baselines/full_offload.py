"""The planner ``offload``: every block run as it is, with what autograd saves inside it held in
host memory until backward (``blocks.OFFLOAD``). Off unless named: the copies' time is modelled
(``memory.offload.offload_ms``), not yet measured on a GPU; docs/MIMOSE.md "Finer plans"."""


from mimose_cli.planners.base import Planner
from mimose_cli.planners.blocks import OFFLOAD
from mimose_cli.planners.contract import NO_CONTEXT, Decision, Policy
from mimose_cli.planners.parts import check_offload_device


class FullOffloadPolicy(Policy):
    """Offload every block: the device holds the activations between the blocks, those under
    ``OFFLOAD_MIN_BYTES`` and the parameters; the rest waits in host memory, which the meter
    counts apart (``Meter.host_bytes``). A step that still runs out of memory is retried with
    every block recomputed (``Planner.recover``), which needs no host memory."""

    name = "offload"
    builds_meter = True  # on the CPU, only the simulated device's host count tells the copies apart

    def __init__(self, parts):
        super().__init__(parts)
        check_offload_device(parts.model, "planner offload", "choose another planner")

    def decide(self, input_size, context=NO_CONTEXT):
        return Decision((OFFLOAD,) * self.parts.num_blocks)

    def least_memory(self) -> Decision:
        """Its one plan: every block offloaded (which holds less than every block checkpointed,
        whose inputs stay)."""
        return self.decide(())


def FullOffload(model, budget=None, **options) -> Planner:
    """``Planner(model, FullOffloadPolicy, budget, **options)``."""
    return Planner(model, FullOffloadPolicy, budget, **options)
