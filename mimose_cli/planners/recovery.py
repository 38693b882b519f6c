"""Out-of-memory recovery: what makes a failed forward/backward safe to run again.

``Planner.run(step_fn, batch)`` runs a step's attempts (``run_recovering``) through ``StepGuard``: a step that runs out of
memory is undone (its partial gradients dropped, the RNG and the model's buffers put back) and
retried on the same batch with a plan that needs less memory, so the retry computes exactly what
the first attempt would have (same dropout masks, same BatchNorm statistics) and no batch is
skipped, repeated or counted twice in the gradients.
"""

import gc

import torch

from mimose_cli.planners.blocks import checkpointed
from mimose_cli.planners.snapshots import RngState, buffer_snapshot, restore_buffers
from mimose_cli.torch_private import tree_leaves
from mimose_cli.units import format_bytes


class PlanOutOfMemoryError(torch.OutOfMemoryError):
    """A step that ran out of memory on every attempt the planner could make (the last with
    every block checkpointed, unless the planner does not adapt): the run cannot go on at this
    budget. Carries the three figures (bytes; ``predicted_bytes`` None when the planner made no
    prediction) and how many retries were made."""

    def __init__(self, message: str, budget_bytes, predicted_bytes, reached_bytes, retries: int):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.predicted_bytes = predicted_bytes
        self.reached_bytes = reached_bytes
        self.retries = retries


class RankOutOfMemoryError(torch.OutOfMemoryError):
    """A step of an FSDP-sharded model that ran out of memory on this rank: never retried (a
    retry would run one more forward and backward here than on the other ranks, whose
    collectives would then wait on this one forever). The launcher catches it and stops every
    rank; its attributes name what failed: ``rank``, ``step`` (the planner's step count),
    ``input_size``, and the bytes ``budget_bytes``, ``predicted_bytes`` (None: no prediction)
    and ``reached_bytes``."""

    def __init__(self, message: str, rank: int, step: int, input_size: tuple, budget_bytes, predicted_bytes,
                 reached_bytes: int):
        super().__init__(message)
        self.rank, self.step, self.input_size = rank, step, tuple(input_size)
        self.budget_bytes, self.predicted_bytes, self.reached_bytes = budget_bytes, predicted_bytes, reached_bytes


def rank_out_of_memory(parts, info, error: BaseException) -> RankOutOfMemoryError:
    """The ``RankOutOfMemoryError`` of a sharded step (``info``, a ``StepInfo``) that raised
    ``error``, in one line with the figures and the fix."""
    rank = parts.lockstep.rank
    budget = getattr(parts.meter, "budget_bytes", None) or parts.budget_bytes
    reached = reached_bytes(error, parts.meter)
    predicted = "none" if info.predicted_peak_bytes is None else format_bytes(info.predicted_peak_bytes)
    message = (f"rank {rank} ran out of memory at step {info.step}, input size {tuple(info.input_size)}: budget "
               f"{'unlimited' if budget is None else format_bytes(budget)}, predicted {predicted}, reached "
               f"{format_bytes(reached)}; under FSDP a step is not retried on one rank: stop every rank, then "
               "raise the budget or lower the batch size or sequence length")
    return RankOutOfMemoryError(message, rank, info.step, info.input_size, budget, info.predicted_peak_bytes, reached)


def oom_message(size, retries: int, checkpointed: str, budget_bytes, predicted_bytes, reached_bytes,
                fix: str = "raise the budget or lower the batch size or sequence length") -> str:
    """The one line that ends a run: what failed, the three figures, and the fix (never what the
    planner did already)."""
    predicted = "none" if predicted_bytes is None else format_bytes(predicted_bytes)
    budget = "unlimited" if budget_bytes is None else format_bytes(budget_bytes)
    # " out of memory." is what accelerate's find_executable_batch_size (the Trainer's
    # auto_find_batch_size) looks for to halve the batch, as in CUDA's own message.
    return (f"input size {tuple(size)} ran out of memory. After {retries} "
            f"retr{'y' if retries == 1 else 'ies'}, the last with {checkpointed} checkpointed: budget "
            f"{budget}, predicted {predicted}, reached {format_bytes(reached_bytes)}; {fix}")


def reached_bytes(error: BaseException, meter) -> int:
    """How much the failed step tried to hold (``Meter.reached_bytes``)."""
    return meter.reached_bytes(error) if meter is not None else getattr(error, "reached_bytes", 0)


