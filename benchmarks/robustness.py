"""Does Mimose keep every step inside the budget across models, training settings and budgets?

A matrix of tiny models (random init, 4 blocks, hidden 64, vocabulary 1000) x training settings
x 3 budgets, each on the simulated CPU device (an exact count of live storages that raises
out-of-memory past the budget):

- models: BERT (sequence classification), RoBERTa (multiple choice, 2 choices), XLNet (sequence
  classification), GPT-2 and Llama (causal LM), T5 (conditional generation; 4 encoder + 4 decoder
  blocks, target lengths varying independently of the inputs; ``t5`` as configured by default,
  ``t5-nocache`` with ``use_cache=False``, see MODELS), ViT (image classification, the
  image side varying per batch, 32-96 px in multiples of the 8 px patch, with
  ``interpolate_pos_encoding=True``; ``vit16``: 6 blocks, 16 px patches, sides 64-224 px in steps
  of 16), ResNet (image classification, bottleneck stages of 2, 3,
  6 and 2 layers, all 13 of them blocks, BatchNorm in each; sides 32-160 px in multiples of 32),
  CLIP (two towers of 4 blocks each, texts of the lengths below with 32 px images, contrastive
  loss: a batch with several inputs);
- settings: fp32; bf16 and fp16 autocast around the forward (fp16 with a GradScaler); lengths
  padded up to a multiple of 128 (images: the side up to a multiple of 32 px); gradient
  accumulation over 4 micro-batches (gradients alive at the start of 3 in 4); a batch size
  drawn per step from 2..8 (else 4);
- budgets: 25 %, 50 % and 75 % of the way from the largest step peak of ``full`` checkpointing
  to that of ``none``, both measured first without a budget on the same batches (every batch
  fits with every block checkpointed, so zero out-of-memory steps is always possible).

Lengths are lognormal (mean 64, std 48 tokens) clipped to 16..256, each batch padded to its
longest example; every planner sees the same batches and the same dropout seed. The step peak
is measured around forward+backward (the planned region); the AdamW step runs after it, and an
out-of-memory there is counted too. Every step runs through ``planner.run`` (out-of-memory
recovery: a failed step is retried on the same batch). Figures per cell, with targets:
out-of-memory steps that recovery could not save (0), retries (0), the step-peak prediction error
(predicted - measured) / measured over responsive steps (most negative and largest magnitude,
<= 2 %), mean peak / budget where the budget binds (a non-empty plan, >= 90 %), the largest
absolute loss difference to the ``none`` run before the cell's first out-of-memory step (0.0,
bit-identical), and Mimose's own counters. A cell that cannot run says why in one line.
Writes benchmarks/results/robustness.json.

    python benchmarks/robustness.py [--steps 100] [--models bert,t5] [--settings fp32,accum4]
    python benchmarks/robustness.py --quick      # a few steps of a subset, about a minute
    python benchmarks/robustness.py --models vit16 --settings fp32 --steps 40 --results robustness_vit16
    python benchmarks/robustness.py --jobs 2     # (model, setting) pairs in 2 processes
    python benchmarks/robustness.py --choices selective   # Mimose's finer plans (robustness_selective.json)
    python benchmarks/robustness.py --choices offload     # offload among them too (robustness_offload.json)
    python benchmarks/robustness.py --meter allocator     # on the counting CPU allocator (robustness_allocator.json)
"""

import argparse
import contextlib
import multiprocessing
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import get_args

import numpy as np
import torch
import transformers

from mimose_cli.launcher.data.synthetic import data_rng, sample_lengths
from mimose_cli.memory import build_meter
from mimose_cli.planners import build_planner
from mimose_cli.planners.blocks import KEEP, OFFLOAD, PARTIAL_LEVELS, SELECTIVE
from mimose_cli.planners.options import ChoiceSet

from _results import write_results

