"""A plan (one choice per block) seen as the blocks of each choice, for tests that compare those."""

from mimose_cli.planners.blocks import PARTIAL_LEVELS, SELECTIVE, checkpointed


def fields(plan) -> tuple:
    """``(checkpointed, selective, partial)``: the indices of the blocks ``plan`` checkpoints, of
    those it checkpoints selectively, and ``(block, level)`` for those it checkpoints partially."""
    return (checkpointed(plan), tuple(i for i, choice in enumerate(plan) if choice == SELECTIVE),
            tuple((i, choice) for i, choice in enumerate(plan) if choice in PARTIAL_LEVELS))
