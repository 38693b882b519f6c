"""Recipes: typed, strict configuration read from YAML.

Sections are pydantic dataclasses (``extra="forbid"``, strict scalars) rather than stdlib ones
checked in ``__post_init__``, which would have kept our own type coercion: annotations, ``Literal``
choices and ``Field`` bounds are the checks, pydantic's errors carry the dotted key and the input,
and ``__post_init__`` keeps only checks across fields and byte sizes, parsed once into ``*_bytes``.

Precedence: dataclass defaults < YAML file < ``key=value`` overrides < explicit CLI flags.
Every mistake raises ``RecipeError`` naming the file, the key, the value and what was expected,
before anything is built. YAML is read by ``StrictLoader``: a key given twice, an anchor or alias,
or a ``!!python`` tag is an error, and ``1e-4`` is a number (YAML 1.2's reading).
"""

import dataclasses
import errno
import importlib.util
import re
import stat
import warnings
from collections.abc import Hashable
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import (
    AllowInfNan,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    TypeAdapter,
    ValidationError,
)
from pydantic.dataclasses import dataclass

from mimose_cli.files import write_text
from mimose_cli.launcher.data.presets import IMAGE_PRESETS, LENGTH_PRESETS, MIN_SYNTHETIC_LENGTH
from mimose_cli.planners.options import (
    EveryNOptions,
    OptionError,
    FullOptions,
    MimoseOptions,
    OracleOptions,
    SublinearOptions,
)
from mimose_cli.planners.registry import PLANNERS
from mimose_cli.units import parse_size

FORBID_UNKNOWN_KEYS = ConfigDict(extra="forbid")
SIZE_EXPECTED = "a byte size such as '6GB', '6GiB', '512MB' or '0.5GiB'"
UNKNOWN_KEY = ("unexpected_keyword_argument", "invalid_key")  # pydantic's names for a key not a field
SYNTHETIC_EXAMPLES = 1024
"""How many examples synthetic data generates when data.num_examples is unset."""


