"""A Hugging Face ``Trainer`` under a memory budget, in two added lines::

    from mimose_cli import fit_budget                            # mimose
    fit_budget(trainer, "6GB")                  # mimose: after Trainer(...), before train()

Why a helper that wraps the trainer rather than a ``TrainerCallback``: a callback is told that a
step begins and ends, but never holds the batch nor runs its forward and backward, so it can
neither apply a plan chosen for this batch's size nor undo a micro-batch that ran out of memory
and run it again. Both need the one call that does forward and backward of one micro-batch,
``Trainer.training_step``; the Trainer calls it once per micro-batch, so gradient accumulation
needs nothing more. ``fit_budget`` wraps the *instance's* methods, so a subclass's own
``training_step`` or ``compute_loss`` (TRL's ``SFTTrainer``, a user's override) runs inside the
planner unchanged, which a ``Trainer`` subclass of ours could not offer. It wraps three:
``training_step`` (each micro-batch through ``planner.run``), ``log`` (what the planner did joins
the Trainer's own logs, so ``state.log_history``, the printed lines, TensorBoard and W&B all get
it) and ``train`` (the planner lets go of the model when training ends, also when it fails).

The meter, and with it the budget, is on only inside each micro-batch's forward and backward
(the weights, gradients, optimizer state and the batch counted as live), so nothing outside
training is measured or refused and nothing is left on when ``train`` returns or raises.
docs/HF_TRAINER.md says what is logged and what is not supported.
"""

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from mimose_cli.launcher.preflight import optimizer_state_bytes
from mimose_cli.memory import build_meter, param_bytes
from mimose_cli.planners.base import Planner, build_planner, library_keywords
from mimose_cli.planners.blocks import checkpointed
from mimose_cli.planners.contract import Policy, StepInfo
from mimose_cli.planners.inputs import checked_input_size, infer_input_size, resized_batch, with_padding
from mimose_cli.planners.options import OptionError, parse_options
from mimose_cli.planners.registry import PLANNERS
from mimose_cli.planners.trial import model_device
from mimose_cli.planners.usage import not_an_instance
from mimose_cli.units import format_bytes, parse_size_option

logger = logging.getLogger(__name__)


@dataclass
class Tally:
    """What the planner did over some micro-batches: since the last log, or all of training."""

    micro_batches: int = 0
    checkpointed: int = 0
    """Micro-batches with at least one block checkpointed."""
    measured: int = 0
    """Micro-batches the planner measured (Mimose's first steps: every block checkpointed meanwhile)."""
    blocks: int = 0
    """Blocks checkpointed, summed over the micro-batches."""
    retries: int = 0
    """Attempts that ran out of memory and were run again (``Planner.run``)."""
    peak_bytes: int = 0
    """The highest forward+backward peak."""
    predicted_peak_bytes: int | None = None
    """The highest peak the planner predicted (None: it predicted none)."""

    def add(self, info: StepInfo, peak_bytes: int) -> None:
        self.micro_batches += 1
        checkpointing = checkpointed(info.plan)
        self.checkpointed += bool(checkpointing)
        self.measured += info.measured
        self.blocks += len(checkpointing)
        self.retries += info.retries
        self.peak_bytes = max(self.peak_bytes, peak_bytes)
        if info.predicted_peak_bytes is not None:
            self.predicted_peak_bytes = max(self.predicted_peak_bytes or 0, info.predicted_peak_bytes)

    def step_logs(self) -> dict:
        """The keys added to each training log line (over the micro-batches since the last one)."""
        logs = {"mimose/peak_bytes": self.peak_bytes,
                "mimose/blocks_checkpointed": self.blocks / self.micro_batches,
                "mimose/retries": self.retries}
        if self.predicted_peak_bytes is not None:
            logs["mimose/predicted_peak_bytes"] = self.predicted_peak_bytes
        return logs