SEED = 0
VOCAB = 1000
FIRST_CONTENT_ID = 16  # below: pad/bos/eos and other special ids of the configs
BUDGET_FRACTIONS = (0.25, 0.5, 0.75)
LENGTHS = dict(mean=64.0, std=48.0, min_length=16, max_length=256)
TARGET_LENGTHS = dict(mean=24.0, std=16.0, min_length=4, max_length=128)  # T5's labels
IMAGE_SIDES_PX = tuple(range(32, 97, 8))
CNN_SIDES_PX = tuple(range(32, 161, 32))
"""A CNN's images: sides in multiples of its stride, 32 px, as a CNN pipeline crops them (the
probes are exact there; other sides are measured, docs/MIMOSE.md)."""
TARGETS = {"oom_steps": 0, "retries": 0, "pred_err_max_abs_pct": 2.0,
           "binding_peak_mean_pct": 90.0, "loss_max_abs_diff": 0.0}
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=128)

T5 = dict(model_type="t5", vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=4, num_decoder_layers=4,
          num_heads=4, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


@dataclass(frozen=True)
class ModelSpec:
    cls: str
    """The transformers class, by name."""
    kind: str
    """What its batches hold: classify, choice, causal, seq2seq, image or twotower (texts with
    their images)."""
    config: dict
    """``AutoConfig.for_model`` keywords, ``model_type`` included."""
    sides: tuple = ()
    """Image sides to draw from (default ``IMAGE_SIDES_PX``)."""


MODELS = {
    "bert": ModelSpec("BertForSequenceClassification", "classify", dict(model_type="bert", **TINY)),
    "roberta": ModelSpec("RobertaForMultipleChoice", "choice",
                         dict(model_type="roberta", **TINY, max_position_embeddings=514, type_vocab_size=1)),
    "xlnet": ModelSpec("XLNetForSequenceClassification", "classify",
                       dict(model_type="xlnet", vocab_size=VOCAB, d_model=64, n_layer=4, n_head=4,
                            d_inner=128, mem_len=None)),
    "gpt2": ModelSpec("GPT2LMHeadModel", "causal",
                      dict(model_type="gpt2", vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4,
                           n_positions=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "llama": ModelSpec("LlamaForCausalLM", "causal",
                       dict(model_type="llama", **TINY, max_position_embeddings=512,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "t5": ModelSpec("T5ForConditionalGeneration", "seq2seq", T5),
    # The planners turn use_cache off on model.config only; T5's decoder stack has its own copy
    # of the config, and with it on, decoder blocks fill a key/value cache in place, so their
    # recompute differs from their forward. Off here too, so that T5 can be measured at all.
    "t5-nocache": ModelSpec("T5ForConditionalGeneration", "seq2seq", {**T5, "use_cache": False}),
    # Two towers (text and 32 px images) with a contrastive loss: a batch with several inputs.
    "clip": ModelSpec("CLIPModel", "twotower",
                      dict(model_type="clip", projection_dim=32,
                           text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=256,
                                            pad_token_id=0, bos_token_id=1, eos_token_id=2),
                           vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                              num_attention_heads=4, image_size=32, patch_size=8))),
    "vit": ModelSpec("ViTForImageClassification", "image",
                     dict(model_type="vit", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                          intermediate_size=128, image_size=32, patch_size=8, num_labels=10)),
    # Patches of 16 px, sides 64-224 px in steps of 16: trusted at multiples of the patch (read from
    # the probes' shapes), not only at multiples of 32.
    "vit16": ModelSpec("ViTForImageClassification", "image",
                       dict(model_type="vit", hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                            intermediate_size=128, image_size=224, patch_size=16, num_labels=10),
                       sides=tuple(range(64, 225, 16))),
    # Bottleneck stages of 2, 3, 6 and 2 layers: every stage's layers are blocks (13), though
    # transformers has no checkpointing of its own for it.
    "resnet": ModelSpec("ResNetForImageClassification", "image",
                        dict(model_type="resnet", embedding_size=16, hidden_sizes=[16, 32, 64, 128],
                             depths=[2, 3, 6, 2], layer_type="bottleneck", num_labels=10),
                        sides=CNN_SIDES_PX),
}


@dataclass(frozen=True)
class Setting:
    precision: str = "fp32"
    """fp32, or the autocast dtype around the forward: bf16 or fp16."""
    pad_multiple: int = 1
    """Token lengths padded up to a multiple of this (image sides: of 32 px when > 1)."""
    accumulation: int = 1
    """Micro-batches per optimizer step."""
    batch_sizes: tuple = (4, 4)
    """Each step's batch size is drawn uniformly from this inclusive range."""


SETTINGS = {"fp32": Setting(), "bf16": Setting(precision="bf16"), "fp16": Setting(precision="fp16"),
            "pad128": Setting(pad_multiple=128), "accum4": Setting(accumulation=4),
            "varbatch": Setting(batch_sizes=(2, 8))}


@dataclass(frozen=True)
class Shape:
    """One batch's shape: per-example lengths (for images, the side) and the padded length;
    T5's target lengths and their padded length."""

    lengths: tuple
    padded: int
    targets: tuple = ()
    targets_padded: int = 0


def _pad(lengths, multiple: int) -> int:
    return -(-int(max(lengths)) // multiple) * multiple


def batch_shapes(spec: ModelSpec, setting: Setting, steps: int) -> list:
    """The cell's batch shapes, the same for every planner (seeded by the step only)."""
    shapes = []
    for step in range(steps):
        rng = data_rng(SEED, 10, step)
        size = int(rng.integers(setting.batch_sizes[0], setting.batch_sizes[1] + 1))
        if spec.kind == "image":
            side = int(rng.choice(spec.sides or IMAGE_SIDES_PX))
            shapes.append(Shape((side,) * size, side if setting.pad_multiple == 1 else _pad([side], 32)))
            continue
        lengths = tuple(int(n) for n in sample_lengths(rng, size, **LENGTHS))
        targets = ()
        if spec.kind == "seq2seq":
            targets = tuple(int(n) for n in sample_lengths(rng, size, **TARGET_LENGTHS))
        shapes.append(Shape(lengths, _pad(lengths, setting.pad_multiple), targets,
                            _pad(targets, setting.pad_multiple) if targets else 0))
    return shapes


def _padded_ids(rng, lengths: tuple, padded: int, left: bool) -> tuple:
    ids = torch.from_numpy(rng.integers(FIRST_CONTENT_ID, VOCAB, (len(lengths), padded)))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        (mask[row, padded - n:] if left else mask[row, :n]).fill_(1)
    return ids.masked_fill(mask == 0, 0), mask


def make_batch(spec: ModelSpec, shape: Shape, step: int) -> dict:
    """The tensors of step ``step``: random ids (or pixels) and valid labels, padding masked."""
    rng = data_rng(SEED, 11, step)
    rows = len(shape.lengths)
    if spec.kind == "image":
        pixels = rng.standard_normal((rows, 3, shape.padded, shape.padded), dtype=np.float32)
        return {"pixel_values": torch.from_numpy(pixels),
                "labels": torch.from_numpy(rng.integers(0, 10, rows))}
    left = spec.config["model_type"] == "xlnet"  # XLNet reads its summary from the last position
    ids, mask = _padded_ids(rng, shape.lengths, shape.padded, left)
    if spec.kind == "choice":  # 2 choices, each of its example's length
        ids, mask = (t.repeat_interleave(2, 0).view(rows, 2, -1) for t in (ids, mask))
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.from_numpy(rng.integers(0, 2, rows))}
    batch = {"input_ids": ids, "attention_mask": mask}
    if spec.kind == "twotower":  # each text with its image; the loss contrasts the batch's pairs
        size = spec.config["vision_config"]["image_size"]
        pixels = rng.standard_normal((rows, 3, size, size), dtype=np.float32)
        return {**batch, "pixel_values": torch.from_numpy(pixels), "return_loss": True}
    if spec.kind == "classify":
        batch["labels"] = torch.from_numpy(rng.integers(0, 2, rows))
    elif spec.kind == "causal":
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    else:
        labels, target_mask = _padded_ids(rng, shape.targets, shape.targets_padded, left=False)
        batch["labels"] = labels.masked_fill(target_mask == 0, -100)
    return batch


@dataclass
class StepRecord:
    """One micro-batch of one run; ``peak_bytes`` is forward+backward's, the planned region."""

    loss: float | None
    peak_bytes: int
    predicted_peak_bytes: int | None
    plan: tuple
    phase: str | None
    retries: int = 0
    error: str | None = None
    optimizer_error: str | None = None

    @property
    def oom(self) -> bool:
        return self.loss is None


@dataclass
class Run:
    records: list
    stats: dict


@dataclass
class Trainer:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: object
    meter: object
    planner: object
    step_fn: object
    accumulation: int


def one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def build_model(spec: ModelSpec) -> torch.nn.Module:
    """The same random weights for every planner; the global RNG is left as it was."""
    config = transformers.AutoConfig.for_model(**spec.config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return getattr(transformers, spec.cls)(config).train()


def make_step_fn(model, spec: ModelSpec, setting: Setting, scaler):
    """Forward (under autocast for bf16/fp16) and backward of one micro-batch; returns the loss."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setting.precision)
    extra = {"interpolate_pos_encoding": True} if spec.config["model_type"] == "vit" else {}

    def step_fn(batch):
        with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
            loss = model(**batch, **extra).loss
        scaled = loss / setting.accumulation
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        return loss.detach()
    return step_fn


def run_step(planner, step_fn, batch) -> tuple:
    """One planned forward+backward through ``planner.run`` (out-of-memory recovery: the batch
    is retried): (loss or None when it ran out of memory for good, retries, error line)."""
    try:
        loss = planner.run(step_fn, batch)
        return float(loss), planner.last.retries, None
    except torch.OutOfMemoryError as error:
        return None, planner.policy.max_retries, one_line(error)


def optimizer_step(t: Trainer) -> str | None:
    """AdamW's step (through the scaler for fp16); the error line when it runs out of memory."""
    try:
        if t.scaler is not None:
            t.scaler.step(t.optimizer)
            t.scaler.update()
        else:
            t.optimizer.step()
        return None
    except torch.OutOfMemoryError as error:
        return one_line(error)
    finally:
        t.optimizer.zero_grad(set_to_none=True)


def train_step(t: Trainer, spec: ModelSpec, shape: Shape, step: int) -> StepRecord:
    batch = make_batch(spec, shape, step)
    t.meter.track(batch)
    with t.meter.step() as mem:
        loss, retries, error = run_step(t.planner, t.step_fn, batch)
    info = t.planner.last
    record = StepRecord(loss, mem.peak_bytes, info.predicted_peak_bytes if info else None,
                        tuple(info.plan) if info else (), info.phase if info else None, retries, error)
    if record.oom:
        t.optimizer.zero_grad(set_to_none=True)  # the lost step's partial gradients
    elif (step + 1) % t.accumulation == 0:
        record.optimizer_error = optimizer_step(t)
    return record


def train_run(spec: ModelSpec, setting: Setting, shapes: list, planner_name: str, budget_bytes,
              choices: str = "block", meter_kind: str = "simulated") -> Run:
    """Train on ``shapes`` with one planner on a fresh simulated device of ``budget_bytes``
    (Mimose's plans: ``choices``)."""
    model = build_model(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if setting.precision == "fp16" else None
    meter = build_meter(meter_kind, budget_bytes)
    with meter.activate():
        meter.track(model, optimizer)
        options = {"choices": choices} if planner_name == "mimose" else {}
        planner = build_planner(planner_name, model, budget_bytes, meter=meter, **options)
        trainer = Trainer(model, optimizer, scaler, meter, planner, make_step_fn(model, spec, setting, scaler),
                          setting.accumulation)
        if spec.kind == "image" and planner_name == "mimose":
            # As the launcher does: the probes are told the largest images, so a CNN's are probed
            # at two sides (a first batch of small ones would be probed at its own side only).
            side = max(shape.padded for shape in shapes)
            rows = max(len(shape.lengths) for shape in shapes)
            make = lambda size: make_batch(spec, Shape(lengths=(size[1],) * size[0], padded=size[1]), 0)  # noqa: E731
            planner.prepare(make, (rows, side, side), step_fn=trainer.step_fn)
        torch.manual_seed(SEED)  # the same dropout masks for every planner
        try:
            records = [train_step(trainer, spec, shape, step) for step, shape in enumerate(shapes)]
        finally:
            planner.close()
    return Run(records, planner.stats)


@dataclass
class Cell:
    """One (model, setting, budget): Mimose's figures, or why the cell could not run."""

    model: str
    setting: str
    budget_pct: int
    """Where the budget sits from full's largest step peak (0) to none's (100)."""
    budget_bytes: int | None = None
    full_peak_bytes: int | None = None
    none_peak_bytes: int | None = None
    steps: int = 0
    oom_steps: int = 0
    """Forward+backward steps out of memory (sheltered ones included)."""
    oom_sheltered_steps: int = 0
    optimizer_oom_steps: int = 0
    retries: int = 0
    first_lost_step: int | None = None
    """The first step out of memory, in forward+backward or in the optimizer step."""
    first_lost_where: str | None = None
    first_lost_error: str | None = None
    binding_steps: int = 0
    binding_peak_mean_pct: float | None = None
    selective_steps: int = 0
    """Steps whose plan checkpointed a block selectively (``--choices selective`` or ``offload``)."""
    offload_steps: int = 0
    """Steps whose plan offloaded a block (``--choices offload``)."""
    partial_steps: int = 0
    """Steps whose plan checkpointed a block partially (``features.PARTIAL_LEVELS``)."""
    predicted_steps: int = 0
    pred_err_min_pct: float | None = None
    """Most negative (predicted - measured) / measured: the worst under-prediction."""
    pred_err_max_abs_pct: float | None = None
    loss_steps_compared: int = 0
    loss_max_abs_diff: float | None = None
    """Against ``none`` without a budget, over the steps up to the first out-of-memory one."""
    mimose: dict = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None


def summarize(cell: Cell, run: Run, reference: list) -> None:
    """Fill ``cell``'s figures from Mimose's run and the ``none`` run's records."""
    records = run.records
    lost = [i for i, r in enumerate(records) if r.oom or r.optimizer_error]
    cell.steps = len(records)
    cell.oom_steps = sum(r.oom for r in records)
    cell.oom_sheltered_steps = sum(r.oom and r.phase == "sheltered" for r in records)
    cell.optimizer_oom_steps = sum(r.optimizer_error is not None for r in records)
    cell.retries = sum(r.retries for r in records)
    if lost:
        first = records[lost[0]]
        cell.first_lost_step = lost[0]
        cell.first_lost_where = f"{first.phase} fwd/bwd" if first.oom else "optimizer step"
        cell.first_lost_error = first.error or first.optimizer_error
    responsive = [r for r in records if r.phase == "responsive" and not r.oom]
    ratios = [r.peak_bytes / cell.budget_bytes for r in responsive if any(choice != KEEP for choice in r.plan)]
    cell.binding_steps = len(ratios)
    cell.selective_steps = sum(SELECTIVE in r.plan for r in records)
    cell.offload_steps = sum(OFFLOAD in r.plan for r in records)
    cell.partial_steps = sum(any(choice in PARTIAL_LEVELS for choice in r.plan) for r in records)
    cell.binding_peak_mean_pct = 100 * float(np.mean(ratios)) if ratios else None
    errors = [(r.predicted_peak_bytes - r.peak_bytes) / r.peak_bytes
              for r in responsive if r.predicted_peak_bytes is not None]
    cell.predicted_steps = len(errors)
    if errors:
        cell.pred_err_min_pct = 100 * min(errors)
        cell.pred_err_max_abs_pct = 100 * max(abs(e) for e in errors)
    clean = records[:lost[0] + 1] if lost else records  # a lost step changes the training after it
    diffs = [abs(a.loss - b.loss) for a, b in zip(clean, reference) if a.loss is not None and b.loss is not None]
    cell.loss_steps_compared = len(diffs)
    cell.loss_max_abs_diff = max(diffs) if diffs else None
    cell.mimose = run.stats


def evaluate(model_name: str, setting_name: str, steps: int, choices: str = "block",
             meter_kind: str = "simulated") -> list:
    """The three budget cells of one (model, setting): calibrate with none and full, then Mimose;
    each run on a fresh meter of ``meter_kind`` (the simulated device as a dispatch mode, or the
    counting allocator)."""
    spec, setting = MODELS[model_name], SETTINGS[setting_name]
    cells = [Cell(model_name, setting_name, round(100 * f)) for f in BUDGET_FRACTIONS]
    try:
        shapes = batch_shapes(spec, setting, steps)
        # full first: it fails where checkpointing does
        full = train_run(spec, setting, shapes, "full", None, meter_kind=meter_kind)
        none = train_run(spec, setting, shapes, "none", None, meter_kind=meter_kind)
    except Exception as error:  # a cell that cannot run says why and the matrix goes on
        for cell in cells:
            cell.error = f"calibration: {one_line(error)}"
        return [asdict(c) for c in cells]
    full_peak = max(r.peak_bytes for r in full.records)
    none_peak = max(r.peak_bytes for r in none.records)
    for cell, fraction in zip(cells, BUDGET_FRACTIONS):
        cell.full_peak_bytes, cell.none_peak_bytes = full_peak, none_peak
        cell.budget_bytes = int(full_peak + fraction * (none_peak - full_peak))
        start = time.perf_counter()
        try:
            summarize(cell, train_run(spec, setting, shapes, "mimose", cell.budget_bytes, choices, meter_kind),
                      none.records)
        except Exception as error:
            cell.error = one_line(error)
        cell.wall_s = time.perf_counter() - start
    return [asdict(c) for c in cells]


def _fmt(value, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}{spec}}"


def untrusted(stats: dict):
    """Mimose's count of predictions it did not trust, under whichever key it reports it."""
    return stats.get("untrusted_steps")


HEADER = (f"{'model':10} {'setting':8} {'bud%':>4} {'budget MB':>9} {'OOM':>4} {'shel':>4} {'opt':>3} "
          f"{'retry':>5} {'bind':>4} {'peak/bud %':>10} {'err min %':>9} {'|err| max %':>11} "
          f"{'loss diff':>9} {'unfit':>5} {'under':>5} {'untr':>4} {'warn':>4} {'sel':>4} {'part':>4} {'off':>4}  "
          "first lost step")


def table_line(row: dict) -> str:
    head = f"{row['model']:10} {row['setting']:8} {row['budget_pct']:4d}"
    if row["error"]:
        return f"{head} cannot run: {row['error'][:120]}"
    stats = row["mimose"]
    lost = "" if row["first_lost_step"] is None else f"{row['first_lost_step']} ({row['first_lost_where']})"
    return (f"{head} {row['budget_bytes'] / 1e6:9.2f} {row['oom_steps']:4d} {row['oom_sheltered_steps']:4d} "
            f"{row['optimizer_oom_steps']:3d} {row['retries']:5d} {row['binding_steps']:4d} "
            f"{_fmt(row['binding_peak_mean_pct'], '.2f', 10)} {_fmt(row['pred_err_min_pct'], '.3f', 9)} "
            f"{_fmt(row['pred_err_max_abs_pct'], '.3f', 11)} {_fmt(row['loss_max_abs_diff'], '.1e', 9)} "
            f"{stats.get('unfit_plans', 0):5d} {stats.get('underpredictions', 0):5d} "
            f"{_fmt(untrusted(stats), 'd', 4)} {len(stats.get('warnings', [])):4d} {row.get('selective_steps', 0):4d} "
            f"{row.get('partial_steps', 0):4d} {row.get('offload_steps', 0):4d}  {lost}")


def target_counts(rows: list) -> dict:
    """Per target: (cells meeting it, cells where it applies); cells that could not run excluded."""
    ran = [r for r in rows if r["steps"]]

    def met(key, ok):
        values = [r[key] for r in ran if r[key] is not None]
        return sum(ok(v) for v in values), len(values)
    return {"oom_steps": (sum(r["oom_steps"] + r["optimizer_oom_steps"] == 0 for r in ran), len(ran)),
            "retries": met("retries", lambda v: v <= TARGETS["retries"]),
            "pred_err_max_abs_pct": met("pred_err_max_abs_pct", lambda v: v <= TARGETS["pred_err_max_abs_pct"]),
            "binding_peak_mean_pct": met("binding_peak_mean_pct", lambda v: v >= TARGETS["binding_peak_mean_pct"]),
            "loss_max_abs_diff": met("loss_max_abs_diff", lambda v: v <= TARGETS["loss_max_abs_diff"])}


def summary_line(rows: list, counts: dict, wall_s: float) -> str:
    ran = [r for r in rows if r["steps"]]
    with_oom = sum(r["oom_steps"] + r["optimizer_oom_steps"] > 0 for r in ran)
    met = ", ".join(f"{key} {ok}/{n}" for key, (ok, n) in counts.items())
    return (f"cells run {len(ran)} of {len(rows)} ({len(rows) - len(ran)} could not run); cells with any OOM "
            f"{with_oom}; meeting targets: {met}; wall {wall_s / 60:.1f} min")


def _init_worker() -> None:
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    # Mimose's warnings (a size predicted not to fit) are in its stats: the table's warn column.
    warnings.filterwarnings("ignore", category=UserWarning, module="mimose_cli")


def run_matrix(pairs: list, steps: int, jobs: int, choices: str = "block", meter_kind: str = "simulated") -> list:
    """Every (model, setting) pair's cells, in matrix order; a progress line per pair."""
    _init_worker()
    if jobs == 1:
        results = []
        for pair in pairs:
            results.append(evaluate(*pair, steps, choices, meter_kind))
            print(f"done {pair[0]}/{pair[1]}", flush=True)
        return [row for cells in results for row in cells]
    # spawn: a forked torch can deadlock on the parent's thread pools
    with ProcessPoolExecutor(jobs, multiprocessing.get_context("spawn"), initializer=_init_worker) as pool:
        futures = {pool.submit(evaluate, *pair, steps, choices, meter_kind): pair for pair in pairs}
        for future in futures:
            future.add_done_callback(lambda f, pair=futures[future]: print(f"done {pair[0]}/{pair[1]}", flush=True))
        return [row for future in futures for row in future.result()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from " + ",".join(MODELS))
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, from " + ",".join(SETTINGS))
    parser.add_argument("--steps", type=int, default=100, help="micro-batches per run")
    parser.add_argument("--quick", action="store_true", help="12 steps of bert and vit in fp32 and varbatch")
    parser.add_argument("--jobs", type=int, default=1, help="processes, one (model, setting) pair each")
    parser.add_argument("--choices", default="block", choices=get_args(ChoiceSet),
                        help="Mimose's plans (planner.mimose.choices); selective writes robustness_selective.json, "
                             "offload robustness_offload.json")
    parser.add_argument("--meter", default="simulated", choices=("simulated", "allocator"),
                        help="the simulated device as a dispatch mode (default) or the counting CPU allocator; "
                             "allocator writes robustness_allocator.json")
    parser.add_argument("--results", default=None,
                        help="the results file's name (default robustness, or robustness_<choices>, "
                             "robustness_allocator)")
    args = parser.parse_args()
    if args.quick:
        args.models, args.settings, args.steps = "bert,vit", "fp32,varbatch", 12
    pairs = [(m, s) for m in args.models.split(",") for s in args.settings.split(",")]
    unknown = [name for pair in pairs for name, known in zip(pair, (MODELS, SETTINGS)) if name not in known]
    if unknown:
        parser.error(f"unknown model or setting {unknown[0]!r}; models: {','.join(MODELS)}; "
                     f"settings: {','.join(SETTINGS)}")
    start = time.perf_counter()
    rows = run_matrix(pairs, args.steps, args.jobs, args.choices, args.meter)
    wall_s = time.perf_counter() - start
    counts = target_counts(rows)
    name = args.results or "_".join(["robustness"] + [args.choices] * (args.choices != "block")
                                    + ["allocator"] * (args.meter == "allocator"))
    write_results(name, rows, steps=args.steps, jobs=args.jobs, wall_s=wall_s, choices=args.choices, meter=args.meter,
                  budget_fractions=list(BUDGET_FRACTIONS), targets=TARGETS,
                  targets_met={k: list(v) for k, v in counts.items()})
    print(HEADER)
    for row in rows:
        print(table_line(row))
    print(summary_line(rows, counts, wall_s))


if __name__ == "__main__":
    main()
