"""The planner: a policy (``planners.policy``) carried out by the parts it plans with.

``Planner(model, policy, budget, **options)`` builds the parts (``planners.parts.PlannerParts``:
the blocks, the meter session, the block router, the plan runner), constructs the policy on them
(``policy(parts, **options)``) and carries it out: ``step`` counts what exists, asks the policy,
puts the step's runner in force (``Policy.runner_for``), yields, ends the runner and tells the
policy what happened; ``run`` adds out-of-memory recovery (``planners.recovery``); ``stats``,
``state_dict`` and ``save``/``load`` hold the planner's counters beside the policy's. No planner
subclasses it: ``Mimose(model, budget)`` is ``Planner(model, MimosePolicy, budget)``.
docs/DESIGN.md has a whole policy in 30 lines.
"""

import contextlib
import dataclasses
import inspect
import json
import time
from pathlib import Path

import torch

from mimose_cli.files import write_text
from mimose_cli.planners.blocks import RECOMPUTE
from mimose_cli.planners.contract import NO_CONTEXT, Decision, Policy, StepContext, StepInfo  # noqa: F401 (re-exported)
from mimose_cli.planners.inputs import checked_input_size, infer_input_size, resized_batch
from mimose_cli.planners.options import parse_options
from mimose_cli.planners.parts import PlannerParts, resolve_blocks
from mimose_cli.planners.recovery import RankOutOfMemoryError, rank_out_of_memory, run_recovering
from mimose_cli.planners.registry import PLANNERS
from mimose_cli.planners.sharding import lockstep_for
from mimose_cli.planners.trial import refuse_inside_probe
from mimose_cli.planners.usage import EnteredOnce, check_model, check_supported, claim, release