class TrainerBudget:
    """A ``Trainer`` put under a budget by ``fit_budget``: its planner (``planner``, a new one for
    each ``train()``) and what it did in the last ``train()`` (``totals``)."""

    def __init__(self, trainer, budget_bytes: int, planner: str, options: dict, max_input_size):
        self.trainer = trainer
        self.budget_bytes = budget_bytes
        self.planner_name = planner
        self.options = options
        self.max_input_size = max_input_size
        device = model_device(trainer.model)
        # Compiled blocks run compiled on the CPU only under the allocator meter (the dispatch
        # meter's mode turns Dynamo off); on CUDA "auto" is the caching allocator's.
        kind = "allocator" if options.get("compile") and device.type == "cpu" else "auto"
        self.meter = build_meter(kind, budget_bytes, device)
        self._start()

    def _start(self) -> None:
        """A planner for the Trainer's model, and counts from zero: each ``train()`` plans anew."""
        self.planner: Planner = build_planner(self.planner_name, self.trainer.model, self.budget_bytes,
                                              meter=self.meter, **self.options)
        self._open, self._prepared = True, False
        self.window, self.totals = Tally(), Tally()

    def training_step(self, original, model, inputs, *args, **kwargs):
        """One micro-batch's forward and backward (the Trainer's own ``training_step``) under the
        plan, run again with a safer plan if it runs out of memory."""
        if not self._open or self.planner.model is not self.trainer.model:  # a later train(), model_init
            self.close()
            self._start()
        with self.meter.activate():
            # Storages made outside the meter's span (the optimizer's state, the collated batch)
            # count as live, as on a GPU; each storage is counted once however often tracked.
            self.meter.track(self.trainer.model, self.trainer.optimizer,
                             dict(inputs) if isinstance(inputs, Mapping) else inputs)
            step_fn = lambda batch: original(model, batch, *args, **kwargs)  # noqa: E731
            self._prepare(inputs, step_fn)
            loss = self.planner.run(step_fn, inputs)
            peak = self.meter.peak_bytes()
        self.window.add(self.planner.last, peak)
        self.totals.add(self.planner.last, peak)
        return loss

    def _prepare(self, inputs, step_fn) -> None:
        """Let a planner that plans ahead (sublinear) plan once, at ``max_input_size``, from
        this first batch resized to it."""
        if self._prepared or type(self.planner.policy).prepare is Policy.prepare:
            return
        size = self.max_input_size or infer_input_size(inputs, self.planner.parts.encoder_decoder)
        optimizer = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)  # accelerate's wrapper
        reserve = optimizer_state_bytes(optimizer) if optimizer is not None else 0
        self.planner.prepare(lambda s: with_padding(resized_batch(inputs, s)), tuple(size), reserve, step_fn=step_fn)
        self._prepared = True

    def log(self, original, logs: dict, *args, **kwargs):
        """Add what the planner did to the Trainer's log line: per training line, the micro-batches
        since the last; in the final metrics, the whole of training."""
        if "loss" in logs and self.window.micro_batches:
            logs.update(self.window.step_logs())
            self.window = Tally()
        if "train_runtime" in logs:
            logs.update(self.summary())
            logger.info("mimose: %s", self.planner.stats)
        return original(logs, *args, **kwargs)

    def summary(self) -> dict:
        """Training's totals, the keys the final metrics (``TrainOutput.metrics``) get."""
        t = self.totals
        return {"mimose/budget_bytes": self.budget_bytes, "mimose/micro_batches": t.micro_batches,
                "mimose/checkpointed_micro_batches": t.checkpointed, "mimose/measured_micro_batches": t.measured,
                "mimose/max_peak_bytes": t.peak_bytes,
                "mimose/retries": t.retries, "mimose/planning_ms": round(self.planner.total_planning_ms, 3)}

    def close(self) -> None:
        """Give the model its blocks and ``use_cache`` back; a later ``train()`` plans anew."""
        if self._open:
            self.planner.close()
            self._open = False


