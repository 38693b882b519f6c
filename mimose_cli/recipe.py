"""Recipes: typed, strict configuration read from YAML.

Precedence: dataclass defaults < YAML file < ``key=value`` overrides < explicit CLI flags.
Every mistake raises ``RecipeError`` naming the file, the key, the value and what was expected,
before anything is built.
"""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mimose_cli.units import parse_size

TASKS = ("multiple_choice", "question_answering", "sequence_classification", "causal_lm")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16", "fp16")
SIZE_KEYS = ("budget", "planner.safety_margin")


class RecipeError(ValueError):
    """A recipe that cannot be run; the message names file, key, value and what was expected."""


@dataclass
class ModelConfig:
    type: str = "bert"
    """Hugging Face model type: bert, roberta, xlnet, gpt2, ..."""
    size: str = "tiny"
    """Size preset: 'tiny' (CPU tests) or 'base' (the published base size)."""
    pretrained: typing.Optional[str] = None
    """Local directory or hub id to load weights from; random init when unset."""
    config_overrides: dict = field(default_factory=dict)
    """Hugging Face config fields to override, e.g. {num_hidden_layers: 4}."""
    attn_implementation: typing.Optional[str] = None
    """'eager' or 'sdpa'; the library default when unset."""
    blocks: typing.Optional[str] = None
    """Glob over module names selecting the checkpointable blocks, e.g. 'bert.encoder.layer.*'."""


@dataclass
class DataConfig:
    source: str = "synthetic"
    """'synthetic' (generated, no download) or 'hf' (a Hugging Face data set or local files)."""
    preset: str = "swag"
    """Synthetic length distribution: swag, squad or qqp."""
    num_examples: int = 1024
    """Synthetic: how many examples to generate."""
    max_length: int = 512
    """Longest tokenized example; longer ones are truncated."""
    length_mean: typing.Optional[float] = None
    """Synthetic: override the preset's mean token length."""
    length_std: typing.Optional[float] = None
    """Synthetic: override the preset's standard deviation of token length."""
    min_length: typing.Optional[int] = None
    """Synthetic: override the preset's shortest token length."""
    num_choices: int = 4
    """Multiple choice: choices per example."""
    num_labels: int = 2
    """Sequence classification: number of classes."""
    name: typing.Optional[str] = None
    """hf: data set name on the hub, or a local json/csv/parquet file or directory."""
    config_name: typing.Optional[str] = None
    """hf: data set configuration (e.g. 'regular' for swag)."""
    split: str = "train"
    """hf: split to train on."""
    tokenizer: typing.Optional[str] = None
    """hf: tokenizer by local path or hub id (defaults to model.pretrained)."""
    text_fields: list = field(default_factory=list)
    """hf: column names holding the text (one, or two for sentence pairs)."""
    label_field: typing.Optional[str] = None
    """hf: column holding the label."""
    group_by_length: bool = False
    """Batch examples of similar length together (HF Trainer's group_by_length)."""
    shuffle: bool = True
    """Shuffle example order each epoch (seeded)."""