class RecipeError(ValueError):
    """A recipe that cannot be run; the message names file, key, value and what was expected."""


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, stricter: a key given twice (the second block would silently replace
    the first) and anchors or aliases (a few bytes can expand to megabytes) are errors."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        name = event.anchor
        if name is not None:
            sign = "*" if isinstance(event, yaml.AliasEvent) else "&"
            raise yaml.MarkedYAMLError(problem=f"{sign}{name}: anchors and aliases are not allowed in "
                                       "a recipe; write the value out", problem_mark=event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        lines = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # PyYAML's own error follows
            if key in lines:
                raise yaml.MarkedYAMLError(
                    problem=f"key {key!r} appears twice (first on line {lines[key]}); merge the two",
                    problem_mark=key_node.start_mark)
            lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


class RecipeDumper(yaml.SafeDumper):
    """Writes what ``StrictLoader`` reads back the same (text such as '1e5' stays quoted)."""


# YAML 1.1 (PyYAML) reads 1e-4 and 1e30 as text; read them as numbers, as YAML 1.2 does.
for _yaml_class in (StrictLoader, RecipeDumper):
    _yaml_class.add_implicit_resolver("tag:yaml.org,2002:float",
                                      re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                      list("-+0123456789"))


def yaml_error_text(err: yaml.YAMLError) -> str:
    """A PyYAML error as one line: where, then what."""
    mark = getattr(err, "problem_mark", None)
    parts = [getattr(err, "context", None), getattr(err, "problem", None)]
    text = ", ".join(p for p in parts if p) or str(err)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(text.split())


TOO_DEEP = "nested deeper than Python can read (a recipe is a few levels deep); flatten it"


def load_yaml(text: str):
    """Parse YAML text with ``StrictLoader``; raises ``yaml.YAMLError`` (also for nesting so deep
    that reading it would exhaust Python's recursion)."""
    try:
        return yaml.load(text, Loader=StrictLoader)
    except RecursionError:
        raise yaml.YAMLError(TOO_DEEP) from None


class _Invalid(ValueError):
    """Raised by a section's ``__post_init__``: ``key`` within that section, its value, and what
    was expected; ``_recipe_error`` adds the file and the section."""

    def __init__(self, key: str, value, expected: str):
        super().__init__(f"{key}={value!r} is invalid; expected {expected}")
        self.key, self.value, self.expected = key, value, expected


def _size_bytes(key: str, text, allow_zero: bool = False) -> int:
    try:
        return parse_size(text, allow_zero=allow_zero)
    except ValueError:
        raise _Invalid(key, text, SIZE_EXPECTED) from None


def _number_as_text(value):
    """A bare number of bytes (``budget: 40000000``) is kept as the text the user wrote."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return str(value) if is_number else value


SizeText = Annotated[str, BeforeValidator(_number_as_text)]
Finite = Annotated[StrictFloat, AllowInfNan(False)]  # .inf and .nan are YAML floats too


@dataclass(config=FORBID_UNKNOWN_KEYS)
class ModelConfig:
    type: str = "bert"
    """Hugging Face model type: bert, roberta, xlnet, gpt2, ..."""
    size: Literal["tiny", "base"] = "tiny"
    """Size preset: 'tiny' (CPU tests) or 'base' (the published base size)."""
    pretrained: Optional[str] = None
    """Local directory or hub id to load weights from; random init when unset."""
    config_overrides: dict = field(default_factory=dict)
    """Hugging Face config fields to override, e.g. {num_hidden_layers: 4}."""
    attn_implementation: Optional[str] = None
    """'eager' or 'sdpa'; the library default when unset."""
    blocks: Any = None  # a string or a list of them, checked below (one message for both)
    """Glob over module names selecting the checkpointable blocks, e.g. 'bert.encoder.layer.*', or
    a list of globs (the blocks of each, in forward order): ['encoder.block.*', 'decoder.block.*']."""

    def __post_init__(self):
        globs = [self.blocks] if isinstance(self.blocks, str) else self.blocks
        globbed = isinstance(globs, list) and globs and all(isinstance(g, str) and g for g in globs)
        if self.blocks is not None and not globbed:
            raise _Invalid("blocks", self.blocks, "a glob over module names or a non-empty list of them")


@dataclass(config=FORBID_UNKNOWN_KEYS)
class DataConfig:
    source: Literal["synthetic", "hf"] = "synthetic"
    """'synthetic' (generated, no download) or 'hf' (a Hugging Face data set or local files)."""
    preset: str = "swag"
    """Synthetic length distribution: swag, squad or qqp; for image_classification the image
    sides' (multiscale), where max_length, min_length and length_* are sides in pixels."""
    num_examples: Optional[StrictInt] = Field(None, ge=1)
    """Synthetic: how many examples to generate (null: 1024). hf: train on the first N rows of the
    split (null: all of them)."""
    max_length: StrictInt = Field(512, ge=1)
    """Longest tokenized example; longer ones are truncated."""
    length_mean: Optional[Finite] = Field(None, gt=0)
    """Synthetic: override the preset's mean token length."""
    length_std: Optional[Finite] = Field(None, ge=0)
    """Synthetic: override the preset's standard deviation of token length."""
    min_length: Optional[StrictInt] = None
    """Synthetic: override the preset's shortest token length."""
    num_choices: StrictInt = Field(4, ge=1)
    """Multiple choice: choices per example."""
    num_labels: StrictInt = Field(2, ge=2)
    """Sequence and image classification: number of classes (at least 2: one would make the head a
    regression)."""
    image_multiple: StrictInt = Field(32, ge=1)
    """Image classification, synthetic: every image side is a multiple of this many pixels (a CNN's
    stride: Mimose trusts its probes at multiples of 32)."""
    name: Optional[str] = None
    """hf: data set name on the hub, or a local json/csv/tsv/parquet file or directory."""
    config_name: Optional[str] = None
    """hf: data set configuration (e.g. 'regular' for swag)."""
    split: str = "train"
    """hf: split to train on."""
    validation_examples: Optional[StrictInt] = Field(None, ge=1)
    """Synthetic: validation examples to generate (the training data's task and lengths, a seed
    stream of their own); null: no validation split."""
    validation_split: Optional[str] = None
    """hf: split to evaluate on, a split name of data.name ('validation') or a local file of the
    same layout; null: no validation split."""
    tokenizer: Optional[str] = None
    """hf: tokenizer by local path or hub id (defaults to model.pretrained)."""
    text_fields: list = field(default_factory=list)
    """hf: column names holding the text (one, or two for sentence pairs)."""
    label_field: Optional[str] = None
    """hf: column holding the label."""
    group_by_length: StrictBool = False
    """Batch examples of similar length together (HF Trainer's group_by_length)."""
    shuffle: StrictBool = True
    """Shuffle example order each epoch (seeded)."""

    def __post_init__(self):
        # The preset only matters for synthetic data; an hf recipe may leave any value there.
        if self.source == "synthetic" and self.preset not in {**LENGTH_PRESETS, **IMAGE_PRESETS}:
            raise _Invalid("preset", self.preset, " | ".join([*LENGTH_PRESETS, *IMAGE_PRESETS]))
        if self.source == "hf" and not self.name:
            raise _Invalid("name", self.name, "a data set name or local file when data.source is hf")
        if self.source == "synthetic":
            self._check_lengths()
            if self.num_examples is None:
                self.num_examples = SYNTHETIC_EXAMPLES
        if self.source == "synthetic" and self.validation_split is not None:
            raise _Invalid("validation_split", self.validation_split,
                           "null when data.source is synthetic (set data.validation_examples)")
        if self.source == "hf" and self.validation_examples is not None:
            raise _Invalid("validation_examples", self.validation_examples,
                           "null when data.source is hf (set data.validation_split)")

    @property
    def has_validation(self) -> bool:
        """Whether the recipe names a validation split (synthetic or hf)."""
        return self.validation_examples is not None or self.validation_split is not None

    def _check_lengths(self):
        shortest = {**LENGTH_PRESETS, **IMAGE_PRESETS}[self.preset].min_length
        if self.min_length is not None and not MIN_SYNTHETIC_LENGTH <= self.min_length <= self.max_length:
            raise _Invalid("min_length", self.min_length,
                           f"{MIN_SYNTHETIC_LENGTH}..data.max_length ({self.max_length})")
        if self.min_length is None and shortest > self.max_length:
            raise _Invalid("max_length", self.max_length,
                           f"at least {shortest}, the {self.preset} preset's shortest example "
                           f"(or set data.min_length between {MIN_SYNTHETIC_LENGTH} and {self.max_length})")


@dataclass(config=FORBID_UNKNOWN_KEYS)
class TrainingConfig:
    batch_size: StrictInt = Field(16, ge=1)
    """Examples per mini-batch."""
    max_steps: Optional[StrictInt] = Field(None, ge=1)
    """Stop after this many optimizer steps (overrides epochs)."""
    epochs: StrictInt = Field(1, ge=1)
    """Passes over the data when max_steps is unset."""
    lr: Finite = Field(5e-5, gt=0)
    """Peak AdamW learning rate."""
    weight_decay: Finite = Field(0.01, ge=0)
    """AdamW weight decay."""
    warmup_steps: StrictInt = Field(0, ge=0)
    """Linear warm-up steps."""
    max_grad_norm: Optional[Finite] = Field(1.0, gt=0)
    """Gradient clipping norm; null disables clipping."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32, or bf16 / fp16 autocast on the run's device (CUDA, or the CPU's own autocast)."""
    gradient_accumulation_steps: StrictInt = Field(1, ge=1)
    """Micro-batches per optimizer step (each planned on its own; batch_size is per micro-batch)."""
    log_every: StrictInt = Field(1, ge=1)
    """Print a plain progress line every N steps when stdout is not a terminal."""
    checkpoint_every: Optional[StrictInt] = Field(500, ge=1)
    """Write runs/<id>/checkpoint.pt every N optimizer steps (and always at the end and on
    SIGTERM/Ctrl-C), for ``mimose train --resume``; null: only at the end."""
    eval_every: Optional[StrictInt] = Field(None, ge=1)
    """Evaluate on the validation split every N optimizer steps; with a validation split it is
    evaluated after the last step too, also when this is null."""
    cpu_threads: Optional[StrictInt] = Field(None, ge=1)
    """Torch intra-op threads when the run is on the CPU; null: torch's default (one per core).
    Tiny models gain nothing from more than one, and on cores shared with other jobs the threads
    of one op wait on each other (the quickstart: 13 s idle either way, 73 s vs 16 s under load)."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """Under --nproc-per-node or torchrun: ddp (every rank holds the whole model, gradients
    averaged after backward) or fsdp (FSDP2: weights, gradients and optimizer state sharded over
    the ranks, each block gathered while it runs; docs/DISTRIBUTED.md). fsdp needs 2 processes
    or more."""
    reshard_after_forward: StrictBool = True
    """fsdp: free each block's gathered weights after its forward and gather them again for its
    backward (true), or keep them until its backward (false: one all-gather less per block, the
    memory of every block's weights held at the end of the forward)."""
    compile: StrictBool = False
    """Compile each planned block (regional ``torch.compile(dynamic=True)`` of its forward, the
    checkpoint outside it): new lengths and plans do not recompile. On the CPU it needs the
    allocator meter (``meter: auto`` picks it; under ``meter: simulated`` the blocks run eagerly,
    said in one line). Not with selective checkpointing (``choices: selective``, ``full.selective``)."""
    tensorboard: StrictBool = False
    """Also log each step's loss, lr, peak and predicted memory, iteration time, blocks
    checkpointed and retries to runs/<id>/tensorboard/ (needs ``pip install tensorboard``)."""

    def __post_init__(self):
        # Checked with the recipe, before anything is built; find_spec does not import it.
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise _Invalid("tensorboard", True, "false: the tensorboard package is not installed "
                                                "(pip install tensorboard)")


@dataclass(config=FORBID_UNKNOWN_KEYS)
class PlannerConfig:
    name: str = "mimose"
    """Planner: mimose, none, full, sublinear, dtr, oracle, hf-every-n, offload."""
    safety_margin: SizeText = "auto"
    """Budget headroom kept free for fragmentation (a byte size); auto: 5 % of the budget on
    CUDA (the caching allocator's rounding and fragmentation), 0 on the simulated device."""
    mimose: MimoseOptions = field(default_factory=MimoseOptions)
    """Mimose's options (used when planner.name is mimose), e.g. {sheltered_steps: 3}."""
    sublinear: SublinearOptions = field(default_factory=SublinearOptions)
    """Sublinear's options (used when planner.name is sublinear), e.g. {variant: sqrt}."""
    hf_every_n: EveryNOptions = field(default_factory=EveryNOptions)
    """hf-every-n's options (used when planner.name is hf-every-n), e.g. {every_n_layers: 2}."""
    full: FullOptions = field(default_factory=FullOptions)
    """full's options (used when planner.name is full), e.g. {selective: true}."""
    oracle: OracleOptions = field(default_factory=OracleOptions)
    """The oracle's options (used when planner.name is oracle), e.g. {choices: selective}."""
    safety_margin_bytes: Optional[int] = Field(None, init=False, exclude=True, repr=False)
    """safety_margin in bytes, parsed once here; None for auto (the planner decides)."""

    def __post_init__(self):
        if self.name not in PLANNERS:
            raise _Invalid("name", self.name, " | ".join(sorted(PLANNERS)))
        if self.safety_margin != "auto":
            self.safety_margin_bytes = _size_bytes("safety_margin", self.safety_margin, allow_zero=True)

    @property
    def keywords(self) -> dict:
        """The chosen planner's constructor keywords: its section's fields (none for a planner
        without options). Every planner's section is checked, so ``compare`` can run them all."""
        section = getattr(self, self.name.replace("-", "_"), None)
        return dataclasses.asdict(section) if dataclasses.is_dataclass(section) else {}


@dataclass(config=FORBID_UNKNOWN_KEYS)
class Recipe:
    task: Literal["multiple_choice", "question_answering", "sequence_classification", "causal_lm",
                  "image_classification"] = "multiple_choice"
    """multiple_choice, question_answering, sequence_classification, causal_lm or image_classification."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    budget: Optional[SizeText] = None
    """Device memory the training step may use, e.g. '6GB'; unlimited when unset."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto, cpu or cuda."""
    meter: Literal["auto", "simulated", "allocator"] = "auto"
    """How the CPU's simulated device counts: allocator (a counting C++ allocator built at first
    use: every allocation, compiled code and kernels' scratch included; simulated where it cannot be
    built, said in one line), simulated (a dispatch mode, op by op; compiled code runs eagerly
    under it) or auto (allocator).
    On CUDA the caching allocator's own figures are used whatever this says."""
    seed: StrictInt = Field(0, ge=-(2**63), le=2**64 - 1)
    """Seed for model init, data generation and data order."""
    out_dir: str = "runs"
    """Where run directories are created."""
    budget_bytes: Optional[int] = Field(None, init=False, exclude=True, repr=False)
    """budget in bytes, parsed once here; None when unlimited."""

    def __post_init__(self):
        if self.budget is not None:
            self.budget_bytes = _size_bytes("budget", self.budget)
        margin = self.planner.safety_margin_bytes
        if self.budget_bytes is not None and margin is not None and margin >= self.budget_bytes:
            raise _Invalid("planner.safety_margin", self.planner.safety_margin,
                           f"less than the budget ({self.budget})")
        self._check_task_data()
        self._check_compile()
        if self.training.eval_every is not None and not self.data.has_validation:
            raise _Invalid("training.eval_every", self.training.eval_every,
                           "null without a validation split; set data.validation_examples (synthetic "
                           "data) or data.validation_split (hf)")

    def _check_compile(self) -> None:
        """Selective checkpointing watches each op run, which compiled blocks do not show it."""
        if not self.training.compile:
            return
        section = getattr(self.planner, self.planner.name.replace("-", "_"), None)
        if getattr(section, "choices", "block") == "selective":
            raise _Invalid(f"planner.{self.planner.name}.choices", "selective",
                           "block or offload with training.compile: true (selective checkpointing cannot see "
                           "inside compiled blocks), or training.compile: false")
        if getattr(section, "selective", False):
            raise _Invalid("planner.full.selective", True, "false with training.compile: true (selective "
                           "checkpointing cannot see inside compiled blocks), or training.compile: false")

    def _check_task_data(self) -> None:
        """Images take an image preset and synthetic data; text takes a text preset."""
        data = self.data
        images = self.task == "image_classification"
        if images and data.source == "hf":
            raise _Invalid("data.source", data.source, "synthetic for task image_classification (images from "
                           "files or the hub are not supported yet)")
        if data.source == "synthetic" and (data.preset in IMAGE_PRESETS) != images:
            presets = IMAGE_PRESETS if images else LENGTH_PRESETS
            raise _Invalid("data.preset", data.preset, f"{' | '.join(presets)} for task {self.task}")
        if images and data.max_length < data.image_multiple:
            raise _Invalid("data.max_length", data.max_length, f"at least data.image_multiple ({data.image_multiple}): "
                           "the largest image side in pixels")


_RECIPE = TypeAdapter(Recipe)


def _section_keys(loc: tuple) -> list:
    """The keys a user may write in the section at ``loc`` (() for the top level)."""
    cls = Recipe
    for part in loc:
        cls = cls.__pydantic_fields__[part].annotation
    return [name for name, info in cls.__pydantic_fields__.items() if info.init is not False]


def _recipe_error(err: ValidationError, where: str, origins: dict) -> RecipeError:
    """One of pydantic's errors as one line naming file, dotted key, value and expectation: an
    unknown key first (a misspelt key is the likelier cause of the rest), else the first.
    ``origins`` maps keys set by an override or a flag to where they came from, named instead of
    the file."""
    errors = err.errors()
    first = next((e for e in errors if e["type"] in UNKNOWN_KEY), errors[0])
    loc = tuple(str(part) for part in first["loc"])
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, OptionError):  # a planner's options' own rule, naming other keys of its section
        key, value, expected = ".".join(loc + (cause.key,)), cause.value, cause.expected_in(".".join(loc))
    elif isinstance(cause, _Invalid):
        key, value, expected = ".".join(loc + (cause.key,)), cause.value, cause.expected
    elif first["type"] in UNKNOWN_KEY:
        key = ".".join(loc)
        where = _origin(key, origins, where)
        if key == "planner.options":  # what _read_earlier_keys leaves: options of a planner without any
            return RecipeError(f"{where}: planner.options was split into one section per planner "
                               f"({', '.join('planner.' + s for s in _planner_sections())}) and this "
                               "planner takes no options; remove it")
        keys = ", ".join(_section_keys(loc[:-1]))
        return RecipeError(f"{where}: unknown key {key}; expected one of {keys}")
    else:
        key, value = ".".join(loc), first["input"]
        expected = re.sub(r" or an instance of \w+$", "", first["msg"].removeprefix("Input should be "))
        expected = "true or false" if expected == "a valid boolean" else expected
    return RecipeError(f"{_origin(key, origins, where)}: {key}={_shown(value)} is invalid; expected {expected}")


def _origin(key: str, origins: dict, where: str) -> str:
    """Where ``key`` was set: the override or flag that set it, a section holding it or a key
    inside it (``trainng.max_steps=5`` made the unknown section ``trainng``), else ``where``."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in origins:
            return origins[".".join(parts[:n])]
    return next((origin for set_key, origin in origins.items() if set_key.startswith(key + ".")), where)


def _shown(value, limit: int = 60) -> str:
    """``repr(value)``, cut short when long (a 400-digit budget) so the message stays readable."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-8:]} ({len(text)} characters)"


def _parse_override(text: str):
    if "=" not in text:
        raise RecipeError(f"override {text!r}: expected key=value, e.g. training.max_steps=20")
    key, raw = text.split("=", 1)
    try:
        return key.strip(), load_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise RecipeError(f"override {_shown(text)}: the value is not valid YAML ({yaml_error_text(err)}); "
                          "quote it to pass it as text") from None


def _set_dotted(data: dict, key: str, value, where: str) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"{where}: {key!r} goes inside {part!r}, which is not a section")
        node = child
    old = node.get(parts[-1])
    # A mapping given for a section sets those keys in it, as a YAML file's section does, instead
    # of replacing the section with defaults for every key it leaves out.
    node[parts[-1]] = _merged(old, value) if isinstance(old, dict) and isinstance(value, dict) else value


