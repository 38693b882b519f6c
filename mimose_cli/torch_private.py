"""Every private PyTorch API mimose uses, in one place.

Private APIs can change in any torch release; ``pyproject.toml`` therefore claims only the torch
versions the test suite has run on. Each name below says why no public API serves and which
public one would replace it. Nothing else in the package imports ``torch._*`` or a module whose
name starts with an underscore.
"""

import torch

# Storages of a tensor subclass (DTensor, fake tensors) for the simulated device. Public
# replacement: ``__tensor_flatten__`` on traceable wrapper subclasses, walked by hand.
from torch.distributed._tools.common_utils import get_untyped_storages

# The simulated device and the collector's live-bytes probe see every ATen op's outputs. Public
# replacement: none yet (``torch.overrides.TorchFunctionMode`` sees Python-level calls, not the
# allocations of decomposed ops); dispatch modes are documented but live in a private module.
from torch.utils._python_dispatch import TorchDispatchMode


class UncompiledDispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` whose ``__torch_dispatch__`` torch does not wrap in a Dynamo-off
    guard (``_should_skip_dynamo``): the guard costs about 5 % of a probe step (one wrapper call
    per op), and Dynamo compiles nothing while a mode like ours is active anyway. Public
    replacement: none (the flag is private; torch's default may flip once its rollout ends)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def is_compiled(model) -> bool:
    """Whether ``model`` is ``torch.compile``'d (the ``OptimizedModule`` it returns) or holds a
    module compiled in place (``module.compile()``). Public replacement: none (both keep the
    compiled callable in private attributes)."""
    return hasattr(model, "_orig_mod") or any(getattr(m, "_compiled_call_impl", None) is not None
                                              for m in model.modules())


def autocast_enabled() -> bool:
    """Whether autocast is on for any device type, in one call (asked after every op the probe
    sees). Public replacement: ``torch.is_autocast_enabled(device_type)`` for each device type."""
    return torch._C._is_any_autocast_enabled()


def autocast_open() -> bool:
    """Whether an autocast context is open, so that its cache of cast weights is not cleared yet.
    Unlike ``autocast_enabled`` it also holds inside a dispatch mode for the ops autocast itself
    casts for (it redispatches them with autocast excluded, so they read as not under autocast).
    Reads the nesting depth that ``torch.autocast`` keeps (it clears the cache on leaving the
    outermost context); there is no getter, so it is bumped and put back. Public replacement: none."""
    depth = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return depth > 1


# Flattening nested batches and block arguments. Public replacement: ``torch.utils.pytree``
# (announced, not in 2.13), or the ``optree`` package.
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["TorchDispatchMode", "UncompiledDispatchMode", "autocast_enabled", "autocast_open", "compiled_like", "dynamo_lru_cache_off",
           "is_compiled", "on_dynamo_compile", "tree_leaves",
           "tree_map", "get_untyped_storages",
           "top_saved_tensors_hook_name", "tensor_version", "dispatch_modes", "without_dispatch_modes"]


def top_saved_tensors_hook_name() -> str:
    """The qualified name of the innermost saved-tensor pack hook ("" when none is set).

    ``torch.utils.checkpoint`` has no "am I inside a checkpoint / recomputing?" query; its
    non-reentrant implementation installs pack hooks named ``_checkpoint_hook`` (forward) and
    ``_recomputation_hook`` (recompute), and this reads the innermost one. Public replacement:
    a checkpoint-region query in ``torch.utils.checkpoint`` (none exists), or a
    ``context_fn`` passed to every checkpoint call that sets our own flag.
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return getattr(hooks[0], "__qualname__", "") if hooks else ""


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place modification counter (autograd's version counter), used by DTR to
    refuse recomputing a block whose inputs changed. Public replacement: none (autograd checks
    it internally when a saved tensor is unpacked, with no API to ask ahead of time)."""
    return tensor._version


def dispatch_modes() -> list:
    """The ``TorchDispatchMode``s active now, outermost first: a planner's own simulated device
    must be among them only inside its steps (tests/planners/test_side_effects.py,
    benchmarks/library_overhead.py). Public replacement: none (torch has no query for the
    active dispatch modes outside ``torch.utils._python_dispatch``)."""
    return list(torch.utils._python_dispatch._get_current_dispatch_mode_stack())


def without_dispatch_modes():
    """A context in which no ``TorchDispatchMode`` active now sees the ops (they are put back on
    exit): Mimose's probe steps measure themselves, so the simulated device need not count them
    op by op as well. Public replacement: none (the mode stack is private)."""
    return torch.utils._python_dispatch._disable_current_modes()


def fsdp_unsharded_params(model) -> list:
    """The unsharded parameters ``fully_shard`` (FSDP2) gathers each unit's shards into, where
    the unit has gathered once (their storages stay the same objects, resized to nothing between
    gathers): what a block's graph saves of its weights, which are parameters too. Public
    replacement: none (``FSDPParam`` and a unit's state are private)."""
    found = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
        for param in getattr(group, "fsdp_params", ()):
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None:
                found.append(unsharded)
    return found


def on_dynamo_compile(start, end) -> None:
    """Call ``start(compile_id)`` and ``end(compile_id)`` around every frame Dynamo compiles (first
    compiles and recompiles alike; ``compile_id`` reads "frame/attempt", attempt 0 the first).
    Public replacement: none (``torch.compiler`` counts nothing per compile; tlparse reads logs)."""
    from torch._dynamo.callback import callback_handler

    callback_handler.register_start_callback(lambda args: start(str(args.compile_id)))
    callback_handler.register_end_callback(lambda args: end(str(args.compile_id)))


def compiled_like(compiled, fn):
    """``fn`` compiled with the options ``compiled`` (what ``torch.compile`` or
    ``module.compile()`` returned for a function) was compiled with: its backend, mode, dynamic
    and fullgraph, from the Dynamo context its wrapper closes over; None where that cannot be
    read. Public replacement: none (torch.compile keeps its options in that context alone)."""
    closure = dict(zip(compiled.__code__.co_freevars, compiled.__closure__ or ())) if hasattr(compiled, "__code__") else {}
    cell = closure.get("self")
    context = cell.cell_contents if cell is not None else None
    if context is None or type(context).__name__ != "OptimizeContext":
        return None
    return context(fn)


def dynamo_lru_cache_off() -> None:
    """Make Dynamo look up a frame's compiled graphs in the order they were made, not most recent
    first, so that a checkpoint's recompute runs the graph its forward ran (pytorch#166926; what
    torchtitan does whenever it checkpoints). Public replacement: none (the switch that issue's
    fix and torch.utils.checkpoint's own error message point to is private)."""
    torch._C._dynamo.eval_frame._set_lru_cache(False)