@dataclass
class TrainingConfig:
    batch_size: int = 16
    """Examples per mini-batch."""
    max_steps: typing.Optional[int] = None
    """Stop after this many optimizer steps (overrides epochs)."""
    epochs: int = 1
    """Passes over the data when max_steps is unset."""
    lr: float = 5e-5
    """Peak AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    max_grad_norm: typing.Optional[float] = 1.0
    """Gradient clipping norm; null disables clipping."""
    precision: str = "fp32"
    """fp32, or bf16 / fp16 autocast on the run's device (CUDA, or the CPU's own autocast)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (each planned on its own; batch_size is per micro-batch)."""
    log_every: int = 1
    """Print a plain progress line every N steps when stdout is not a terminal."""


@dataclass
class PlannerConfig:
    name: str = "mimose"
    """Planner: mimose, none, full, sublinear, dtr, oracle."""
    sheltered_steps: int = 5
    """Mimose: iterations of the sheltered (collecting) phase."""
    safety_margin: str = "auto"
    """Budget headroom kept free for fragmentation (a byte size); auto: 5 % of the budget on
    CUDA (the caching allocator's rounding and fragmentation), 0 on the simulated device."""
    granularity: int = 1
    """Mimose: plan-cache key rounds the sequence length up to a multiple of this (1: every
    length planned exactly; larger values raise the hit rate but plan at the rounded-up size)."""
    options: dict = field(default_factory=dict)
    """Planner-specific options."""


@dataclass
class Recipe:
    task: str = "multiple_choice"
    """multiple_choice, question_answering, sequence_classification or causal_lm."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    budget: typing.Optional[str] = None
    """Device memory the training step may use, e.g. '6GB'; unlimited when unset."""
    device: str = "auto"
    """auto, cpu or cuda."""
    seed: int = 0
    """Seed for model init, data generation and data order."""
    out_dir: str = "runs"
    """Where run directories are created."""

    @property
    def budget_bytes(self) -> typing.Optional[int]:
        return None if self.budget is None else parse_size(self.budget)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value, tp, where: str, key: str):
    """Check ``value`` against the annotation ``tp``; return it (ints accepted for floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where, key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: {key}={value!r} is invalid; expected a mapping of {tp.__name__} fields")
        return _build(tp, value, where, key + ".")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if key in SIZE_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # a bare number of bytes
    if tp is bool and not isinstance(value, bool):
        raise RecipeError(f"{where}: {key}={value!r} is invalid; expected true or false")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise RecipeError(f"{where}: {key}={value!r} is invalid; expected an integer")
    if not isinstance(value, tp):
        raise RecipeError(f"{where}: {key}={value!r} is invalid; expected {_type_name(tp)}")
    return value


def _build(cls, data: dict, where: str, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise RecipeError(
            f"{where}: unknown key {prefix}{unknown[0]!s}; expected one of {', '.join(names)}"
        )
    kwargs = {k: _coerce(v, hints[k], where, prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def _check_values(recipe: Recipe, where: str) -> None:
    def bad(key, value, expected):
        raise RecipeError(f"{where}: {key}={value!r} is invalid; expected {expected}")

    if recipe.task not in TASKS:
        bad("task", recipe.task, " | ".join(TASKS))
    if recipe.device not in DEVICES:
        bad("device", recipe.device, " | ".join(DEVICES))
    if recipe.training.precision not in PRECISIONS:
        bad("training.precision", recipe.training.precision, " | ".join(PRECISIONS))
    if recipe.model.size not in ("tiny", "base"):
        bad("model.size", recipe.model.size, "tiny | base")
    if recipe.data.source not in ("synthetic", "hf"):
        bad("data.source", recipe.data.source, "synthetic | hf")
    if recipe.data.source == "synthetic" and recipe.data.preset not in ("swag", "squad", "qqp"):
        bad("data.preset", recipe.data.preset, "swag | squad | qqp")
    if recipe.data.source == "hf" and not recipe.data.name:
        bad("data.name", recipe.data.name, "a data set name or local file when data.source is hf")
    for key in ("training.batch_size", "training.epochs", "data.num_examples", "data.max_length",
                "data.num_choices", "data.num_labels", "training.log_every",
                "training.gradient_accumulation_steps",
                "planner.granularity"):
        section, name = key.split(".")
        value = getattr(getattr(recipe, section), name)
        if value < 1:
            bad(key, value, "an integer >= 1")
    for key, value in (("training.max_steps", recipe.training.max_steps),
                       ("training.warmup_steps", recipe.training.warmup_steps),
                       ("planner.sheltered_steps", recipe.planner.sheltered_steps)):
        if value is not None and value < 0:
            bad(key, value, "an integer >= 0")
    if recipe.training.lr <= 0:
        bad("training.lr", recipe.training.lr, "a positive learning rate")
    for key, value in (("budget", recipe.budget), ("planner.safety_margin", recipe.planner.safety_margin)):
        if value is None or (key == "planner.safety_margin" and value == "auto"):
            continue
        try:
            parse_size(value, allow_zero=(key != "budget"))
        except ValueError:
            bad(key, value, "a byte size such as '6GB', '6GiB', '512MB' or '0.5GiB'")
    from mimose_cli.planners import PLANNERS  # local: planners import torch

    if recipe.planner.name not in PLANNERS:
        bad("planner.name", recipe.planner.name, " | ".join(sorted(PLANNERS)))


def _parse_override(text: str):
    if "=" not in text:
        raise RecipeError(f"override {text!r}: expected key=value, e.g. training.max_steps=20")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def _set_dotted(data: dict, key: str, value, where: str) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"{where}: {key!r} goes inside {part!r}, which is not a section")
        node = child
    node[parts[-1]] = value


def recipe_from_dict(data: dict, where: str = "<recipe>", overrides=(), flags=None) -> Recipe:
    """Build and validate a Recipe from a mapping, overrides ``key=value`` and flag values."""
    data = yaml.safe_load(yaml.safe_dump(data or {}))  # deep copy, plain types
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
    for text in overrides:
        key, value = _parse_override(text)
        _set_dotted(data, key, value, f"{where} (override {text!r})")
    for key, value in (flags or {}).items():
        if value is not None:
            _set_dotted(data, key, value, f"{where} (flag)")
    recipe = _build(Recipe, data, where)
    _check_values(recipe, where)
    return recipe


def load_recipe(path, overrides=(), flags=None) -> Recipe:
    """Read a YAML recipe file, apply ``key=value`` overrides, then explicit flags."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {err}") from err
    return recipe_from_dict(data, str(path), overrides, flags)


def recipe_to_dict(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)


def save_recipe(recipe: Recipe, path) -> None:
    """Write the resolved recipe; ``mimose train`` on this file re-runs the same run."""
    Path(path).write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
