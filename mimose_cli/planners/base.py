"""The planner: a policy (``planners.policy``: ``decide``, ``observe``) carried out by its parts.

``Planner`` composes the policy with the block router (``blocks.StepRouter``: the runner in force
runs the blocks), the meter session (``planners.session``: which meter a step counts on, what
``track`` was given) and recovery (``planners.recovery.run_recovering``: ``run``'s attempts).
``Planner.step`` (never overridden) counts what exists, asks the policy, puts the step's runner in
force (``runner_for``), yields, ends the runner and tells the policy what happened. Persistence:
``stats``, ``state_dict``, ``save``/``load``. docs/DESIGN.md has a whole planner in 30 lines.
"""

import contextlib
import functools
import json
import time
from pathlib import Path

from mimose_cli.files import write_text
from mimose_cli.memory.offload import OffloadHooks, resident_storages
from mimose_cli.planners.blocks import BlockRunner, PlanRunner, RecomputeClock, StepRouter, discover_blocks, selectable
from mimose_cli.planners.inputs import infer_input_size
from mimose_cli.planners.policy import NO_CONTEXT, Decision, Policy, StepContext, StepInfo  # noqa: F401 (re-exported)
from mimose_cli.planners.recovery import run_recovering
from mimose_cli.planners.session import MeterSession
from mimose_cli.planners.usage import EnteredOnce, check_supported, claim, release, warn_if_eager
from mimose_cli.units import parse_size

# Provisional until measured on a GPU (docs/MIMOSE.md): the caching allocator rounds requests to
# 512 B and large ones to 2 MiB segments, and reserved - allocated runs to a few per cent in
# training; 5 % of the budget covers that with room.
CUDA_SAFETY_FRACTION = 0.05


