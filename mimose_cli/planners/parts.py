"""What a policy works with (``PlannerParts``): the model and its blocks, the budget, the meter
session, the block router and the plan runner.

``planners.base.Planner`` builds them around a model and hands them to its policy
(``Policy(parts, **options)``); they are a policy's only way into the model, the meter and the
blocks. The probe steps of ``planners.trial`` take them too.
"""

import contextlib
import functools

from mimose_cli.memory.offload import OffloadHooks, resident_storages
from mimose_cli.planners.blocks import discover_blocks
from mimose_cli.planners.compiled import (CompiledBlocks, refuse_selective,
                                          refuse_whole_model_compile, refuse_wrapped_blocks, user_compiled)
from mimose_cli.planners.options import NoOptions
from mimose_cli.planners.runners import PlanRunner, RecomputeClock, StepRouter
from mimose_cli.planners.session import MeterSession
from mimose_cli.planners.sharding import largest_gathered_bytes
from mimose_cli.planners.trial import model_device
from mimose_cli.planners.usage import said, warn_if_eager
from mimose_cli.torch_private import without_dispatch_modes
from mimose_cli.units import parse_size_option

# Provisional until measured on a GPU (docs/MIMOSE.md): the caching allocator rounds requests to
# 512 B and large ones to 2 MiB segments, and reserved - allocated runs to a few per cent in
# training; 5 % of the budget covers that with room.
CUDA_SAFETY_FRACTION = 0.05


def resolve_blocks(model, blocks) -> list:
    """``[(name, module)]`` from a planner's ``blocks=``: pairs as given (as discovered), else
    ``discover_blocks`` with the glob or globs (None: the model's layers)."""
    if isinstance(blocks, list) and not (blocks and (all(isinstance(b, tuple) for b in blocks)
                                                     or all(isinstance(b, str) for b in blocks))):
        raise ValueError(f"blocks={blocks!r}: expected a glob, a non-empty list of globs, or of "
                         "(name, module) pairs")
    pairs = isinstance(blocks, list) and isinstance(blocks[0], tuple)
    return blocks if pairs else discover_blocks(model, blocks)


