"""One step's record: what ``metrics.jsonl`` holds per micro-batch, and the only code that writes
or reads that file's lines.

A step that ran out of memory for good is a record of the same shape: the figures only a
finished step has are None (null in the file), ``oom`` is set and ``error`` says why. Every line
has every key; the keys are the ones the file has always had (``memory/peak_bytes`` for
``peak_bytes``...), so old run directories (whose out-of-memory lines lack some) still read. A
plan is one choice per block (``blocks.CHOICES``); the previous release wrote it as four fields
(``plan`` the blocks checkpointed, ``selective``, ``partial``, ``offload``), converted on reading
here, as are the lines of ``plans.jsonl`` (``plan_line``, ``read_plans``).
"""

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from mimose_cli.files import read_jsonl
from mimose_cli.planners.blocks import CHECKPOINTED, OFFLOAD, PARTIAL_LEVELS, SELECTIVE, plan_of_fields


@dataclass(kw_only=True)
class RankFigures:
    """One rank's own figures for a micro-batch of a multi-process run (``StepRecord.ranks``)."""

    rank: int
    input_shape: list | None = None
    loss: float | None = None
    iter_ms: float = 0.0
    peak_bytes: int | None = None
    fwd_bwd_peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    plan: list = field(default_factory=list)
    phase: str | None = None
    retries: int = 0
    oom: bool = False


@dataclass(kw_only=True)
class StepRecord:
    """One micro-batch's forward and backward (and the optimizer step after the last one)."""

    step: int
    """Optimizer step this micro-batch belongs to, from 0."""
    micro_step: int = 0
    """Index of the micro-batch within the step's ``gradient_accumulation_steps``."""
    input_shape: list | None = None
    """Shape of the batch's ``input_ids``."""
    input_size: list | None = None
    """The size the planner planned for (``infer_input_size``); None when it never planned."""
    loss: float | None = None
    """The micro-batch's loss, before scaling for accumulation."""
    lr: float | None = None
    """Learning rate this step's update uses."""
    iter_ms: float = 0.0
    """Wall time of forward, backward and the optimizer step, in ms (0.0 for a step that ran out
    of memory)."""
    peak_bytes: int | None = None
    """Highest live bytes during the step, optimizer step included (``memory/peak_bytes``)."""
    fwd_bwd_peak_bytes: int | None = None
    """Highest live bytes before the optimizer step: what the planner plans for
    (``memory/fwd_bwd_peak_bytes``)."""
    start_bytes: int | None = None
    """Live bytes when the step began (``memory/start_bytes``)."""
    activation_bytes: int | None = None
    """Bytes the forward saved for backward (``memory/activation_bytes``)."""
    plan: list = field(default_factory=list)
    """One choice per block (``blocks.CHOICES``): keep, selective (its compute-heavy ops' outputs
    kept), partial1-3 (only the first of them: "partial1" keeps the most), recompute (DTR: evicted)
    or offload (what it saves held in host memory until backward)."""
    num_blocks: int | None = None
    """Blocks the planner chooses from."""
    planner_ms: float | None = None
    """Time the planner took to decide, in ms."""
    phase: str | None = None
    """The planner's phase (Mimose: sheltered, measuring, responsive; recovery after a retry)."""
    cache_hit: bool | None = None
    """Whether the plan came from the plan cache (None: the planner has none)."""
    predicted_peak_bytes: int | None = None
    """The step peak the planner predicted for its plan (None: it cannot say)."""
    reached_bytes: int | None = None
    """Bytes the last failed attempt was holding when it ran out of memory (out of memory only)."""
    retries: int = 0
    """Attempts of this step that ran out of memory and were retried on the same batch."""
    excluded_ms: float | None = None
    """Part of ``iter_ms`` that is the planner's measuring, not training (the oracle's), in ms."""
    recompute_ms: float | None = None
    """Time spent recomputing checkpointed blocks in backward, in ms."""
    oom: bool = False
    """Whether the step ran out of memory on every attempt (the run ends with it)."""
    error: str | None = None
    """First line of the out-of-memory error (out of memory only)."""
    reserved_peak_bytes: int | None = None
    """Peak bytes the CUDA caching allocator reserved (``memory/reserved_peak_bytes``; CUDA only)."""
    host_peak_bytes: int | None = None
    """Peak bytes the step's offloaded copies held in host memory (``memory/host_peak_bytes``; None:
    the step offloaded nothing). Not in the budget, which is the device's."""
    epoch: int | None = None
    """Pass over the data set, from 0 (set by the training loop)."""
    eval_loss: float | None = None
    """Mean loss per example on the validation split, evaluated after this step's optimizer step
    (every ``training.eval_every`` steps and after the last); None on the other steps."""
    eval_accuracy: float | None = None
    """Fraction of the validation examples predicted right in that evaluation (``evaluate.py``);
    None also for a task without accuracy (causal_lm)."""
    eval_ms: float | None = None
    """Wall time of that evaluation, in ms; not part of ``iter_ms``."""
    eval_peak_bytes: int | None = None
    """Highest live bytes during that evaluation (``memory/eval_peak_bytes``)."""
    rank: int | None = None
    """Multi-process runs: the rank whose figures these are, the one with the highest peak (or
    the one out of memory); ``loss`` is the mean over the ranks, ``retries`` their sum, ``oom``
    whether any rank ran out, ``iter_ms`` the slowest rank's. None for one process."""
    ranks: list[RankFigures] | None = None
    """Multi-process runs: every rank's own figures, in rank order. None for one process."""

    def blocks(self, kind: str) -> int:
        """How many blocks the plan gives a choice of ``kind`` (``CHOICE_KINDS``: checkpointed,
        selective, partial, offload)."""
        return sum(choice in CHOICE_KINDS[kind] for choice in self.plan)

    @property
    def train_ms(self) -> float:
        """``iter_ms`` less ``excluded_ms``: the step's time as training, in ms."""
        return self.iter_ms - (self.excluded_ms or 0.0)

    def to_json(self) -> dict:
        """The record as a ``metrics.jsonl`` line's object, with that file's keys."""
        return {_key(name): value for name, value in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict) -> "StepRecord":
        """Parse a ``metrics.jsonl`` object; keys an older file lacks take their defaults and keys
        this version does not know are ignored. A missing ``step`` or a value of the wrong type
        raises ValueError naming the key."""
        names = {_key(f.name): f.name for f in fields(cls)}
        data = _with_plan(data, data.get("num_blocks"))
        try:
            record = _RECORD.validate_python({names[key]: value for key, value in data.items() if key in names})
        except ValidationError as err:
            first = err.errors()[0]
            key = _key(str(first["loc"][0])) if first["loc"] else "?"
            if first["type"] == "missing":
                raise ValueError(f"key {key!r} is missing") from None
            msg = first["msg"]
            expected = msg.removeprefix("Input should be ") if msg.startswith("Input should be ") else (
                "a value of the size a run writes")
            raise ValueError(f"{key}={first['input']!r} is invalid; expected {expected}") from None
        missing = [name for name in COMPLETED_STEP_KEYS if getattr(record, name) is None]
        if not record.oom and missing:
            raise ValueError(f"key {_key(missing[0])!r} is missing (every completed step has it)")
        _check_values(record)
        return record


