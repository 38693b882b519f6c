"""Compiled blocks under every planner: regional compilation per discovered block, with the
checkpoint outside the compiled code.

A planner routes each block call (``runners.RoutedForward``) and decides per step which blocks
to checkpoint. Compiling the whole block (``block.compile()``: its ``_call_impl``) would make
Dynamo trace that router and its Python plan state, guarding on it and recompiling per plan. So
the block's own (plain) ``forward`` is compiled, ``torch.compile(forward, dynamic=True)``, and the
router calls it plainly or under ``torch.utils.checkpoint``: one graph per block class for every
plan and length (torchtitan's order: checkpoint around the compiled block).

A block the user compiled in place (``block.compile(...)``) is compiled the same way, with the
user's options (``torch_private.compiled_like``); its own compiled call is taken off while the
planner is attached and put back on ``close``. A ``torch.compile(block)`` wrapper
(``OptimizedModule``) in the model is refused in one line: taking it apart would rename the
model's parameters (``_orig_mod.``) under the optimizer and any saved checkpoint.

Plans change only between steps (``Planner.step`` decides once, before the forward), so no step
mixes compiled and eager runs of a block (unsloth-zoo#1001). Dynamo's LRU cache is turned off
while compiled blocks are planned (pytorch#166926, ``torch_private.dynamo_lru_cache_off``).
"""

import contextlib
import time
import weakref

import torch

from mimose_cli.planners.blocks import PARTIAL_LEVELS, SELECTIVE
from mimose_cli.torch_private import compiled_like, dynamo_lru_cache_off, on_dynamo_compile

_LISTENING: "weakref.WeakSet" = weakref.WeakSet()  # the open CompiledBlocks, told of every compile
_started: dict = {}  # compile_id -> when Dynamo started compiling it
_installed = False


def _compile_started(compile_id: str) -> None:
    _started[compile_id] = time.perf_counter()


def _compile_ended(compile_id: str) -> None:
    seconds = time.perf_counter() - _started.pop(compile_id, time.perf_counter())
    for blocks in list(_LISTENING):
        blocks.compiled(compile_id, seconds)


def _listen(blocks: "CompiledBlocks") -> None:
    global _installed
    if not _installed:  # once per process: torch keeps its callbacks for good
        on_dynamo_compile(_compile_started, _compile_ended)
        _installed = True
    _LISTENING.add(blocks)


def refuse_wrapped_blocks(blocks: list) -> None:
    """ValueError in one line for a block that is a ``torch.compile(block)`` wrapper."""
    for name, module in blocks:
        if hasattr(module, "_orig_mod"):
            raise ValueError(f"block {name!r} is a torch.compile(block) wrapper, which mimose cannot route without "
                             "renaming its parameters; compile it in place instead (block.compile(), or the "
                             "planner's compile=True) and plan the uncompiled model")


def refuse_whole_model_compile(model, meter) -> None:
    """ValueError in one line for a model compiled whole (``torch.compile(model)``,
    ``model.compile()``) where its compiled code would run: Dynamo would trace the planner's
    router and guard on its plan. Under the dispatch meter it runs eagerly (``usage.warn_if_eager``)."""
    whole = hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None
    if whole and getattr(meter, "kind", "") != "simulated":
        raise ValueError("the whole model is torch.compile'd, which would compile the planner's per-step routing; "
                         "pass the uncompiled model and compile=True (each block is compiled, the checkpoint "
                         "stays outside)")


def user_compiled(blocks: list) -> bool:
    """Whether any block was compiled in place (``block.compile()``)."""
    return any(getattr(module, "_compiled_call_impl", None) is not None for _, module in blocks)


def refuse_selective(options, compile_on: bool) -> None:
    """Selective checkpointing keeps chosen ops' outputs by watching each op run (a dispatch
    mode), which compiled code does not show it: refused for compiled blocks, in one line."""
    if not compile_on:
        return
    if getattr(options, "choices", "block") == "selective" or getattr(options, "selective", False):
        raise ValueError("selective checkpointing cannot see inside compiled blocks: with compile on, use "
                         "choices: block (or offload) and selective: false, or turn compile off")