class PlannerParts:
    """The model, its ``blocks`` (``[(name, module)]`` in forward order), the budget, the meter
    session (``session``, ``meter``), the ``router`` that hands each block call to the runner in
    force, the ``plan_runner`` (checkpoints the blocks of the plan in force) and the
    ``recompute_clock`` every runner times its recomputation on. ``owner`` is the planner the
    router's hooks keep alive (``blocks.StepRouter``)."""

    def __init__(self, model, blocks: list, budget=None, *, safety_margin="auto", meter=None,
                 builds_meter: bool = False, owner=None, options=None, lockstep=None, compile=False):
        self.model = model
        self.lockstep = lockstep
        """``sharding.Lockstep`` for an FSDP2-sharded model (every rank's probe steps agree), else None."""
        self.options = NoOptions() if options is None else options
        refuse_wrapped_blocks(blocks)
        compile = compile or user_compiled(blocks)
        refuse_selective(self.options, bool(compile))
        """The planner's options (``planners.options``: ``MimoseOptions``, ...), checked already."""
        self.blocks = blocks
        self.num_blocks = len(blocks)
        self.budget_bytes = None if budget is None else parse_size_option("budget", budget)
        auto = safety_margin in (None, "auto")
        self._safety_margin = None if auto else parse_size_option("safety_margin", safety_margin, allow_zero=True)
        if self.budget_bytes is not None and self._safety_margin is not None and self._safety_margin >= self.budget_bytes:
            raise ValueError(f"safety_margin={safety_margin!r} leaves nothing of budget={budget!r} to plan with; "
                             "give a margin less than the budget")
        # Compiled blocks run compiled on the CPU only under the allocator meter.
        self.session = MeterSession(model, meter, builds_meter, self.budget_bytes,
                                    kind="allocator" if compile else "auto")
        refuse_whole_model_compile(model, self.meter)
        warn_if_eager(model, self.meter, bool(compile))
        self.recompute_clock = RecomputeClock()
        self.plan_runner = PlanRunner(self.recompute_clock, self._offload_hooks)
        self.compiled = CompiledBlocks(blocks, compile) if compile else None
        """The blocks' compiled forwards and Dynamo's compiles (``compiled.CompiledBlocks``), or
        None: the blocks run eagerly."""
        self.plan_runner.compiled_blocks = self.compiled is not None
        self.router = StepRouter(blocks, owner=owner, compiled=self.compiled)
        # A block that appends to a key/value cache cannot be recomputed or run twice, and a
        # training step never reads the cache (Hugging Face turns it off for checkpointing
        # too): off while the planner is attached, for every planner alike so that their
        # memory compares; close() puts the user's setting back for generate(). A sub-model
        # with a config of its own (T5's decoder) still hands its layers a cache: the router
        # clears it (blocks.training_kwargs).
        self._config = getattr(model, "config", None)
        self.encoder_decoder = bool(getattr(self._config, "is_encoder_decoder", False))
        self._use_cache = getattr(self._config, "use_cache", None)
        if self._use_cache:
            self._config.use_cache = False

    @property
    def meter(self):
        """Where the steps' memory figures come from (``session``: the training loop's meter, one
        the planner built, or None)."""
        return self.session.meter

    @meter.setter
    def meter(self, meter) -> None:
        self.session.meter = meter

    @property
    def safety_margin_bytes(self) -> int:
        """The headroom kept free: as given, or by default ``CUDA_SAFETY_FRACTION`` of the budget
        on a CUDA meter (the caching allocator rounds every block up and fragments; the budget
        caps what it reserves). The simulated device has neither, and keeps none, except under
        FSDP: the largest unit's gathered parameters (``sharding.largest_gathered_bytes``), since
        the process group's worker thread may let go of one such buffer a few ops after the step's
        last reference in one run and not in another, so a step's peak varies by up to one."""
        if self._safety_margin is not None:
            return self._safety_margin
        if not self.budget_bytes:
            return 0
        if getattr(self.meter, "kind", "") == "cuda":
            return int(CUDA_SAFETY_FRACTION * self.budget_bytes)
        # (at most half the budget: a budget that small cannot hold a sharded step anyway, and the
        # pre-flight says so in its own words)
        return min(self.collective_jitter_bytes, self.budget_bytes // 2)

    @functools.cached_property
    def collective_jitter_bytes(self) -> int:
        """By how much a step's peak may vary from run to run with the moment the collectives'
        worker thread lets go of their buffers: one FSDP unit's gathered parameters under FSDP
        (``sharding.largest_gathered_bytes``), else 0."""
        return largest_gathered_bytes(self.model) if self.lockstep is not None else 0

    @property
    def limit_bytes(self):
        """The budget a policy aims for: budget minus the safety margin (None: no budget)."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes - self.safety_margin_bytes

    def probing(self):
        """Around what may run probe steps (a policy's ``prepare``, ``decide``): under FSDP a
        ``Lockstep.session`` every rank enters at the same point; else nothing."""
        return self.lockstep.session() if self.lockstep is not None else contextlib.nullcontext()

    def set_plan(self, plan) -> None:
        """Put ``plan`` (one of ``blocks.CHOICES`` per block) in force until the next step decides
        again (probes, experiments); ValueError where it is not one the runner can run
        (``PlanRunner.checked``)."""
        self.plan_runner.use(self.plan_runner.checked(plan, self.num_blocks))

    def timed_off_budget(self, timing):
        """``timing(device)`` on the model's device as the planner's own work, not training's: no
        dispatch mode (the simulated device's meter) sees it, it may pass the budget (on CUDA the
        allocator's cap is lifted) and the meter's peak is reset after."""
        meter = self.meter
        try:
            with without_dispatch_modes(), meter.unlimited() if meter is not None else contextlib.nullcontext():
                return timing(model_device(self.model))
        finally:
            if meter is not None:
                meter.reset_peak()

    def timed_or_warned(self, timing, what: str, warn):
        """``timed_off_budget(timing)``, or None where it raises, after ``warn`` is told that
        ``what`` could not be timed and why, in one line: a timing refines a plan, and the caller
        says what stands in."""
        try:
            return self.timed_off_budget(timing)
        except Exception as error:  # noqa: BLE001 - any failure: the caller's stand-in, said
            warn(f"{what} could not be timed ({said(error, 120)})")
            return None

    def _offload_hooks(self):
        """For a plan that offloads: what makes the saved-tensor hooks of one offloaded block's
        call, the weights' and buffers' storages staying on the device (read once a plan, not once
        a block call; right after ``model.to`` too)."""
        return functools.partial(OffloadHooks, resident_storages(self.model), self.meter)

    def close(self) -> None:
        """Give the blocks their own forwards and the model its ``use_cache`` back; forget what
        ``track`` was given."""
        self.router.remove()
        if self.compiled is not None:
            self.compiled.close()
        if self._use_cache:
            self._config.use_cache, self._use_cache = self._use_cache, None
        self.session.close()


def check_offload_device(model, who: str, instead: str) -> None:
    """Refuse, in one line, to offload from a model on a device other than CUDA or the CPU (whose
    simulated device counts the host copies apart): anywhere else the copies would stay on the
    device and free nothing."""
    device = model_device(model)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"{who} moves saved tensors between a CUDA device and host memory (simulated "
                         f"on the CPU), but the model is on {device.type}; {instead}")