def fit_budget(trainer, budget, planner: str = "mimose", *, max_input_size=None, blocks=None,
               safety_margin="auto", **options) -> TrainerBudget:
    """Train ``trainer`` (a ``transformers.Trainer`` or subclass, built) within ``budget`` bytes
    of device memory ("6GB", "512MiB"), checkpointing just enough blocks per micro-batch.

    ``planner`` is any of ``mimose_cli.planners.PLANNERS`` by name, with its options as keywords
    (``sheltered_steps=3``); ``sublinear`` plans once for ``max_input_size`` = (batch, length).
    ``blocks`` (a glob over module names) and ``safety_margin`` are the planner's. Settings mimose
    cannot work with raise ``ValueError`` naming the setting and the fix.
    """
    _check_trainer(trainer)
    if isinstance(getattr(trainer, "_mimose_budget", None), TrainerBudget):
        raise ValueError("fit_budget was called on this trainer already; call it once per Trainer")
    budget_bytes = parse_size_option("budget", budget)
    _take_over_checkpointing(trainer)
    _refuse_unsupported(trainer, budget_bytes)
    _check_planner(planner, options, max_input_size)
    options.update(blocks=blocks, safety_margin=safety_margin, compile=_take_over_compile(trainer))
    fitted = trainer._mimose_budget = TrainerBudget(trainer, budget_bytes, planner, options, max_input_size)
    _wrap(trainer, "training_step", fitted.training_step)
    _wrap(trainer, "log", fitted.log)
    train = trainer.train

    def train_then_close(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        finally:
            fitted.close()

    trainer.train = train_then_close
    return fitted


def _check_trainer(trainer) -> None:
    """TypeError in one line unless ``trainer`` is a built Trainer: what ``fit_budget`` wraps and
    reads (``training_step``, ``args``, ``model``), checked by shape so that importing mimose does
    not import transformers' Trainer."""
    if isinstance(trainer, type) or not (callable(getattr(trainer, "training_step", None))
                                         and hasattr(trainer, "args") and hasattr(trainer, "model")):
        raise not_an_instance("trainer", trainer, "a built transformers.Trainer (or a subclass)",
                              "{}(model=model, args=TrainingArguments(...), train_dataset=data)",
                              "build the Trainer and pass it, e.g. fit_budget(Trainer(model=model, ...), '6GB')")


def _wrap(trainer, name: str, method) -> None:
    """Make ``trainer.name(...)`` call ``method(the original, ...)``."""
    original = getattr(trainer, name)
    setattr(trainer, name, lambda *args, **kwargs: method(original, *args, **kwargs))


def _check_planner(planner: str, options: dict, max_input_size) -> None:
    """The planner's name, options and ``max_input_size``, checked before anything is built."""
    if planner not in PLANNERS:
        raise ValueError(f"planner={planner!r} is unknown; choose one of {', '.join(sorted(PLANNERS))}")
    recipe_options = {f.name for f in dataclasses.fields(PLANNERS.options(planner))}
    takes = recipe_options | library_keywords(PLANNERS[planner])
    unknown = [key for key in options if key not in takes]
    if unknown:
        takes = ", ".join(sorted(takes)) or "none"
        raise ValueError(f"{unknown[0]}={options[unknown[0]]!r} is not an option of planner={planner!r}; "
                         f"its options: {takes}")
    try:  # the options a recipe could give, type-checked as the recipe checks them
        parse_options(PLANNERS.options(planner), {k: v for k, v in options.items() if k in recipe_options}, planner)
    except OptionError as err:
        raise ValueError(f"{err.key}={err.value!r} is invalid for planner={planner!r}; expected {err.expected}") from None
    plans_ahead = ((planner == "sublinear" and options.get("variant", "greedy") != "sqrt")
                   or (planner == "hf-every-n" and options.get("every_n_layers") is None))
    if plans_ahead and max_input_size is None:
        raise ValueError(f"planner={planner!r} plans once, for the largest batch: pass "
                         "max_input_size=(batch_size, max_length) to fit_budget")
    if max_input_size is not None:
        checked_input_size(max_input_size)


def _take_over_checkpointing(trainer) -> None:
    """Turn the Trainer's own checkpointing off (every layer of every batch, which would fight the
    plan), with one logged line: TRL's SFTTrainer, for one, turns it on by default."""
    args, model, taken = trainer.args, trainer.model, []
    for name in ("gradient_checkpointing", "activation_checkpointing"):
        if getattr(args, name, False):
            setattr(args, name, False)  # read by Trainer.train, which fit_budget runs before
            taken.append(f"TrainingArguments({name}=True)")
    if getattr(model, "is_activation_checkpointing", False) or getattr(model, "is_gradient_checkpointing", False):
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()
        taken.append("the model's own gradient checkpointing")
    if taken:
        logger.warning("mimose: %s turned off: mimose now decides per batch which layers to checkpoint",
                       " and ".join(taken))


def _take_over_compile(trainer):
    """``TrainingArguments(torch_compile=True)``: the ``compile=`` the planner gets instead of the
    Trainer's whole-model compile (which would compile the planner's per-step routing too): the
    torch.compile options of the Trainer's backend and mode, each block compiled with them and
    dynamic shapes. The Trainer's own compile is turned off (its accelerator compiles in
    ``prepare``, inside ``train``), with one logged line; False when it was off."""
    args = trainer.args
    if not getattr(args, "torch_compile", False):
        return False
    options = {"backend": args.torch_compile_backend or "inductor", "dynamic": True}
    if args.torch_compile_mode is not None:
        options["mode"] = args.torch_compile_mode
    args.torch_compile = False
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "dynamo_plugin", None)
    if plugin is not None:  # what accelerator.prepare reads to compile the whole model
        from accelerate.utils import DynamoBackend

        plugin.backend = DynamoBackend.NO
    logger.warning("mimose: TrainingArguments(torch_compile=True) compiles each layer (%s) instead of the "
                   "whole model, so that mimose checkpoints around the compiled layers", options["backend"])
    return options