CHOICE_KINDS = {"checkpointed": CHECKPOINTED, "selective": (SELECTIVE,), "partial": PARTIAL_LEVELS,
                "offload": (OFFLOAD,)}
"""The choices ``StepRecord.blocks`` counts under each name (the views' columns)."""
_OLD_FIELDS = ("selective", "offload", "partial")
"""The fields beside ``plan`` the previous release wrote a plan in."""


def _with_plan(data: dict, num_blocks, empty_is_old: bool = False) -> dict:
    """``data`` (a ``metrics.jsonl`` or ``plans.jsonl`` object) with its plan, and its ranks',
    one choice per block: the previous release's four fields (``plan`` the indices of the blocks
    checkpointed) converted (``blocks.plan_of_fields``), and dropped; with ``empty_is_old`` an empty
    plan is the previous release's too (``plans.jsonl``: a record never planned has none). ValueError
    for a plan of neither form."""
    plan = data.get("plan")
    old_line = _indices(plan) or empty_is_old and plan == [] or any(name in data for name in _OLD_FIELDS)
    ranks = data.get("ranks")
    if isinstance(ranks, list) and (old_line or any(isinstance(r, dict) and _indices(r.get("plan")) for r in ranks)):
        # An old line's ranks' plans are old too (indices alone): an empty one kept every block.
        ranks = [_with_plan(rank, num_blocks, empty_is_old=True) if isinstance(rank, dict) else rank for rank in ranks]
        data = {**data, "ranks": ranks}
    if not old_line:
        return data
    if plan == [] and data.get("input_size", ()) is None:  # out of memory before any plan: none, as now
        return {key: value for key, value in data.items() if key not in _OLD_FIELDS}
    old = {name: data.get(name) or [] for name in _OLD_FIELDS}
    try:
        if num_blocks is None:  # a line without it (plans.jsonl): as many blocks as it names
            num_blocks = max([*plan, *old["selective"], *old["offload"], *(i for i, _ in old["partial"])], default=-1) + 1
        converted = plan_of_fields(num_blocks, plan or (), old["selective"], old["offload"], old["partial"])
    except (TypeError, IndexError, ValueError):
        raise ValueError(f"plan={plan!r} is invalid; expected one choice per block") from None
    return {**{key: value for key, value in data.items() if key not in _OLD_FIELDS}, "plan": list(converted)}