def _merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, dict) else value
    return out


def _read_earlier_keys(data: dict, where: str, origins: dict) -> None:
    """Planner options as recipes before one section per planner wrote them (a run directory's
    recipe.yaml of an earlier release, to re-run or resume): moved into the planner's section, with a
    warning naming the new key; the earlier key wins over the new one (it is the override when a
    command line gives it). ``planner.options`` for a planner without options stays and is refused."""
    planner = data.get("planner")
    if not isinstance(planner, dict):
        return
    moves = [(key, key, "mimose", planner.pop(key)) for key in ("sheltered_steps", "granularity") if key in planner]
    options = planner.get("options")
    section = str(planner.get("name", "mimose")).replace("-", "_")
    if isinstance(options, dict) and (not options or section in _planner_sections()):
        planner.pop("options")
        moves += [(f"options.{key}", key, section, value) for key, value in options.items()]
    for old, key, section, value in moves:
        target = planner.setdefault(section, {})
        if isinstance(target, dict):
            target[key] = value
        warnings.warn(f"{_origin(f'planner.{old}', origins, where)}: planner.{old} is now planner.{section}.{key}; read as that "
                      "(write it there to silence this)", stacklevel=3)


def _planner_sections() -> list:
    return [name for name, info in PlannerConfig.__pydantic_fields__.items()
            if dataclasses.is_dataclass(info.annotation)]