def refuse_selective_plan(plan: tuple) -> None:
    """The same refusal for a plan set by hand (``planner.set_plan``)."""
    chosen = sorted({choice for choice in plan if choice == SELECTIVE or choice in PARTIAL_LEVELS})
    if chosen:
        raise ValueError(f"plan {plan} checkpoints compiled blocks {'/'.join(chosen)}, which cannot see inside "
                         "compiled code: choose keep, recompute or offload for them")


class CompiledBlocks:
    """Each block's plain ``forward`` compiled (``compile``: True for ``torch.compile(dynamic=True)``
    or a dict of ``torch.compile`` options; a block compiled in place keeps its own options), and
    the Dynamo compiles seen while attached: ``stats()`` gives their count and time (all, and
    that inside planned steps, which their iteration times include), the
    recompiles (compiles of a frame Dynamo had compiled before) and those after the warm-up.

    A block's graph is compiled once for each way it runs that Dynamo guards apart: plainly, under
    a checkpoint (its forward or its recompute inside backward may differ, e.g. in which inputs
    need a gradient), for an input that needs no gradient (the first block), and without
    gradients (evaluation). Each is compiled at the first step that runs a
    block that way, so the warm-up is the steps whose plan brought a choice no earlier step had;
    a compile in any other step (a new length, a new mix of the same choices) is a recompile
    after the warm-up, which dynamic shapes and a plan outside the graph are there to prevent."""

    def __init__(self, blocks: list, compile=True):
        self._options = {"dynamic": True, **(compile if isinstance(compile, dict) else {})}
        self._taken: dict = {}  # module -> the compiled call the user put on it, back on close
        for _, module in blocks:
            own = getattr(module, "_compiled_call_impl", None)
            if own is not None:
                self._taken[module] = own
                module._compiled_call_impl = None  # its _call_impl would compile the router
        self._seen: set = set()  # the choices (keep, recompute, offload) some step ran already
        self._warming = True  # whether the step running brought a choice no earlier step had
        self._stepping = False  # inside a planned step
        self.compiles = 0
        self.compile_s = 0.0
        self.compile_s_in_steps = 0.0  # of it, inside planned steps: in their iteration times
        self.recompiles = 0
        self.late_recompiles = 0  # recompiles in a step after the warm-up
        dynamo_lru_cache_off()
        _listen(self)

    def forward_for(self, module, plain):
        """What the router calls for ``module`` instead of ``plain``: its compiled forward."""
        own = self._taken.get(module)
        if own is not None:
            compiled = compiled_like(own, plain)
            if compiled is None:
                raise ValueError(f"{type(module).__name__} was compiled in place in a way mimose cannot read "
                                 "the options of; compile it with block.compile(...) or the planner's compile=True")
            return compiled
        return torch.compile(plain, **self._options)

    @contextlib.contextmanager
    def step(self, plan: tuple):
        """A planned step with ``plan``, fixed until it ends (its forward and backward); a compile
        outside any step (evaluation's, without gradients) is no recompile after the warm-up."""
        self._warming = not set(plan) <= self._seen
        self._seen |= set(plan)
        self._stepping = True
        try:
            yield
        finally:
            self._stepping = False

    def compiled(self, compile_id: str, seconds: float) -> None:
        self.compiles += 1
        self.compile_s += seconds
        self.compile_s_in_steps += seconds if self._stepping else 0.0
        attempt = compile_id.split("/")[-1].split("_")[0].strip("[]")
        if attempt.isdigit() and int(attempt) > 0:
            self.recompiles += 1
            self.late_recompiles += self._stepping and not self._warming

    def stats(self) -> dict:
        return {"compiled_blocks": True, "compiles": self.compiles, "compile_s": round(self.compile_s, 3),
                "compile_s_in_steps": round(self.compile_s_in_steps, 3),
                "recompiles": self.recompiles, "recompiles_after_warmup": self.late_recompiles}

    def close(self) -> None:
        """Stop counting and put the user's own compiled calls back."""
        _LISTENING.discard(self)
        for module, own in self._taken.items():
            module._compiled_call_impl = own
        self._taken = {}