def _indices(plan) -> bool:
    """Whether ``plan`` is the previous release's: block indices (none of them a choice)."""
    return isinstance(plan, list) and any(not isinstance(choice, str) for choice in plan)


_MAX_BYTES = 2**60
"""More than any device holds: a byte figure above it is not one a run writes."""
_BYTES = ("peak_bytes", "fwd_bwd_peak_bytes", "start_bytes", "activation_bytes", "predicted_peak_bytes",
          "reached_bytes", "reserved_peak_bytes", "host_peak_bytes", "eval_peak_bytes")
_MS = ("iter_ms", "planner_ms", "excluded_ms", "recompute_ms", "eval_ms")
_COUNTS = ("step", "micro_step", "retries", "num_blocks", "epoch")


def _check_values(record: "StepRecord") -> None:
    """Values no run writes (a negative, absurd or non-finite figure) raise ValueError naming the key."""
    for name in _BYTES:
        value = getattr(record, name)
        if value is not None and not 0 <= value <= _MAX_BYTES:
            raise ValueError(f"{_key(name)}={value!r} is invalid; expected bytes between 0 and 2**60")
    for name in _MS:
        value = getattr(record, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value!r} is invalid; expected milliseconds, finite and >= 0")
    for name in _COUNTS:
        value = getattr(record, name)
        if value is not None and value < 0:
            raise ValueError(f"{name}={value!r} is invalid; expected a count >= 0")


COMPLETED_STEP_KEYS = ("loss", "peak_bytes")
"""Figures every step that did not run out of memory has (summaries and reports use them)."""
_MEMORY = frozenset({"peak_bytes", "fwd_bwd_peak_bytes", "start_bytes", "activation_bytes", "reserved_peak_bytes",
                     "host_peak_bytes", "eval_peak_bytes"})


def _key(name: str) -> str:
    return f"memory/{name}" if name in _MEMORY else name


def completed_step(info, *, step: int, micro_step: int, input_shape, num_blocks: int, loss: float,
                   lr: float, iter_ms: float, peak_bytes: int, fwd_bwd_peak_bytes: int, start_bytes: int,
                   activation_bytes: int, reserved_peak_bytes: int | None = None,
                   host_peak_bytes: int | None = None) -> StepRecord:
    """The record of a step that finished, from the planner's ``StepInfo`` and the measurements."""
    return StepRecord(
        step=step, micro_step=micro_step, input_shape=list(input_shape), input_size=list(info.input_size),
        loss=loss, lr=lr, iter_ms=iter_ms, peak_bytes=peak_bytes, fwd_bwd_peak_bytes=fwd_bwd_peak_bytes,
        start_bytes=start_bytes, activation_bytes=activation_bytes, plan=list(info.plan), num_blocks=num_blocks, planner_ms=info.planning_ms,
        phase=info.phase, cache_hit=info.cache_hit,
        predicted_peak_bytes=info.predicted_peak_bytes, retries=info.retries, excluded_ms=info.excluded_ms,
        recompute_ms=info.recompute_ms, reserved_peak_bytes=reserved_peak_bytes,
        host_peak_bytes=host_peak_bytes if OFFLOAD in info.plan else None)


