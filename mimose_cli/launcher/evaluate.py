"""Evaluation on the validation split: the mean loss per example, and accuracy where the task has one.

It runs between optimizer steps on the weights just trained: in eval mode (no dropout), without
grad, under the training step's autocast, and on the run's meter, so the budget holds for it too.
Without grad no block keeps activations for a backward, so there is nothing to checkpoint: the
planners' router runs every block as it is (``PlanRunner`` checkpoints only under grad), and an
evaluation batch needs less memory than a training step of its size with every block checkpointed,
which the pre-flight found to fit. Torch's RNG is forked around it, so training draws the same
dropout masks whether or not it evaluates (a model that draws in eval mode included).
"""

import contextlib
import time
from dataclasses import dataclass

import torch

from mimose_cli.launcher.data.loader import model_input
from mimose_cli.memory import Meter, synchronize

ACCURACY_TASKS = ("sequence_classification", "multiple_choice", "question_answering", "image_classification")
"""Tasks with an accuracy; causal_lm has the loss only."""


@dataclass
class Evaluation:
    """One evaluation's figures."""

    loss: float
    """Mean loss per example (each batch's loss weighted by its examples)."""
    accuracy: float | None
    """Fraction of examples predicted right; None for a task without accuracy."""
    examples: int
    ms: float
    """Wall time, in ms."""
    peak_bytes: int
    """Highest live bytes on the meter while it ran."""


def correct(task: str, outputs, batch: dict) -> torch.Tensor:
    """Examples of ``batch`` predicted right, as a tensor (no device sync), for a task in
    ``ACCURACY_TASKS``: the argmax start and end positions are both the answer's (extractive QA),
    or the argmax of the logits is the label (classification, multiple choice)."""
    if task == "question_answering":
        start = outputs.start_logits.argmax(-1) == batch["start_positions"]
        end = outputs.end_logits.argmax(-1) == batch["end_positions"]
        return (start & end).sum()
    return (outputs.logits.argmax(-1) == batch["labels"]).sum()


def _rng_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []


def evaluate(model: torch.nn.Module, batches, task: str, *, device: torch.device, meter: Meter,
             autocast=contextlib.nullcontext) -> Evaluation:
    """Evaluate ``model`` on ``batches`` (CPU batches of the task's format; ``build_eval_loader``)
    and put it back in the mode it was in. ``autocast()`` is the training step's autocast context."""
    was_training = model.training
    synchronize(device)
    start = time.perf_counter()
    with torch.random.fork_rng(devices=_rng_devices(device)), meter.step() as mem:
        model.eval()
        try:
            loss_sum, hits, examples = _forward_all(model, batches, task, device, meter, autocast)
        finally:
            model.train(was_training)
    synchronize(device)
    ms = (time.perf_counter() - start) * 1e3
    accuracy = hits.item() / examples if task in ACCURACY_TASKS else None
    return Evaluation(loss_sum.item() / examples, accuracy, examples, ms, mem.peak_bytes)


def _forward_all(model, batches, task: str, device: torch.device, meter: Meter, autocast) -> tuple:
    """(loss summed over examples, examples predicted right, examples) of every batch, the sums
    kept on the device until the end (one sync)."""
    loss_sum = torch.zeros((), device=device)
    hits = torch.zeros((), dtype=torch.long, device=device)
    examples = 0
    for cpu_batch in batches:
        batch = {k: v.to(device, non_blocking=True) for k, v in cpu_batch.items()}
        meter.track(batch)
        with torch.no_grad(), autocast():
            outputs = model(**batch)
            size = len(model_input(batch))
            loss_sum += outputs.loss.float() * size
            if task in ACCURACY_TASKS:
                hits += correct(task, outputs, batch)
        examples += size
    return loss_sum, hits, examples


def eval_line(step: int, result: Evaluation) -> str:
    """The line the live view and the plain log print for an evaluation after ``step``."""
    accuracy = "" if result.accuracy is None else f", accuracy {result.accuracy:.4f}"
    return (f"eval after step {step}: loss {result.loss:.4f}{accuracy} "
            f"({result.examples} examples, {result.ms / 1e3:.1f} s)")