def _refuse_unsupported(trainer, budget_bytes: int) -> None:
    """One ValueError naming the setting and the fix for what mimose cannot train under."""
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError("mimose does not plan for DeepSpeed (it shards and offloads the model itself); drop the "
                         "deepspeed training argument or fit_budget")
    if getattr(trainer, "is_fsdp_enabled", False):
        raise ValueError("fit_budget does not plan accelerate's FSDP yet; shard with `mimose train ... "
                         "training.parallel=fsdp` or plan a fully_shard'ed model with Mimose in your own loop "
                         "(docs/DISTRIBUTED.md), or drop the fsdp training argument")
    if getattr(args, "fsdp", None):  # accelerate ignores it on the CPU and trains the whole model on every rank
        raise ValueError("TrainingArguments(fsdp=...) on the CPU: accelerate runs no FSDP there (use_cpu) and would "
                         "train the model unsharded; drop fsdp=, or shard with `mimose train ... "
                         "training.parallel=fsdp` (docs/DISTRIBUTED.md)")
    if getattr(args, "n_gpu", 1) > 1:
        raise ValueError(f"the Trainer sees {args.n_gpu} GPUs and would replicate the model "
                         "(nn.DataParallel), which mimose does not plan for; run one process per GPU "
                         "(torchrun) or set CUDA_VISIBLE_DEVICES to one GPU")
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    state = weights + param_bytes(trainer.model)  # and their gradients
    if state >= budget_bytes:
        raise ValueError(f"budget of {format_bytes(budget_bytes)} cannot hold the model's weights and their "
                         f"gradients ({format_bytes(state)}); raise it well above that (the optimizer's "
                         "state and the activations come on top)")
