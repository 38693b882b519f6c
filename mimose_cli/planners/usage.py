"""Mistakes in using a planner from code, each said in one line instead of an internal error or
nothing: a second planner on a model that has one, a step inside a step, a planner used after
``close``, ``step`` called without ``with``, ``track`` given something it cannot count, a model
that is no model instance (its class, the function that builds it), wrapped by DeepSpeed; and a compiled model on the simulated device, which runs
eagerly."""

import contextlib
import inspect
import os
import warnings
import weakref
from pathlib import Path

import torch

from mimose_cli.torch_private import is_compiled

_OWNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> weakref to its planner


_PASSED_THROUGH = (str(Path(__file__).resolve().parent) + os.sep, str(Path(contextlib.__file__).resolve()))
"""The planners' own files, and contextlib's (``with planner.step(batch):`` enters through it)."""


def said(error: Exception, limit: int) -> str:
    """An error in one line: its type and its message's first line, cut at ``limit``."""
    first = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first[:limit]}"


def warn_user(message: str, category=UserWarning) -> None:
    """``warnings.warn`` pointing at the first line outside ``mimose_cli/planners`` (and the
    ``with`` machinery): the user's ``Mimose(...)``, ``planner.prepare(...)`` or
    ``planner.step(...)`` (or the training loop's), however many of the planner's own frames lie
    between."""
    frame, level = inspect.currentframe(), 1  # level 1: this function, the one calling warnings.warn
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(_PASSED_THROUGH):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def claim(model, planner) -> None:
    """Attach ``planner`` to ``model``; ValueError when another open planner already is."""
    owner = _OWNERS.get(model)
    holder = owner() if owner is not None else None
    if holder is not None and not holder.closed:
        raise ValueError(f"this model already has a {holder.name} planner attached; close() it first "
                         "(a `with` block closes it) or plan with that one")
    _OWNERS[model] = weakref.ref(planner)


def not_an_instance(argument: str, value, expected: str, build: str, fix: str) -> TypeError:
    """The one-line TypeError for ``argument`` given ``value`` where ``expected`` (an instance) is
    due: a class is to be built (``build``, its name in ``{}``: "{}(config)"), a function called,
    anything else replaced as ``fix`` says."""
    if isinstance(value, type):
        got, fix = f"the class {value.__name__}", f"build one first, e.g. {build.format(value.__name__)}"
    elif callable(value) and hasattr(value, "__name__"):
        got, fix = f"the function {value.__name__}", "call it and pass what it returns"
    else:
        got = "None" if value is None else f"a {type(value).__name__}"
    return TypeError(f"{argument} is {got}: expected {expected}; {fix}")


def check_model(model) -> None:
    """TypeError in one line unless ``model`` is a model instance (``Mimose(BertModel, ...)``
    would otherwise fail deep in block discovery)."""
    if not isinstance(model, torch.nn.Module):
        raise not_an_instance("model", model, "a model instance (a torch.nn.Module)",
                              "{0}(config) or {0}.from_pretrained(name)", "pass the model to train")


def check_supported(model) -> None:
    """ValueError for a model mimose cannot plan: one wrapped by DeepSpeed, which shards and
    offloads its parameters block by block itself, in memory neither the meter nor the plans
    model. FSDP is ``planners.sharding``'s to check (FSDP2 is planned, FSDP1 refused)."""
    names = {cls.__name__ for module in model.modules() for cls in type(module).__mro__}
    if "DeepSpeedEngine" in names:
        raise ValueError("mimose does not plan DeepSpeed engines (ZeRO shards and offloads the model itself); "
                         "plan the model before deepspeed.initialize, or drop mimose")


def warn_if_eager(model, meter, compile_blocks: bool = False) -> None:
    """A compiled model on the dispatch-mode simulated device runs eagerly: its dispatch mode
    turns Dynamo off (the allocator meter counts compiled code)."""
    if meter is not None and getattr(meter, "kind", "") == "simulated" and (compile_blocks or is_compiled(model)):
        what = "the model's blocks are compiled" if compile_blocks else "the model is torch.compile'd"
        warn_user(f"{what}, but on the simulated device it runs eagerly (the "
                  "dispatch meter's mode turns Dynamo off): times are eager ones; use meter "
                  "'allocator' to run compiled code on the CPU")


def release(model, planner) -> None:
    owner = _OWNERS.get(model)
    if owner is not None and owner() is planner:
        del _OWNERS[model]


def check_trackable(objects) -> None:
    """What ``track`` counts: modules, optimizers, tensors, and dicts, lists and tuples of them."""
    for obj in objects:
        if isinstance(obj, dict):
            check_trackable(obj.values())
        elif isinstance(obj, (list, tuple)):
            check_trackable(obj)
        elif not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)):
            raise ValueError(f"track({obj!r}): expected a module, an optimizer, a tensor, or dicts and "
                             f"lists of them, not {type(obj).__name__}")


class EnteredOnce:
    """``planner.step(...)``: a context manager that says so when it is never entered (a call
    without ``with`` plans nothing, silently, otherwise)."""

    def __init__(self, manager, what: str):
        self._manager, self._what, self._entered = manager, what, False

    def __enter__(self):
        self._entered = True
        return self._manager.__enter__()

    def __exit__(self, *exc_info):
        return self._manager.__exit__(*exc_info)

    def __del__(self):
        if not self._entered:
            warnings.warn(f"{self._what} was never entered, so nothing was planned: write "
                          f"`with {self._what}:` around the forward and backward", RuntimeWarning, stacklevel=2)
