"""A rank that cannot finish its step never leaves the others hanging.

Under ``training.parallel: fsdp`` the collectives are inside forward and backward (all-gathers of
each block's parameters, reduce-scatters of its gradients), so a rank that runs out of memory
mid-backward cannot retry the step alone, as a data-parallel rank does (``distributed.py``): its
retry's forward would issue all-gathers while its peers wait in the failed backward's
reduce-scatters. Nor can it tell them: any message would be a collective they are not in. So it
stops, and so do they, within a bounded time:

1. the failing rank records the failure (rank, step, input size) in the run directory
   (``OUT_OF_MEMORY_FILE``, one JSON line) and ends its run without another collective
   (``RankOutOfMemory``); no rank checkpoints after that (the step is not at a boundary), so the
   previous checkpoint stays the current one;
2. its peers' pending collective then fails at once (gloo sees the closed connection; NCCL's
   watchdog aborts), which ``broken_collective`` recognises; they end too, rank 0 writing the
   summary and the one line, read from the record (``failure_line``);
3. bounds behind those: torchrun's agent sends SIGTERM to every other rank once one exits non-zero
   (the failing rank exits 1) and SIGKILL 30 s later; the process group's timeout ends a
   collective no peer ever joins.

``mimose train --resume`` continues from the checkpoint; the sizes that ran out of memory
(``sizes_out_of_memory``) are what a planner must measure again before trusting its estimate.
"""

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from mimose_cli.planners.recovery import RankOutOfMemoryError
from mimose_cli.units import format_bytes

OUT_OF_MEMORY_FILE = "out_of_memory.jsonl"
"""In the run directory: one line per rank that ran out of memory in a sharded step."""


@dataclass(frozen=True)
class OutOfMemoryRecord:
    """Where a rank ran out of memory: what the line says and what a resume reads."""

    rank: int
    step: int
    micro_step: int
    input_size: list
    """The planner's input size of the rank's batch (B, L), or (B, H, W)."""
    error: str
    """The first line of the error."""

    def line(self) -> str:
        """The one line that ends the run on every rank."""
        return (f"rank {self.rank} ran out of memory at step {self.step} on input size {tuple(self.input_size)} "
                f"({self.error}); under training.parallel=fsdp a rank cannot retry a step alone, so every rank "
                "stopped and the last checkpoint is kept: raise the budget or lower the batch size or "
                "sequence length, or resume (the planner measures that size again before trusting it)")


class RankOutOfMemory(Exception):
    """Raised on the rank whose sharded step ran out of memory for good, instead of any further
    collective; the training loop ends on it (``end_out_of_memory``)."""

    def __init__(self, record: OutOfMemoryRecord):
        super().__init__(record.line())
        self.record = record


def out_of_memory(rank: int, step: int, micro_step: int, input_size, error: BaseException) -> RankOutOfMemory:
    """The exception a sharded step raises in place of continuing after ``error`` (out of memory)."""
    if isinstance(error, RankOutOfMemoryError):  # the planner's own line says rank, step and size too
        predicted = "none" if error.predicted_bytes is None else format_bytes(error.predicted_bytes)
        budget = "unlimited" if error.budget_bytes is None else format_bytes(error.budget_bytes)
        first = f"budget {budget}, predicted {predicted}, reached {format_bytes(error.reached_bytes)}"
    else:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return RankOutOfMemory(OutOfMemoryRecord(rank, step, micro_step, list(input_size), first))


def record_out_of_memory(run_dir, record: OutOfMemoryRecord) -> bool:
    """Append ``record`` to the run directory's ``OUT_OF_MEMORY_FILE`` (one write, fsynced: the
    peers read it as soon as this process is gone); False when the directory cannot be written
    (another machine's run directory, a full disk): the rank then says the line itself."""
    try:
        fd = os.open(Path(run_dir) / OUT_OF_MEMORY_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            os.write(fd, (json.dumps(asdict(record)) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def _records(run_dir) -> list:
    try:
        text = (Path(run_dir) / OUT_OF_MEMORY_FILE).read_text()
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            records.append(OutOfMemoryRecord(**json.loads(line)))
        except (ValueError, TypeError):  # a line torn by a kill mid-write says nothing
            continue
    return records


def sizes_out_of_memory(run_dir) -> list:
    """The input sizes that ran out of memory on some rank of this run directory, as tuples in
    the order they failed: a resumed run's planner must measure these before it trusts them."""
    seen = []
    for record in _records(run_dir):
        if tuple(record.input_size) not in seen:
            seen.append(tuple(record.input_size))
    return seen


def broken_collective(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because a peer is gone or never came (gloo's
    closed or reset connection, a timeout; any backend error of torch.distributed)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("gloo" in text or "Connection closed by peer" in text
                                                or "Connection reset by peer" in text)


def failure_line(run_dir, step: int, error: BaseException) -> tuple[str, OutOfMemoryRecord | None]:
    """What a rank whose collective broke at ``step`` says, and the peer's record when it left one
    in the run directory (a peer on another machine writes its own and says it itself)."""
    record = next((r for r in reversed(_records(run_dir)) if r.step == step), None)
    if record is not None:
        return record.line(), record
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return (f"a collective with the other ranks broke at step {step} ({first[:200]}): another rank ended; "
            "its own output says why. The last checkpoint is kept"), None


@dataclass(frozen=True)
class Stopped:
    """How a rank's training loop ends when a rank failed in a way the others cannot wait out."""

    status: str
    """oom (a rank ran out of memory) or failed (a peer ended, this rank cannot tell why)."""
    error: str
    """The one line rank 0 says and writes to summary.json."""
    failed_rank: int | None
    """The rank that failed, when known."""


def stopped_by(error: BaseException, run_dir, rank: int, step: int) -> Stopped | None:
    """How the loop of rank ``rank``, at ``step``, ends on ``error``: this rank's own
    ``RankOutOfMemory`` (recorded in ``run_dir`` for the peers and a resume; said here only when
    it cannot be recorded there), or a collective broken by a peer; None for any other error,
    which the loop lets through."""
    if isinstance(error, RankOutOfMemory):
        if not record_out_of_memory(run_dir, error.record) and rank != 0:
            os.write(2, f"error: {error.record.line()}\n".encode())  # rank 0 cannot read it: say it
        return Stopped("oom", error.record.line(), error.record.rank)
    if broken_collective(error):
        line, record = failure_line(run_dir, step, error)
        return Stopped("oom", line, record.rank) if record else Stopped("failed", line, None)
    return None