class Planner:
    """Decides, per batch, which blocks to checkpoint (its ``policy``) and applies it. Usage::

        with Mimose(model, budget="6GB") as planner:   # close() on leaving, also on an error
            planner.track(optimizer)                   # memory that lives between the steps
            for batch in loader:
                with planner.step(batch):
                    model(**batch).loss.backward()
                optimizer.step(); optimizer.zero_grad()

    or ``planner.run(step_fn, batch)``, which also recovers from running out of memory.
    ``Planner(model, policy, budget, blocks=, safety_margin=, meter=, compile=, **options)`` plans with any
    ``Policy`` subclass: ``options`` are its options (``planners.options``, checked there and
    handed to the policy as ``parts.options``) and the keywords only code passes its constructor
    (DTR's ``cost_fn``): ``policy(parts, **those)``.
    """

    def __init_subclass__(cls, **kwargs):
        raise TypeError(f"class {cls.__name__}(Planner): a planner is no longer a subclass of Planner; write a "
                        "Policy (mimose_cli.planners.contract) and run it as Planner(model, YourPolicy, budget)")

    def __init__(self, model, policy: type, budget=None, *, blocks=None, safety_margin="auto", meter=None,
                 compile=False, **options):
        if not (isinstance(policy, type) and issubclass(policy, Policy)):
            raise TypeError(f"policy={policy!r}: expected a Policy subclass (planners.contract), e.g. MimosePolicy")
        check_model(model)
        planner_options, library = _split_options(policy, options)
        self.name = policy.name
        self.closed = True  # until the policy is made
        self._stepping = False  # inside a step: a second one would nest
        self.steps = 0
        self.last: StepInfo | None = None
        self.total_planning_ms = 0.0
        self.full_sizes: set = set()  # sizes that ran out of memory twice: every block from then on
        self.retries_total = 0
        check_supported(model)
        resolved = resolve_blocks(model, blocks)
        lockstep = lockstep_for(model, resolved, policy.name)  # FSDP2: the ranks' probe steps agree
        claim(model, self)
        try:
            self.parts = PlannerParts(model, resolved, budget, safety_margin=safety_margin, meter=meter,
                                      builds_meter=policy.builds_meter, owner=self, options=planner_options,
                                      lockstep=lockstep, compile=compile)
        except BaseException:
            release(model, self)
            raise
        try:
            self.policy = policy(self.parts, **library)
        except BaseException:  # the model is not left claimed by a planner that was never made
            self.parts.close()
            release(model, self)
            raise
        self.closed = False

    # -- what the parts hold, read through ------------------------------------------------------

    @property
    def model(self):
        return self.parts.model

    @property
    def blocks(self) -> list:
        return self.parts.blocks

    @property
    def num_blocks(self) -> int:
        return self.parts.num_blocks

    @property
    def meter(self):
        """Where the steps' memory figures come from (``PlannerParts.meter``)."""
        return self.parts.meter

    @meter.setter
    def meter(self, meter) -> None:
        self.parts.meter = meter

    @property
    def budget_bytes(self):
        return self.parts.budget_bytes

    @property
    def safety_margin_bytes(self) -> int:
        return self.parts.safety_margin_bytes

    @property
    def limit_bytes(self):
        """The budget the planner aims for: budget minus the safety margin."""
        return self.parts.limit_bytes

    @property
    def state_file(self) -> str | None:
        return self.policy.state_file

    @property
    def plan(self) -> tuple:
        """The plan in force, one choice per block (the last step's, or ``set_plan``'s)."""
        return self.parts.plan_runner.plan

    def set_plan(self, plan) -> None:
        """``PlannerParts.set_plan``: the plan in force until the next step decides again. Not
        inside a step: a step's plan is fixed before its forward, so that no block runs one way in
        the forward and another in its recompute (compiled and eager: unsloth-zoo#1001)."""
        if self._stepping:
            raise RuntimeError("planner.set_plan inside a step: a step's plan is fixed before its forward; "
                               "set the plan between steps")
        self.parts.set_plan(plan)

    def track(self, *objects) -> None:
        """Count memory that lives between the steps in every step's figures and budget
        (``MeterSession.track``: the optimizer, tensors kept from step to step)."""
        self.parts.session.track(*objects)

    # -- the policy's --------------------------------------------------------------------------

    def prepare(self, make_batch, max_input_size: tuple, reserve_bytes: int = 0, step_fn=None) -> None:
        """Before training (``Policy.prepare``): static plans, Mimose's probe steps."""
        self._check_open("prepare")
        with self.parts.probing():
            self.policy.prepare(make_batch, checked_input_size(max_input_size), reserve_bytes, step_fn)

    def prepared_note(self) -> str | None:
        return self.policy.prepared_note()

    def predict_peak(self, size: tuple, plan: tuple) -> int | None:
        """The policy's predicted step peak for ``plan`` (one choice per block) at ``size`` (None:
        it cannot say)."""
        return self.policy.predict_peak(size, plan)

    # -- a step --------------------------------------------------------------------------------

    def _decide(self, size: tuple, context: StepContext) -> StepInfo:
        """The policy's decision as this step's ``StepInfo``; a size that ran out of memory twice
        checkpoints every block (``recover``)."""
        start = time.perf_counter()
        # Under FSDP every rank enters here at every step, whatever it decides; the wait for the
        # others on leaving is not planning.
        with self.parts.probing():
            decision = self._policy_decision(size, context)
            planning_ms = (time.perf_counter() - start) * 1e3 - decision.excluded_ms
        try:
            plan = self.parts.plan_runner.checked(decision.plan, self.num_blocks)
        except ValueError as err:
            raise ValueError(f"{type(self.policy).__name__}.decide returned {err}") from None
        return StepInfo(step=self.steps, input_size=size, plan=plan, planning_ms=planning_ms,
                        phase=decision.phase, cache_hit=decision.cache_hit,
                        predicted_peak_bytes=decision.predicted_peak_bytes,
                        measured=decision.measure and self.policy.measurer is not None,
                        excluded_ms=decision.excluded_ms, retries=context.attempt)

    def _policy_decision(self, size: tuple, context: StepContext) -> Decision:
        if self.policy.size_key(size) in self.full_sizes:  # the policy is not asked: its counts stay its own
            plan = (RECOMPUTE,) * self.num_blocks
            return Decision(plan, "recovery", predicted_peak_bytes=self.policy.predict_peak(size, plan))
        if self.policy.needs_prepare:  # the loop did not call prepare (a loop of the user's own)
            self.policy.prepare_from(_batch_maker(context.batch), size, context.step_fn)
        return self.policy.decide(size, context)

    def step(self, batch=None, input_size=None, *, attempt: int = 0, step_fn=None):
        """Decide and apply the plan for this batch, as a ``with`` block around its forward and
        backward; yields the ``StepInfo``. ``attempt`` and ``step_fn`` are what ``run`` tells the
        policy of its attempts (``StepContext``)."""
        self._check_open("step")
        refuse_inside_probe("planner.step")
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
        batch, parts = context.batch, self.parts
        size = tuple(input_size) if input_size is not None else infer_input_size(batch, parts.encoder_decoder)
        start = time.perf_counter()
        with parts.session.counting(batch), parts.session.step():
            self.last = info = self._decide(size, context)  # the plan, fixed for the whole step
            with parts.compiled.step(info.plan) if parts.compiled is not None else contextlib.nullcontext():
                self.total_planning_ms += info.planning_ms
                parts.recompute_clock.take()  # not this step's: a raised step's partial time, a probe
                runner = self.policy.runner_for(info)
                try:
                    runner.begin(info, batch)  # inside: what a begin that raised had entered is left by abort
                    with parts.router.using(runner):
                        yield info
                except torch.OutOfMemoryError as error:
                    runner.abort()
                    if parts.lockstep is None or isinstance(error, RankOutOfMemoryError):
                        raise
                    raise rank_out_of_memory(parts, info, error) from error  # never retried on one rank
                except BaseException:
                    runner.abort()
                    raise
                sample = runner.end(info)
                recompute_ms = parts.recompute_clock.take()
                if info.recompute_ms is None:  # a runner that recomputes itself (DTR) timed its own
                    info.recompute_ms = recompute_ms
                info.step_ms = (time.perf_counter() - start) * 1e3
                self.policy.observe(info, parts.session.peak_bytes(), sample)
                self.steps += 1

    def run(self, step_fn, batch=None, input_size=None):
        """Run ``step_fn(batch)`` (forward and backward) under this planner, recovering from
        out of memory (``recovery.run_recovering``: a failed attempt undone and the batch run
        again, with ``recover``'s remedy, then every block checkpointed); returns what ``step_fn``
        returns, and ``self.last.retries`` says how many attempts failed first."""
        self._check_open("run")
        refuse_inside_probe("planner.run")
        if self._stepping:
            raise RuntimeError("planner.run inside a step of the same planner: one step at a time")
        encoder_decoder = self.parts.encoder_decoder
        size = tuple(input_size) if input_size is not None else infer_input_size(batch, encoder_decoder)
        with self.parts.session.counting(batch):  # around the attempts: the guard's snapshots are counted too
            return run_recovering(self, step_fn, batch, size)

    def recover(self, info: StepInfo, failures: int, reached_bytes: int) -> None:
        """Make the next attempt of a step that ran out of memory ``failures`` times (the last
        trying to hold ``reached_bytes``) need less memory: the policy's remedy
        (``Policy.recover``; Mimose: a larger margin for that size), else every block
        checkpointed for that size from now on."""
        if not self.policy.recover(info, failures, reached_bytes):
            self.full_sizes.add(self.policy.size_key(info.input_size))

    # -- counters and persistence ---------------------------------------------------------------

    @property
    def stats(self) -> dict:
        """Counters for reports: the planner's, then the policy's (``Policy.stats``)."""
        counted = {"planner": self.name, "steps": self.steps, "num_blocks": self.num_blocks,
                   "planning_ms_total": self.total_planning_ms, "retries": self.retries_total,
                   "full_sizes": len(self.full_sizes)}
        compiled = self.parts.compiled.stats() if self.parts.compiled is not None else {}
        return {**counted, **self.policy.stats(counted), **compiled}

    def state_dict(self) -> dict:
        """What the planner learned and counted, as JSON-ready data: enough to continue a run
        (``mimose train --resume``) deciding as it would have, and with its counters."""
        return {"name": self.name, "steps": self.steps, "retries": self.retries_total,
                "planning_ms_total": self.total_planning_ms,
                "full_sizes": sorted(list(size) for size in self.full_sizes), **self.policy.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("name", self.name) != self.name:
            raise ValueError(f"this state was written by planner {state.get('name')!r}, not {self.name}")
        self.policy.load_state_dict(state)
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
        if self.closed:
            return
        self.closed = True
        self.parts.close()
        release(self.model, self)

    def __enter__(self) -> "Planner":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Planner {getattr(self, 'name', '?')}{' (closed)' if getattr(self, 'closed', False) else ''}>"


def _batch_maker(batch):
    """``make_batch`` for ``Policy.prepare_from``: ``batch`` cut or grown to a size
    (``inputs.resized_batch``); None when there is no batch with input_ids or pixel_values."""
    if isinstance(batch, dict) and any(batch.get(k) is not None for k in ("input_ids", "pixel_values")):
        return lambda size: resized_batch(batch, size)
    return None


def library_keywords(policy: type) -> set:
    """The keywords only code passes ``policy``'s constructor (DTR's ``cost_fn``), besides ``parts``."""
    params = inspect.signature(policy.__init__).parameters.values()
    return {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} - {"self", "parts"}


def _split_options(policy: type, options: dict) -> tuple:
    """``options`` as the policy's options (``PLANNERS.options_of``, built and checked by
    ``parse_options``: ``OptionError`` for a value it cannot use) and the constructor's keywords;
    TypeError naming the planner and what it takes for a keyword that is neither."""
    options_type = PLANNERS.options_of(policy)
    fields = {f.name for f in dataclasses.fields(options_type)}
    library = library_keywords(policy)
    takes_any = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(policy.__init__).parameters.values())
    unknown = sorted(set(options) - fields - library)
    if unknown and not takes_any:
        raise TypeError(f"planner {policy.name!r} has no option {', '.join(unknown)}; it takes "
                        f"{', '.join(sorted(fields | library)) or 'none of its own'} (and blocks, safety_margin, meter)")
    parsed = parse_options(options_type, {k: v for k, v in options.items() if k in fields}, policy.name)
    return parsed, {k: v for k, v in options.items() if k not in fields}


def build_planner(name: str, model, budget=None, **kwargs) -> Planner:
    """``Planner(model, PLANNERS[name], budget, **kwargs)``; unknown names raise ValueError
    listing the choices."""
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}; choose one of {', '.join(sorted(PLANNERS))}")
    return Planner(model, PLANNERS[name], budget, **kwargs)