def oom_step(info, error: Exception, *, step: int, micro_step: int, input_shape, num_blocks: int,
             peak_bytes: int) -> StepRecord:
    """The record of a step that ran out of memory for good; ``info`` is the planner's last
    ``StepInfo`` (None when it never planned). A ``PlanOutOfMemoryError`` carries the prediction,
    the bytes reached and the retries made (read off the error so that ``mimose report``, which
    reads records, does not import torch)."""
    return StepRecord(
        step=step, micro_step=micro_step, input_shape=list(input_shape),
        input_size=list(info.input_size) if info else None, peak_bytes=peak_bytes,
        plan=list(info.plan) if info else [], num_blocks=num_blocks, phase=info.phase if info else None, cache_hit=info.cache_hit if info else None,
        predicted_peak_bytes=getattr(error, "predicted_bytes", info.predicted_peak_bytes if info else None),
        reached_bytes=getattr(error, "reached_bytes", None),
        retries=getattr(error, "retries", 0),
        oom=True, error=str(error).splitlines()[0])


_RECORD = TypeAdapter(StepRecord)


def read_records(path) -> list:
    """The ``StepRecord``s of a ``metrics.jsonl``; a torn last line (an interrupted run) is
    skipped, any other bad line raises ValueError naming the file and the record."""
    records, seen = [], {}
    for number, data in enumerate(read_jsonl(Path(path)), 1):
        try:
            record = StepRecord.from_json(data)
        except ValueError as err:
            raise ValueError(f"{path} record {number}: {err}; the file is corrupt") from None
        where = (record.step, record.micro_step)
        if where in seen:  # a run records each micro-batch once (a resume cuts what it trains again)
            raise ValueError(f"{path} record {number}: step {record.step} micro_step {record.micro_step} "
                             f"again (first as record {seen[where]}); the file is corrupt")
        if records and not _follows(records[-1], record):
            raise ValueError(f"{path} record {number}: step {record.step} micro_step {record.micro_step} after "
                             f"step {records[-1].step} micro_step {records[-1].micro_step} (a run records its "
                             "micro-batches in order, none left out); the file is corrupt")
        seen[where] = number
        records.append(record)
    return records


def _follows(before: StepRecord, record: StepRecord) -> bool:
    """Whether ``record`` is the micro-batch a run records next after ``before``."""
    return ((record.step == before.step and record.micro_step == before.micro_step + 1)
            or (record.step == before.step + 1 and record.micro_step == 0))


def plan_line(record: StepRecord) -> dict:
    """A record's line in ``plans.jsonl``: its step, input size and plan."""
    return {"step": record.step, "micro_step": record.micro_step, "input_size": record.input_size,
            "plan": record.plan}


def read_plans(path, num_blocks: int) -> list:
    """The lines of a ``plans.jsonl`` (``plan_line``), a plan of the previous release's four fields
    as one choice per block of ``num_blocks`` (its lines do not say how many; ``metrics.jsonl``'s do);
    a torn last line is skipped."""
    return [_with_plan(data, num_blocks, empty_is_old=True) for data in read_jsonl(Path(path))]


def rank_figures(record: StepRecord, rank: int) -> RankFigures:
    """A rank's own record as its entry in the merged record's ``ranks``."""
    return RankFigures(rank=rank, input_shape=record.input_shape, loss=record.loss, iter_ms=record.iter_ms,
                       peak_bytes=record.peak_bytes, fwd_bwd_peak_bytes=record.fwd_bwd_peak_bytes,
                       predicted_peak_bytes=record.predicted_peak_bytes, plan=record.plan, phase=record.phase,
                       retries=record.retries, oom=record.oom)


def merge_ranks(records: list) -> StepRecord:
    """One micro-batch's record from every rank's (in rank order): the worst rank's figures (out
    of memory first, else the highest peak) with the global loss (the ranks' losses weighted by
    their rows), the slowest rank's time, the retries of all and every rank's own figures."""
    worst = max(range(len(records)), key=lambda r: (records[r].oom, records[r].peak_bytes or 0, -r))
    merged = replace(records[worst])  # a copy: the rank's own record stays as it was
    merged.rank, merged.ranks = worst, [rank_figures(record, rank) for rank, record in enumerate(records)]
    merged.oom = any(record.oom for record in records)
    merged.retries = sum(record.retries for record in records)
    merged.iter_ms = max(record.iter_ms for record in records)
    if not merged.oom:
        rows = [record.input_shape[0] for record in records]
        merged.loss = math.fsum(r * record.loss for r, record in zip(rows, records)) / sum(rows)
    if merged.error is not None:
        merged.error = f"rank {worst}: {merged.error}"
    return merged
