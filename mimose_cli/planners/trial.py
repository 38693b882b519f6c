"""Steps a planner runs to measure, which the training run never sees."""

import contextlib

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from mimose_cli.planners.snapshots import restored_buffers
from mimose_cli.torch_private import tree_leaves

_RUNNING: list = []  # the step functions a probe is running now (a probe inside a probe nests)

_NOT_UNDONE = ("the probes run your step function on small batches cut from the first one and undo only "
               "the model's gradients, buffers and RNG")
_FIX = "call {}prepare(make_batch, max_input_size) before the loop, whose probes run the model's own loss"


class ProbeRefused(ValueError):
    """A step function doing, inside a probe step, what the probe cannot undo (it steps an
    optimizer, it runs another planner's step): refused before it happens, in one line naming the
    fix. The probes let it through (it is no failure of theirs to learn around)."""


def refuse_inside_probe(what: str) -> None:
    """``ProbeRefused`` when a probe is running a step function: ``what`` (another planner's
    step) would take place on a cut probe batch, unseen by the probe's undoing."""
    if _RUNNING:
        raise ProbeRefused(f"{what} inside a planner's probe step: {_NOT_UNDONE}, not another planner's "
                           f"model; run one planner's step after the other's, not inside its step function, or "
                           f"{_FIX.format('the outer planner.')}")


def _refuse_optimizer_step(optimizer, args, kwargs) -> None:
    raise ProbeRefused(f"{type(optimizer).__name__}.step() inside a planner's probe step: {_NOT_UNDONE}, not "
                       "an optimizer step; step the optimizer after planner.run returns, not in the step "
                       f"function, or {_FIX.format('planner.')}")


@contextlib.contextmanager
def _running(step_fn):
    """While ``step_fn`` runs in a probe: an optimizer step (any optimizer's, through torch's global
    pre-hook, before it changes anything) and another planner's step (``refuse_inside_probe``)
    raise ``ProbeRefused``."""
    hook = register_optimizer_step_pre_hook(_refuse_optimizer_step)
    _RUNNING.append(step_fn)
    try:
        yield
    finally:
        _RUNNING.pop()
        hook.remove()


def run_model(model, batch):
    """Call ``model`` on a batch the way the training loop does (dict → keyword arguments)."""
    return model(**batch) if isinstance(batch, dict) else model(batch)


def loss_of(output) -> torch.Tensor:
    """The scalar to backward from a model output: ``.loss`` when there is one, else a sum."""
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    if isinstance(output, (tuple, list)):
        output = output[0]
    if hasattr(output, "logits"):
        output = output.logits
    return output.float().sum()


def model_device(model) -> torch.device:
    """The device of the model's parameters (the CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def to_model_device(model, batch):
    """Move a (dict) batch to the device of the model's parameters."""
    device = model_device(model)
    if isinstance(batch, dict):
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return batch.to(device)


@contextlib.contextmanager
def side_effect_free(model, batch):
    """Fork the RNG and restore the model's buffers (BatchNorm statistics) on exit."""
    devices = sorted({leaf.device.index or 0 for leaf in tree_leaves(batch)
                      if isinstance(leaf, torch.Tensor) and leaf.is_cuda})
    with torch.random.fork_rng(devices=devices, device_type="cuda"), restored_buffers(model):
        yield


def probe_step(parts, batch, step_fn=None):
    """One forward and backward on ``batch`` that the training run never sees: RNG forked,
    buffers restored, the gradients put back as they were (the probe starts from none), the
    meter's peak reset afterwards. ``step_fn(batch)`` runs them as training does (its autocast,
    its loss scaling); without it, the model's loss (``loss_of``) is backpropagated. What the probe
    could not undo, ``step_fn`` stepping an optimizer or another planner, raises ``ProbeRefused``
    before it happens. Returns the probe's peak (0 without a meter), or None when it ran out of
    memory. Under FSDP (``parts.lockstep``) every rank runs it or none does (``Lockstep.ticket``:
    which blocks run is the ticket), and each returns the same: the largest rank's peak, None when
    any ran out of memory, so that what a planner decides from it is every rank's decision."""
    lockstep = getattr(parts, "lockstep", None)
    if lockstep is None:
        return _probe_step(parts, batch, step_fn)
    lockstep.ticket(f"probe step over {sum(1 for _ in parts.model.modules())} modules")
    peak = _probe_step(parts, batch, step_fn)
    low, high = lockstep.spread(-1 if peak is None else peak)
    return None if low < 0 else high


def _probe_step(parts, batch, step_fn=None):
    meter = parts.meter
    params = list(parts.model.parameters())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    if meter is not None:
        meter.reset_peak()
    try:
        with side_effect_free(parts.model, batch), torch.enable_grad():
            if step_fn is not None:
                with _running(step_fn):
                    step_fn(batch)
            else:
                loss_of(run_model(parts.model, batch)).backward()
        return meter.peak_bytes() if meter is not None else 0
    except torch.OutOfMemoryError:
        return None
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        if meter is not None:
            meter.reset_peak()


def probe_with_runner(parts, batch, runner, step_fn=None):
    """``probe_step`` (with ``step_fn``) with every block run by ``runner`` through the router of
    ``parts`` (a planner's ``PlannerParts``). Returns what ``runner.end`` returns, or None when the
    step ran out of memory."""
    runner.begin(None)
    try:
        with parts.router.using(runner):
            peak = probe_step(parts, batch, step_fn)
    except BaseException:
        runner.abort()
        raise
    if peak is None:
        runner.abort()
        return None
    return runner.end(None)


def probe_with_plan(parts, batch, plan, step_fn=None):
    """``probe_step`` (with ``step_fn``) with ``plan`` (one choice per block) run by the plan
    runner of ``parts``; the plan in force is put back after. Returns what ``probe_step`` returns."""
    runner = parts.plan_runner
    saved = runner.plan
    parts.set_plan(plan)
    try:
        with parts.router.using(runner):
            return probe_step(parts, batch, step_fn)
    finally:
        runner.use(saved)