class StepGuard:
    """Snapshot before an attempt, undo after a failed one.

    Gradients already accumulated (gradient accumulation) are set aside while the attempt runs
    and added back once it succeeds: a failed backward may have written into some of them, and
    that cannot be undone in place. While set aside they stay on the device, so such a step holds
    one more set of gradients than an in-place accumulation would; the planner sees them in the
    bytes live at the step's start and plans for them.
    """

    def __init__(self, model: torch.nn.Module, batch):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.stash = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        self.devices = sorted({t.device for t in tree_leaves(batch)
                               if isinstance(t, torch.Tensor) and t.device.type != "cpu"}, key=str)
        self.rng = RngState(self.devices)
        self.buffers = buffer_snapshot(model, only=lambda b: b.is_floating_point() or b.ndim == 0)

    def undo(self) -> None:
        """Drop the failed attempt's gradients and tensors; put the RNG and the buffers back."""
        for p in self.params:
            p.grad = None
        # The failed step's frames, graph and saved tensors sit in reference cycles through the
        # exception's traceback: collect them now, or the retry starts with them still live.
        gc.collect()
        if self.devices and torch.cuda.is_available():
            torch.cuda.empty_cache()  # and give the allocator's fragments back
        self.rng.restore()
        restore_buffers(self.buffers)

    def finish(self) -> None:
        """The attempt succeeded: add the gradients set aside back (old + new, as autograd's
        own accumulation computes it), and forget the snapshot."""
        with torch.no_grad():
            for p, old in zip(self.params, self.stash):
                if old is None:
                    continue
                if p.grad is None:
                    p.grad = old
                else:
                    p.grad.add_(old)
        self.stash, self.buffers = [], []


def run_recovering(planner, step_fn, batch, size: tuple):
    """``planner.run``'s attempts: ``step_fn(batch)`` in ``planner.step``, recovering from out of
    memory; returns what ``step_fn`` returns.

    A failed attempt is undone (``StepGuard``: its gradients dropped, RNG and buffers put back,
    gradients accumulated before it kept) and the batch run again: first with the planner's own
    remedy (``recover``), then with every block checkpointed; if that fails too,
    ``PlanOutOfMemoryError`` says why with the budget, the prediction and what was reached. Each
    attempt's number reaches the policy in its ``StepContext``. The optimizer is never touched.
    Under FSDP the first failure raises (``RankOutOfMemoryError``), its attempt undone."""
    guard = StepGuard(planner.model, batch)
    # Under FSDP no retry: ``planner.step`` raises ``RankOutOfMemoryError`` for the launcher.
    last_try = planner.policy.max_retries if planner.policy.adapts and planner.parts.lockstep is None else 0
    try:
        for attempt in range(last_try + 1):
            result, failure = _attempt(planner, step_fn, batch, size, attempt, guard)
            if failure is None:
                guard.finish()
                return result
            info, reached = failure
            if attempt < last_try:
                planner.retries_total += 1
                planner.recover(info, attempt + 1, reached)
    except BaseException:
        guard.undo()  # any other error (or an interrupt): the gradients as they were before
        guard.finish()
        raise
    guard.finish()  # the failed attempt is undone; gradients of earlier micro-batches stay
    n, checkpointing = planner.num_blocks, len(checkpointed(info.plan))
    blocks = "every block" if checkpointing == n else f"{checkpointing} of {n} blocks"
    device = getattr(planner.meter, "budget_bytes", None) or planner.budget_bytes  # what the device holds
    message = oom_message(size, last_try, blocks, device, info.predicted_peak_bytes, reached, *planner.parts.options.oom_fix())
    raise PlanOutOfMemoryError(message, device, info.predicted_peak_bytes, reached, last_try)


def _attempt(planner, step_fn, batch, size: tuple, attempt: int, guard: StepGuard):
    """One attempt: ``(step_fn's result, None)`` when it succeeded, else ``(None, (the failed
    step's StepInfo, the bytes it reached))`` with the attempt undone."""
    if planner.meter is not None:
        planner.meter.reset_peak()  # each attempt's peak is its own (the record keeps the last)
    try:
        with planner.step(batch, size, attempt=attempt, step_fn=step_fn):
            return step_fn(batch), None
    except torch.OutOfMemoryError as error:
        if isinstance(error, (PlanOutOfMemoryError, RankOutOfMemoryError)):
            raise
        reached = reached_bytes(error, planner.meter)
    # Outside the except block: the error's traceback, which pins the failed step's activations,
    # is gone before anything is allocated again.
    guard.undo()
    return None, (planner.last, reached)
