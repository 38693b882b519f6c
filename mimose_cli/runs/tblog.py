"""Optional TensorBoard logging (``training.tensorboard``): each step's scalars, for users who
watch runs in TensorBoard. A view of the same ``StepRecord``s that go to metrics.jsonl, which
stays the record ``report`` and ``compare`` read.
"""

from pathlib import Path

TENSORBOARD_DIR = "tensorboard"
SCALARS = (("train/loss", "loss"), ("train/lr", "lr"), ("memory/peak_bytes", "peak_bytes"),
           ("memory/predicted_peak_bytes", "predicted_peak_bytes"), ("memory/host_peak_bytes", "host_peak_bytes"),
           ("time/iter_ms", "iter_ms"),
           ("planner/retries", "retries"), ("eval/loss", "eval_loss"), ("eval/accuracy", "eval_accuracy"))
"""(TensorBoard tag, ``StepRecord`` field) logged per step where the record has it (the eval ones
after an evaluation only); ``planner/checkpointed_blocks`` too, and how many of them were selective
or partial, and how many blocks were offloaded (``CHOICE_COUNTS``)."""
CHOICE_COUNTS = (("planner/checkpointed_blocks", "checkpointed"), ("planner/selective_blocks", "selective"),
                 ("planner/partial_blocks", "partial"), ("planner/offloaded_blocks", "offload"))
"""(TensorBoard tag, ``StepRecord.blocks`` kind): the blocks of each choice in the step's plan."""


class TensorBoardLog:
    """Writes a run's step scalars to ``run_dir/tensorboard/`` through torch's ``SummaryWriter``.

    The x axis is the optimizer step; with gradient accumulation, the micro-batch
    (``step × micro_batches + micro_step``), so that no two records share a point.
    """

    def __init__(self, run_dir, micro_batches: int = 1):
        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self.micro_batches = micro_batches
        self._writer = None

    def add(self, record) -> None:
        """Log ``record``'s scalars (those it has: a step out of memory has no loss)."""
        index = record.step * self.micro_batches + record.micro_step
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run trains the steps after its checkpoint again: purge_step makes
            # TensorBoard drop what the earlier attempt logged from this step on.
            self._writer = SummaryWriter(str(self.log_dir), purge_step=index, flush_secs=10)
        for tag, name in SCALARS:
            value = getattr(record, name)
            if value is not None:
                self._writer.add_scalar(tag, value, index)
        for tag, name in CHOICE_COUNTS:
            self._writer.add_scalar(tag, record.blocks(name), index)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