def recipe_from_dict(data: dict, where: str = "<recipe>", overrides=(), flags=None,
                     flags_from: str | dict = "the command line") -> Recipe:
    """Build and validate a Recipe from a mapping, overrides ``key=value`` and flag values (an
    invalid one is blamed on ``flags_from``: one name for all, or each key's, a command's flag)."""
    try:
        data = yaml.safe_load(yaml.safe_dump(data or {}))  # deep copy, plain types
    except RecursionError:
        raise RecipeError(f"{where}: {TOO_DEEP}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
    origins = {}
    for text in overrides:
        key, value = _parse_override(text)
        if key in origins:  # as on a command line, the last one wins; said, since it may be a slip
            warnings.warn(f"override {_shown(text)}: {key} is given twice (also by {origins[key]}); "
                          "the last one is used", stacklevel=2)
        origins[key.strip()] = f"override {text!r}"
        _set_dotted(data, key, value, f"{where} (override {text!r})")
    for key, value in (flags or {}).items():
        if value is not None:
            origins[key] = flags_from.get(key, "the command line") if isinstance(flags_from, dict) else flags_from
            _set_dotted(data, key, value, f"{where} (flag)")
    _read_earlier_keys(data, where, origins)
    try:
        recipe = _RECIPE.validate_python(data)
    except RecursionError:
        raise RecipeError(f"{where}: {TOO_DEEP}") from None
    except ValidationError as err:
        raise _recipe_error(err, where, origins) from None
    _warn_of(recipe)
    return recipe


def _warn_of(recipe: Recipe) -> None:
    """What is valid but likely a slip, said of a recipe once it validates (an invalid one gets its
    one-line error alone)."""
    training = recipe.training
    if training.parallel == "ddp" and not training.reshard_after_forward:
        warnings.warn("training.reshard_after_forward=false has no effect with training.parallel=ddp "
                      "(nothing is sharded); it applies to training.parallel=fsdp", stacklevel=3)
    if training.max_steps is not None and training.warmup_steps > training.max_steps:  # a smoke test, or a slip
        warnings.warn(f"training.warmup_steps={training.warmup_steps} is longer than the run "
                      f"(training.max_steps={training.max_steps}): the learning rate never reaches "
                      "training.lr", stacklevel=3)


def idle_planner_overrides(recipe: Recipe, overrides) -> list:
    """The ``overrides`` (``key=value`` texts) that set another planner's section than the one
    ``recipe`` runs (``planner.mimose.choices=selective`` under ``--planner sublinear``): a recipe
    keeps every planner's options, so they are valid, but a run reads only its own planner's."""
    own = recipe.planner.name.replace("-", "_")
    sections = {name.replace("-", "_") for name in PLANNERS}
    idle = []
    for text in overrides:
        parts = text.split("=", 1)[0].strip().split(".")
        if len(parts) >= 2 and parts[0] == "planner" and parts[1] in sections and parts[1] != own:
            idle.append(text)
    return idle


def _not_a_file(path: Path) -> str:
    """What a path that is no regular file is, for the one line that refuses it."""
    try:
        mode = path.stat().st_mode
    except RuntimeError:  # Python < 3.13 on a loop of symbolic links
        return "is a loop of symbolic links; point it at a YAML file"
    except OSError as err:
        if path.is_symlink():
            what = "is a loop of symbolic links" if err.errno == errno.ELOOP else "is a symbolic link to nothing"
            return f"{what}; point it at a YAML file"
        return "not found"
    if stat.S_ISFIFO(mode):
        return "is a pipe (a FIFO, or <(...) process substitution), not a file; save the recipe to a file"
    return "is a device or special file, not a YAML file"


def load_recipe(path, overrides=(), flags=None, flags_from: str | dict = "the command line") -> Recipe:
    """Read a YAML recipe file, apply ``key=value`` overrides, then explicit flags (``flags_from``:
    what an invalid flag value is blamed on, ``recipe_from_dict``)."""
    path = Path(path)
    if path.is_dir():
        raise RecipeError(f"recipe file {str(path)!r} is a directory; expected a YAML file")
    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} {_not_a_file(path)}")
    try:
        data = load_yaml(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise RecipeError(f"{path}: byte {err.start} is not UTF-8 text; save the recipe as UTF-8") from None
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {yaml_error_text(err)}") from None
    if data is None:
        raise RecipeError(f"{path}: the recipe is empty; start from recipes/quickstart.yaml")
    return recipe_from_dict(data, str(path), overrides, flags, flags_from)


def recipe_to_dict(recipe: Recipe) -> dict:
    """The recipe as plain YAML-ready data: what the user can write, without the parsed bytes."""
    return _RECIPE.dump_python(recipe)


def recipe_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML; ``mimose train`` on this text re-runs the same run."""
    return yaml.dump(recipe_to_dict(recipe), Dumper=RecipeDumper, sort_keys=False)


def save_recipe(recipe: Recipe, path) -> None:
    """Write the resolved recipe (atomically) to ``path``."""
    write_text(path, recipe_yaml(recipe))