class Planner(Policy):
    """Decides, per batch, which blocks to checkpoint (``decide``) and applies it. Usage::

        with Mimose(model, budget="6GB") as planner:   # close() on leaving, also on an error
            planner.track(optimizer)                   # memory that lives between the steps
            for batch in loader:
                with planner.step(batch):
                    model(**batch).loss.backward()
                optimizer.step(); optimizer.zero_grad()

    or ``planner.run(step_fn, batch)``, which also recovers from running out of memory.
    """

    def __init__(self, model, budget=None, *, blocks=None, safety_margin="auto", meter=None):
        self.model = model
        self.budget_bytes = None if budget is None else parse_size(budget)
        auto = safety_margin in (None, "auto")
        self._safety_margin = None if auto else parse_size(safety_margin, allow_zero=True)
        check_supported(model)
        if isinstance(blocks, list) and not (blocks and (all(isinstance(b, tuple) for b in blocks)
                                                         or all(isinstance(b, str) for b in blocks))):
            raise ValueError(f"blocks={blocks!r}: expected a glob, a non-empty list of globs, or of "
                             "(name, module) pairs")
        pairs = isinstance(blocks, list) and isinstance(blocks[0], tuple)  # (name, module), as discovered
        self.blocks = blocks if pairs else discover_blocks(model, blocks)
        self.num_blocks = len(self.blocks)
        self.closed = False
        claim(model, self)
        self._stepping = False  # inside a step: a second one would nest
        self.session = MeterSession(model, meter, self.builds_meter, self.budget_bytes)
        warn_if_eager(model, self.meter)
        self.steps = 0
        self.last: StepInfo | None = None
        self.total_planning_ms = 0.0
        self.recompute_clock = RecomputeClock()
        self.full_sizes: set = set()  # sizes that ran out of memory twice: every block from then on
        self.retries_total = 0
        self.plan_runner = PlanRunner(self.recompute_clock, self._offload_hooks)
        """Checkpoints the blocks of the plan in force (``runner_for``'s default)."""
        self.measurer = None
        """The runner of measured steps (``Decision.measure``: Mimose's and the oracle's
        collector), None where the planner measures nothing."""
        self.router = StepRouter(self.blocks, owner=self)
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

    # -- budget ---------------------------------------------------------------------------------

    @property
    def safety_margin_bytes(self) -> int:
        """The headroom kept free: as given, or by default ``CUDA_SAFETY_FRACTION`` of the budget
        on a CUDA meter (the caching allocator rounds every block up and fragments; the budget
        caps what it reserves) and none on the simulated device, which has neither."""
        if self._safety_margin is not None:
            return self._safety_margin
        on_cuda = getattr(self.meter, "kind", "") == "cuda"
        return int(CUDA_SAFETY_FRACTION * self.budget_bytes) if on_cuda and self.budget_bytes else 0

    @property
    def limit_bytes(self):
        """The budget the planner aims for: budget minus the safety margin."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes - self.safety_margin_bytes

    # -- applying a plan ------------------------------------------------------------------------

    @property
    def plan(self) -> tuple:
        """The plan in force (the last step's, or ``set_plan``'s)."""
        return self.plan_runner.plan

    def set_plan(self, plan, selective=(), offload=()) -> None:
        """Checkpoint ``plan`` (``selective`` of it selectively) and offload ``offload`` until the
        next step decides again (probes, experiments)."""
        self.plan_runner.use(plan, selective, offload)

    def _offload_hooks(self):
        """For a plan that offloads: what makes the saved-tensor hooks of one offloaded block's
        call, the weights' and buffers' storages staying on the device (read once a plan, not once
        a block call; right after ``model.to`` too)."""
        return functools.partial(OffloadHooks, resident_storages(self.model), self.meter)

    def runner_for(self, info: StepInfo) -> BlockRunner:
        """The runner of a step decided as ``info``: the measurer for a measured step, else the
        plan runner (the plan's blocks checkpointed). A planner whose blocks run otherwise
        returns its own (DTR: its evictions)."""
        return self.measurer if info.measured else self.plan_runner

    @property
    def meter(self):
        """Where the steps' memory figures come from (``session``: the training loop's meter, one
        this planner built, or None)."""
        return self.session.meter

    @meter.setter
    def meter(self, meter) -> None:
        self.session.meter = meter

    def track(self, *objects) -> None:
        """Count memory that lives between the steps in every step's figures and budget
        (``MeterSession.track``: the optimizer, tensors kept from step to step)."""
        self.session.track(*objects)

    def _decide(self, size: tuple, context: StepContext) -> StepInfo:
        """The policy's decision as this step's ``StepInfo``; a size that ran out of memory twice
        checkpoints every block (``recover``)."""
        start = time.perf_counter()
        decision = self.decide(size, context)
        if self.size_key(size) in self.full_sizes:
            plan = tuple(range(self.num_blocks))
            decision = Decision(plan, "recovery", predicted_peak_bytes=self.predict_peak(size, plan))
        planning_ms = (time.perf_counter() - start) * 1e3 - decision.excluded_ms
        plan = tuple(sorted(decision.plan))
        return StepInfo(step=self.steps, input_size=size, plan=plan,
                        selective=tuple(sorted(set(decision.selective) & set(plan))),
                        offload=tuple(sorted(set(decision.offload) - set(plan))), planning_ms=planning_ms,
                        phase=decision.phase, cache_hit=decision.cache_hit,
                        predicted_peak_bytes=decision.predicted_peak_bytes,
                        measured=decision.measure and self.measurer is not None,
                        excluded_ms=decision.excluded_ms, retries=context.attempt)

    def step(self, batch=None, input_size=None, *, attempt: int = 0, step_fn=None):
        """Decide and apply the plan for this batch, as a ``with`` block around its forward and
        backward; yields the ``StepInfo``. ``attempt`` and ``step_fn`` are what ``run`` tells the
        policy of its attempts (``StepContext``)."""
        self._check_open("step")
        return EnteredOnce(self._step(StepContext(batch, attempt, step_fn), input_size), "planner.step(batch)")

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"planner.{what} after close(): this planner put the model's blocks back; "
                               "build a new planner to plan again")

    @contextlib.contextmanager
    def _step(self, context: StepContext, input_size):
        if self._stepping:
            raise RuntimeError("planner.step (or run) inside another step of the same planner: one step "
                               "at a time, each around one forward and backward")
        self._stepping = True
        try:
            with self._planned_step(context, input_size) as info:
                yield info
        finally:
            self._stepping = False

    @contextlib.contextmanager
    def _planned_step(self, context: StepContext, input_size):
        batch = context.batch
        size = tuple(input_size) if input_size is not None else infer_input_size(batch, self.encoder_decoder)
        start = time.perf_counter()
        with self.session.counting(batch), self.session.step():
            self.last = info = self._decide(size, context)
            self.total_planning_ms += info.planning_ms
            self.recompute_clock.take()  # not this step's: a raised step's partial time, a probe
            runner = self.runner_for(info)
            runner.begin(info, batch)
            try:
                with self.router.using(runner):
                    yield info
            except BaseException:
                runner.abort()
                raise
            sample = runner.end(info)
            recompute_ms = self.recompute_clock.take()
            if info.recompute_ms is None:  # a runner that recomputes itself (DTR) timed its own
                info.recompute_ms = recompute_ms
            info.step_ms = (time.perf_counter() - start) * 1e3
            self.observe(info, self.session.peak_bytes(), sample)
            self.steps += 1

    def run(self, step_fn, batch=None, input_size=None):
        """Run ``step_fn(batch)`` (forward and backward) under this planner, recovering from
        out of memory (``recovery.run_recovering``: a failed attempt undone and the batch run
        again, with ``recover``'s remedy, then every block checkpointed); returns what ``step_fn``
        returns, and ``self.last.retries`` says how many attempts failed first."""
        self._check_open("run")
        if self._stepping:
            raise RuntimeError("planner.run inside a step of the same planner: one step at a time")
        size = tuple(input_size) if input_size is not None else infer_input_size(batch, self.encoder_decoder)
        with self.session.counting(batch):  # around the attempts: the guard's snapshots are counted too
            return run_recovering(self, step_fn, batch, size)

    def recover(self, info: StepInfo, failures: int, reached_bytes: int) -> None:
        """Make the next attempt of a step that ran out of memory ``failures`` times (the last
        trying to hold ``reached_bytes``) need less memory. The default checkpoints every block
        for that size from now on; planners with a finer remedy (Mimose: a larger margin for that
        size) try it first."""
        self.full_sizes.add(self.size_key(info.input_size))

    @property
    def stats(self) -> dict:
        """Counters for reports; subclasses add their own."""
        return {"planner": self.name, "steps": self.steps, "num_blocks": self.num_blocks,
                "planning_ms_total": self.total_planning_ms, "retries": self.retries_total,
                "full_sizes": len(self.full_sizes)}

    def state_dict(self) -> dict:
        """What the planner learned and counted, as JSON-ready data: enough to continue a run
        (``mimose train --resume``) deciding as it would have, and with its counters."""
        return {"name": self.name, "steps": self.steps, "retries": self.retries_total,
                "planning_ms_total": self.total_planning_ms,
                "full_sizes": sorted(list(size) for size in self.full_sizes)}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state.get("steps", 0)
        self.retries_total = state.get("retries", 0)
        self.total_planning_ms = state.get("planning_ms_total", 0.0)
        self.full_sizes = {tuple(size) for size in state.get("full_sizes", [])}

    def save(self, path) -> None:
        """Write ``state_dict()`` as JSON (a run keeps it as ``state_file``), atomically."""
        write_text(path, json.dumps(self.state_dict(), allow_nan=False))

    def load(self, path) -> "Planner":
        """Read what ``save`` wrote; returns self."""
        self.load_state_dict(json.loads(Path(path).read_text()))
        return self

    def close(self) -> None:
        """Restore the blocks' original forwards and the model's ``use_cache``, and forget what
        ``track`` was given. Closing again does nothing."""
        self.router.remove()
        if self._use_cache:
            self._config.use_cache, self._use_cache = self._use_cache, None
        self.session.close()
        self.closed = True
        release(self.model, self)

    def __enter__(self) -> "Planner":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class NoCheckpointing(Planner):
    """Checkpoint nothing: the speed limit, and out of memory on large batches."""

    name = "none"
    adapts = False
    oom_fix = ("let a planner checkpoint (mimose), raise the budget, or lower the batch size or sequence length",)

    def decide(self, input_size, context=NO_CONTEXT):
        return Decision(())


class FullCheckpointing(Planner):
    """Checkpoint every block, as ``gradient_checkpointing_enable()`` does; ``selective``: keep
    each block's compute-heavy ops' outputs and recompute the rest (``blocks.SELECTIVE``)."""

    name = "full"
    adapts = False

    def __init__(self, model, budget=None, *, selective: bool = False, **kwargs):
        super().__init__(model, budget, **kwargs)
        self.selective = selective
        if selective:
            held = next((name for (name, _), ok in zip(self.blocks, selectable(self.blocks)) if not ok), None)
            if held is not None:
                self.close()  # the model is not left claimed by a planner that was never made
                raise ValueError(f"planner.full.selective cannot checkpoint block {held} selectively: it holds buffers "
                                 "(BatchNorm statistics) that its recompute puts back, which torch's selective "
                                 "checkpointing refuses; set planner.full.selective: false")

    def decide(self, input_size, context=NO_CONTEXT):
        every = tuple(range(self.num_blocks))
        return Decision(every, selective=every if self.selective else ())
