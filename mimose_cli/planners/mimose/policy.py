"""The Mimose planner (arXiv 2209.02478): learn per-block memory online, plan per input size.

Sheltered phase (the first ``sheltered_steps`` steps): the shuttling collector measures every
block at this step's input size and runs it checkpointed. Then the estimator is fitted, and
the responsive phase plans each batch: the plan cache answers for sizes already planned (the
sequence length rounded up to ``granularity``, planned at the rounded size so the plan is safe
for every size it covers); on a miss the greedy scheduler picks the blocks to checkpoint from
the predicted memory and the budget, re-checked against the predicted step peak.

Library use::

    with mimose_cli.Mimose(model, budget="6GB") as planner:   # close() on leaving the block
        planner.track(optimizer)      # its state lives between the steps: count it in each step
        for batch in loader:
            with planner.step(batch):
                model(**batch).loss.backward()
            optimizer.step(); optimizer.zero_grad()
        planner.save("estimator.json")   # Mimose(model, budget=...).load(path) skips the sheltered phase

Without a ``meter`` the planner builds one (``build_meter("auto", budget, device)``) and turns it
on only inside ``step()`` and ``run()``: on the CPU that is the simulated device (every op
counted, going over the budget raises ``torch.OutOfMemoryError``), on a GPU the allocator capped
at the budget. Code between the steps (the optimizer step, evaluation, anything else) runs
unmetered, uncapped and at full speed.
"""

import copy
import time
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple

import numpy as np

from mimose_cli.planners.base import Planner
from mimose_cli.planners.blocks import (
    KEEP,
    OFFLOAD,
    PARTIAL_LEVELS,
    RECOMPUTE,
    offloading,
    plan_of_fields,
    recomputed,
    selectable,
)
from mimose_cli.planners.contract import NO_CONTEXT, Decision, Policy, StepContext, StepInfo
from mimose_cli.planners.mimose.choices import (
    ChoiceTimes,
    bounded_for_offload,
    choice_plan_checked,
    level_rows,
    priced_freeing,
)
from mimose_cli.planners.mimose.collector import ShuttlingCollector
from mimose_cli.planners.mimose.estimator import Estimator, Timeline, plan_peak_bytes
from mimose_cli.planners.mimose.features import feature_set_of, kept_quantities
from mimose_cli.planners.mimose.probes import ProbeResult, Probes, offload_unknown
from mimose_cli.planners.mimose.scaling import SELECTIVE_QUANTITIES
from mimose_cli.planners.mimose.scheduler import greedy_plan_checked
from mimose_cli.planners.parts import check_offload_device
from mimose_cli.planners.usage import warn_user


class CachedPlan(NamedTuple):
    """A plan-cache entry: the plan (one choice per block), its predicted peak above the step's
    start, and whether that fits the budget."""

    plan: tuple
    peak_bytes: float
    fits: bool


@dataclass
class MimoseCounters:
    """What Mimose counts, listed once: ``stats`` shows every field (and figures derived from
    them), ``state_dict`` saves them all and ``load_state_dict`` restores them."""

    sheltered_iterations: int = 0
    """Sheltered steps whose sample the estimator kept."""
    sheltered_attempts: int = 0
    """Sheltered steps run, kept or not (every block filtered out)."""
    sheltered_ms: float = 0.0
    responsive_ms: float = 0.0
    responsive_steps: int = 0
    estimator_fit_ms: float = 0.0
    hits: int = 0
    misses: int = 0
    scheduler_ms: float = 0.0
    unfit_plans: int = 0
    untrusted_steps: int = 0
    measuring_steps: int = 0
    underpredictions: int = 0
    max_underprediction_bytes: int = 0
    unseen_bytes: int = 0
    """Bytes the device's own peak held above the probes' timeline (``MimosePolicy.observe``),
    added to every prediction since."""
    untrusted_reasons: dict = field(default_factory=dict)
    """Why predictions were not trusted -> steps."""
    probe_ms: float = 0.0
    """The two probe steps before the first step and scaling them (``estimate="probes"``)."""
    probe_steps: int = 0
    """Probe steps run: 2, or 3 when the first one did what only a first step does; 2 or 3 more
    when blocks alike in parameters did not run alike (the probes again, every block measured)."""
    probe_twins: int = 0
    """Blocks the probes ran without a measuring run, taken as an earlier block like them."""
    probe_releases: int = 0
    """Blocks whose inputs a plain probe step (one more, at the smallest size, before the others)
    saw let go of once they returned (``features.Releases``)."""
    probe_sides_refused: str = ""
    """Why the probes did not vary an image's sides after all (the model takes only its own, ...),
    or empty."""
    probe_twins_refused: str = ""
    """Why blocks alike in parameters were all measured after all (they ran otherwise), or empty."""
    probe_skipped: int = 0
    """Layers of a stack the probes left out, taken as a layer before them alike in parameters
    and settings (``blocks.stack_runs``)."""
    probe_skips_refused: str = ""
    """Why the probes ran every layer of a long stack after all, or empty."""
    probe_first_refused: str = ""
    """Why a stack's first layer did not stand for the layers alike after it (its second did:
    ``blocks.first_runs_otherwise``), or empty."""
    probe_in_step_ms: float = 0.0
    """The part of ``probe_ms`` spent inside the first step's planning (no ``prepare``)."""
    probe_samples: int = 0
    """Samples the estimator was given from the probes."""
    estimate_source: str = ""
    """Where the estimate came from: probes, or sheltered (measured training steps); a loaded
    estimator keeps the source of the run that fitted it."""
    estimate_fallback: str = ""
    """Why the probes could not give the estimate (then the sheltered phase did), or empty."""
    warnings: list = field(default_factory=list)


UNSEEN_SHARE = 0.02
"""A planned step's peak above its prediction by more than this share of the limit, at a size
never measured, also has that size measured (the fit may be wrong there); every shortfall is added
to later predictions (``MimosePolicy._unseen``). On an H200 the fused kernels' scratch memory was
0.6-1.5 % of the budget."""

_EARLIER_COUNTERS = {"sheltered_done": "sheltered_iterations", "fit_ms": "estimator_fit_ms",
                     "untrusted": "untrusted_steps", "measuring": "measuring_steps"}
"""Counters of states written before ``MimoseCounters`` (top level or in ``counts``): new names."""


def _counters_of(state: dict) -> MimoseCounters:
    """The counters of a saved state, of this release (``counters``) or an earlier one."""
    saved = state.get("counters")
    if saved is None:
        earlier = {**state.get("counts", {}), **{k: state[k] for k in ("sheltered_done", "sheltered_attempts",
                                                                        "fit_ms", "untrusted_reasons", "warnings")
                                                  if k in state}}
        saved = {_EARLIER_COUNTERS.get(k, k): v for k, v in earlier.items()}
    names = {f.name for f in fields(MimoseCounters)}
    unknown = sorted(set(saved) - names)
    if unknown:
        raise ValueError(f"the saved mimose state counts {', '.join(unknown)}, which this release does not; "
                         "it was written by another mimose version")
    return MimoseCounters(**copy.deepcopy(saved))


class MimosePolicy(Policy):
    """Input-aware checkpointing: the paper's collector, estimator, scheduler and plan cache."""

    name = "mimose"
    builds_meter = True
    state_file = "estimator.json"

    def __init__(self, parts):
        super().__init__(parts)
        options = parts.options  # MimoseOptions: its ranges and rules checked there
        estimate, choices = options.estimate, options.choices
        if choices == "offload":
            check_offload_device(parts.model, "choices: offload", "use choices: selective")
        self.estimate = estimate
        self.choices = choices
        self._selectable = np.array(selectable(self.parts.blocks))
        """Blocks that may be checkpointed selectively: those without buffers."""
        blocks = range(self.parts.num_blocks)
        self._selective_needs = set(blocks), {(q, i) for q in SELECTIVE_QUANTITIES for i in blocks}
        """What ``_selective_known`` looks for: every block's heavy outputs kept, its selective bytes."""
        self._known: dict = {}  # ``_cached``'s: name -> (key, the objects read, value)
        self.choice_times: ChoiceTimes | None = None
        """What recomputing each block costs per choice (``choices="selective"`` or ``"offload"``,
        from the probes), and offloading it (``"offload"``)."""
        self.needs_prepare = estimate == "probes"  # the probes run once, before the first step
        self._loaded = False  # the estimator came from a saved state (no probes in this process)
        self.sheltered_steps = options.sheltered_steps
        self.granularity = options.granularity
        self.bucket = options.bucket
        # Predictions are exact to ~100 bytes on the simulated device (the sheltered steps are
        # measured checkpointed, the planned ones are not): a relative margin absorbs that.
        self.prediction_margin = options.prediction_margin
        self.estimator = Estimator(self.parts.num_blocks, feature_set_of(self.parts))
        self.measurer = ShuttlingCollector(parts.model, parts.blocks, parts.recompute_clock)
        self.cache: dict = {}
        self.recovery_margins: dict = {}  # cache key -> bytes kept free after it ran out of memory
        self.contradicted: set = set()  # cache keys whose planned step peaked above its prediction
        self.counts = MimoseCounters()
        if self.parts.budget_bytes is None:
            self._warn("mimose without a budget checkpoints nothing; it only fits its estimator")

    def _warn(self, message: str) -> None:
        if message not in self.counts.warnings:
            self.counts.warnings.append(message)
            warn_user(message)

    @property
    def sheltered(self) -> bool:
        """True while the collector runs: until ``sheltered_steps`` samples, unless loaded."""
        return not self.estimator.fitted

    def cache_key(self, size: tuple) -> tuple:
        """The plan-cache key: the batch size, and every other dimension rounded up."""
        g = self.granularity
        return (size[0],) + tuple(-(-d // g) * g for d in size[1:])

    def prepare(self, make_batch, max_input_size: tuple, reserve_bytes: int = 0, step_fn=None) -> None:
        """Before the first step: the estimate from two probe steps (``estimate="probes"``), each
        run by ``step_fn`` when given (training's autocast and loss scaling); where they cannot be
        scaled, say why once and learn from measured steps (the sheltered phase) instead."""
        probe, self.needs_prepare = self.needs_prepare and not self.estimator.fitted, False
        if probe:
            probes = Probes(self.parts, self.measurer, self.estimator.feature_set, self.choices, make_batch, step_fn)
            self._absorb(probes.run(tuple(max_input_size)))

    def prepare_from(self, make_batch, input_size: tuple, step_fn=None) -> None:
        """``prepare`` from the first step's batch (a loop of the user's own); none to probe
        with: learn from measured steps, saying why. The probes' time is then the step's too."""
        if make_batch is None:
            self.needs_prepare = False
            self.counts.estimate_fallback = ("no batch to probe with: pass planner.step(batch) a dict with input_ids "
                                             "or pixel_values, or call planner.prepare(make_batch, max_input_size)")
            self._warn(f"mimose: learning from measured steps: {self.counts.estimate_fallback}")
            return
        before = self.counts.probe_ms
        self.prepare(make_batch, input_size, step_fn=step_fn)
        self.counts.probe_in_step_ms += self.counts.probe_ms - before

    def _absorb(self, result: ProbeResult) -> None:
        """Take in what the probes found: their counts and warnings, the inputs blocks let go of,
        what the runner keeps, each choice's times; then fit their samples, or say why none."""
        for counter in fields(result.counts):
            found, held = getattr(result.counts, counter.name), getattr(self.counts, counter.name)
            setattr(self.counts, counter.name, found if isinstance(found, str) else held + found)
        for message in result.warnings:
            self._warn(message)
        if result.releases is not None:
            self.estimator.releases = self.measurer.releases = result.releases
        if result.timed is not None:
            timed, runner = result.timed, self.parts.plan_runner
            runner.selective_keep, runner.partial_keep, self.choice_times = (timed.selective_keep, timed.partial_keep,
                                                                              timed.times)
        if result.side_multiple is not None:
            self.estimator.side_multiple = result.side_multiple
        if result.feature_set is not None:  # read over more features (a B x B tensor): so is the fit
            self.estimator.feature_set = result.feature_set
        if result.fallback:
            self.counts.estimate_fallback = result.fallback
            self._warn(f"mimose: learning from measured steps (a sheltered phase of {self.sheltered_steps}): "
                       f"the probe steps cannot be scaled to other input sizes: {result.fallback}")
            return
        for size, sample in result.samples:
            self.estimator.add(size, *sample)
        self.counts.probe_samples = len(result.samples)
        self.counts.estimate_source = "probes"
        self._fit()

    def prepared_note(self) -> str | None:
        c = self.counts
        if self._loaded:
            return (f"mimose: memory estimate loaded with the checkpoint (fitted from {c.estimate_source or 'measured steps'}"
                    "); no probe steps")
        if c.estimate_source == "probes":
            left_out = f", {c.probe_skipped} of {self.parts.num_blocks} layers left out" if c.probe_skipped else ""
            return (f"mimose: memory estimate from {c.probe_steps} probe steps ({c.probe_ms / 1e3:.2f} s{left_out}, "
                    f"scaled to {c.probe_samples} sizes): the first batch is planned")
        if c.estimate_fallback:
            return f"mimose: learning from measured steps first: {c.estimate_fallback}"
        return None

    def decide(self, size: tuple, context: StepContext = NO_CONTEXT) -> Decision:
        """Sheltered: measure. Responsive: the cached plan for this size, else a new plan from the
        estimator when the rule in docs/MIMOSE.md trusts its prediction, else measure. The
        probes ran before (``prepare``, or ``prepare_from``: the planner's, before the first step)."""
        assert not self.needs_prepare, "MimosePolicy.decide before prepare: Planner._decide prepares it first"
        if self.sheltered:
            if not self.counts.estimate_source:
                self.counts.estimate_source = "sheltered"
            return self._measuring("sheltered", context.attempt)
        if self.parts.limit_bytes is None:
            return Decision((KEEP,) * self.parts.num_blocks, "responsive")
        key = self.cache_key(size)
        base = self._start_bytes()
        entry = self.cache.get(key)
        # A cached plan holds while the bytes at the step's start still leave it room, inside the
        # same limit a miss plans against (a recovery's margin kept).
        hit = key not in self.contradicted and entry is not None and (
            not entry.fits or base + entry.peak_bytes <= self._limit(key))
        if not hit:
            reason = self._contradiction(key) or self.estimator.trust.reason(key)
            if reason is not None:
                return self._untrusted(size, reason, context.attempt)
            entry = self._plan_miss(key, base)
        if hit:
            self.counts.hits += 1
        else:
            self.counts.misses += 1
        return Decision(entry.plan, "responsive", cache_hit=hit, predicted_peak_bytes=int(base + entry.peak_bytes))

    def _measuring(self, phase: str, attempt: int) -> Decision:
        """A step the collector measures (every block checkpointed); a retry after such a step
        ran out of memory is not measured again, only checkpointed."""
        plan = (RECOMPUTE,) * self.parts.num_blocks
        if attempt:
            return Decision(plan, "recovery")
        return Decision(plan, phase, measure=True)

    def _untrusted(self, size: tuple, reason: str, attempt: int) -> Decision:
        """No trusted prediction at this size: measure it (every block checkpointed meanwhile),
        and once measuring has been tried ``3 x sheltered_steps`` times, just checkpoint every
        block. Either way the reason is in ``stats``, never a guess."""
        self.counts.untrusted_steps += 1
        if self.counts.measuring_steps < 3 * self.sheltered_steps:
            self._note(f"not trusted, measured: {reason}", size)
            return self._measuring("measuring", attempt)
        self._note(f"not trusted, every block checkpointed: {reason}", size)
        return Decision((RECOMPUTE,) * self.parts.num_blocks, "untrusted")

    def _note(self, message: str, size: tuple) -> None:
        """Count a reason in ``stats``; warn the first time one is seen."""
        count = self.counts.untrusted_reasons.get(message, 0)
        self.counts.untrusted_reasons[message] = count + 1
        if not count:
            self._warn(f"mimose: input size {tuple(size)} {message}")

    def _start_bytes(self) -> int:
        """Bytes live at the step's start. Gradients already live (accumulation in a loop of the
        user's) count here and again where the fitted timeline allocates them in backward: over-,
        never under-predicted (``planner.run`` sets them aside, so there it is exact)."""
        return self.parts.meter.current_bytes() if self.parts.meter is not None else 0

    def _limit(self, key: tuple) -> int:
        """What a step of ``key`` may hold: the planner's limit less the margin a recovery set for it."""
        return self.parts.limit_bytes - self.recovery_margins.get(key, 0)

    def _plan_miss(self, key: tuple, base: int) -> tuple:
        start = time.perf_counter()
        pred = self.estimator.predict(key)
        limit = self._limit(key)
        if self._selective_known():
            features = self.estimator.feature_set.of(key)
            recompute_ms, selective_ms = self.choice_times.at(features)
            offload_ms = self.choice_times.offload_at(pred.blocks["saved_bytes"]) if self._offload_known() else None
            pred, whole_ms, offloaded = priced_freeing(pred, recompute_ms, offload_ms, self.choice_times.storages)
            timeline = Timeline(pred)  # the plans predicted below differ only in the blocks' choices
            partial_ms = self._partial_ms(features, selective_ms)
            # No saving, or buffers its recompute puts back (BatchNorm; torch's selective
            # checkpointing refuses them), or a partial level the block has not: not a choice for it.
            savings, costs = level_rows(pred, self._kept_known(partial_ms), selective_ms, partial_ms, whole_ms)
            plan, peak, fits = choice_plan_checked(
                savings, costs, lambda levels: base + self._margined(timeline.level_peaks(levels)), limit)
            plan = offloading(plan, offloaded)
        else:
            timeline = Timeline(pred)

            def predict_peak(blocks):
                return base + self._margined(timeline.plan_peak(recomputed(blocks, self.parts.num_blocks)))

            blocks, peak, fits = greedy_plan_checked(pred.savings.tolist(), predict_peak, limit, self.bucket)
            plan = recomputed(blocks, self.parts.num_blocks)
        if not fits:
            self.counts.unfit_plans += 1
            self._warn(f"input size {key} is predicted not to fit the budget even with every "
                       "block checkpointed; the step may run out of memory")
        entry = CachedPlan(plan, peak - base, fits)
        self.cache[key] = entry
        self.counts.scheduler_ms += (time.perf_counter() - start) * 1e3
        return entry

    def _selective_known(self) -> bool:
        """Whether plans may checkpoint blocks selectively: asked for, each block's selective
        bytes in the estimate (the probes measure them; measured training steps do not), how many
        heavy outputs it keeps and their recompute times known."""
        kept, estimated = self._selective_needs
        keeps, layout = self.parts.plan_runner.selective_keep, self.estimator.layout
        return self._cached("selective", (self.choices, len(keeps), len(layout)), (self.choice_times, keeps, layout),
                            lambda: (self.choices != "block" and self.choice_times is not None
                                     and keeps.keys() >= kept and layout.keys() >= estimated))

    def _cached(self, name: str, key: tuple, reads: tuple, work):
        """``work()``, worked out again only when ``key`` or one of the objects it ``reads`` (the
        estimate's layout, the runner's counts, the time model: held here, so told apart by
        identity) changed since it was last worked out for ``name``: a miss reads it every time,
        and its lookups over every block cost more than the schedule."""
        found = self._known.get(name)
        if found is None or found[0] != key or any(a is not b for a, b in zip(found[1], reads)):
            found = self._known[name] = (key, reads, work())
        return found[2]

    def _partial_ms(self, features: np.ndarray, selective_ms: np.ndarray) -> np.ndarray:
        """``(blocks, partial levels)``: each partial level's recompute ms (``ChoiceTimes.partial_at``),
        NaN where not known."""
        partial_ms = self.choice_times.partial_at(features, selective_ms)
        return np.full((self.parts.num_blocks, len(PARTIAL_LEVELS)), np.nan) if partial_ms is None else partial_ms

    def _kept_known(self, partial_ms: np.ndarray) -> list:
        """Per selective checkpoint (``features.KEPT_SETS``), a mask of the blocks that may take it:
        selectable (no buffers), and for a partial level its bytes in the estimate (the probes
        measured them), how many heavy outputs it keeps and its recompute time known."""
        keeps, layout, times = self.parts.plan_runner.partial_keep, self.estimator.layout, self.choice_times

        def structural():
            return [np.array([level in keeps.get(i, {}) and all((q, i) in layout for q in kept_quantities(level))
                              for i in range(self.parts.num_blocks)]) for level in PARTIAL_LEVELS]

        known = self._cached("partial", (len(keeps), len(layout)), (keeps, layout, times, times.partial_work),
                             structural)
        return [self._selectable] + [self._selectable & ~np.isnan(partial_ms[:, k]) & mask
                                     for k, mask in enumerate(known)]

    def _partial_levels(self) -> int:
        """How many (block, partial level) choices plans may take now: 0 unless selective plans are
        made and the probes found such levels (their bytes and times known)."""
        if not self._selective_known():
            return 0
        partial_ms = self._partial_ms(np.ones(len(self.estimator.feature_set.names)), np.zeros(self.parts.num_blocks))
        return int(sum(mask.sum() for mask in self._kept_known(partial_ms)[1:]))

    def _offload_known(self) -> bool:
        """Whether plans may offload blocks: asked for (``choices="offload"``), the finer choices
        priced (``_selective_known``), the copies timed and each block's saved storages counted."""
        times = self.choice_times
        return (self.choices == "offload" and self._selective_known() and times.copy_ms is not None
                and times.storages is not None)

    def size_key(self, size: tuple) -> tuple:
        return self.cache_key(size)

    def predict_peak(self, size: tuple, plan: tuple) -> int | None:
        """The trusted prediction for ``plan`` (one choice per block) at ``size``, its offloaded
        blocks bounded as recomputed with what they keep on the device
        (``choices.bounded_for_offload``), or None (not fitted, not trusted)."""
        key = self.cache_key(size)
        if not self.estimator.fitted or self.estimator.trust.reason(key) is not None:
            return None
        pred = self.estimator.predict(key)
        storages = None if self.choice_times is None else self.choice_times.storages
        pred = bounded_for_offload(pred, np.array([choice == OFFLOAD for choice in plan]), storages)
        return int(self._start_bytes() + self._margined(plan_peak_bytes(pred, plan)))

    def _margined(self, peak):
        """A timeline's peak (or peaks) with the prediction margin and the fit's residual
        (``Trust.residual_bytes``) on top."""
        return peak * (1.0 + self.prediction_margin) + self.estimator.trust.residual_bytes + self.counts.unseen_bytes

    def recover(self, info: StepInfo, failures: int, reached_bytes: int) -> bool:
        """First failure of a planned step: plan that size again with a margin (the larger of
        5 % of the budget and the prediction's shortfall, and twice the margin a failure of
        this size already left); a measuring step is retried unmeasured (``_measuring``);
        a second failure, or a step with no prediction, checkpoints every block."""
        if info.phase in ("sheltered", "measuring") and failures == 1:
            return True  # the retry runs checkpointed without the measuring runs
        if failures > 1 or info.phase != "responsive" or info.predicted_peak_bytes is None:
            return False
        key = self.cache_key(info.input_size)
        shortfall = reached_bytes - info.predicted_peak_bytes
        margin = max(0.05 * self.parts.limit_bytes, shortfall, 2 * self.recovery_margins.get(key, 0))
        self.recovery_margins[key] = int(margin)
        self.cache.pop(key, None)
        return True

    def observe(self, info: StepInfo, peak_bytes, sample) -> None:
        """Learn from a measured step's sample; count a planned step's under-prediction."""
        if info.measured:
            self.counts.sheltered_ms += info.step_ms
        else:
            self.counts.responsive_ms += info.step_ms
            self.counts.responsive_steps += 1
        if info.measured:
            self._collect(info, sample)
        if info.predicted_peak_bytes is None or peak_bytes is None:
            return
        under = peak_bytes - info.predicted_peak_bytes
        # The margin is in the prediction; under FSDP a buffer let go of a few ops later than in the
        # probes moves the peak, as far as the safety margin keeps room for it.
        if under <= min(self.parts.collective_jitter_bytes, self.parts.safety_margin_bytes):
            return
        self.counts.underpredictions += 1
        self.counts.max_underprediction_bytes = max(self.counts.max_underprediction_bytes, under)
        self._unseen(under)
        measured = tuple(info.input_size) in self.estimator.sizes
        if not measured and under > UNSEEN_SHARE * (self.parts.limit_bytes or 0):
            self.contradicted.add(self.cache_key(info.input_size))  # the fit may be wrong here: measure it

    def _unseen(self, under: int) -> None:
        """A planned step peaked ``under`` bytes above its prediction: bytes the probes' per-op
        timeline may not see (a GPU kernel's scratch memory, a library's workspace, FSDP's
        prefetched parameters beside a recompute). Measuring the size again cannot show those,
        and on an H200 measuring each such size cost 13 of 40 steps; so they are added to every
        prediction from now on (conservative where they do not recur), and the plans cached
        without them are planned again. A large shortfall at a size never measured also has that
        size measured (``observe``)."""
        self.counts.unseen_bytes += int(under)
        self.cache.clear()

    def distrust(self, size: tuple) -> None:
        self.contradicted.add(self.cache_key(tuple(size)))

    def _contradiction(self, key: tuple) -> str | None:
        """Why a size whose planned step peaked above its prediction is measured again, or None."""
        return "a planned step of this size peaked above its prediction" if key in self.contradicted else None

    def _collect(self, info: StepInfo, sample) -> None:
        if info.phase == "measuring":  # a size the fit did not determine: one more sample, refit
            self.counts.measuring_steps += 1
            self.contradicted.discard(self.cache_key(info.input_size))
            if sample is not None:
                self.estimator.add(info.input_size, *sample)
                self._fit()
            return
        self.counts.sheltered_attempts += 1
        if sample is not None:
            self.estimator.add(info.input_size, *sample)
            self.counts.sheltered_iterations += 1
        # Steps whose blocks were all filtered out do not count; after three times the planned
        # length the estimator makes do with what it has.
        enough = self.counts.sheltered_iterations >= self.sheltered_steps or (
            self.counts.sheltered_iterations and self.counts.sheltered_attempts >= 3 * self.sheltered_steps)
        if not self.counts.sheltered_iterations and self.counts.sheltered_attempts == 3 * self.sheltered_steps:
            self._warn("the collector could not measure any block (checkpointed by the model "
                       "itself?); mimose keeps checkpointing every block")
        if enough:
            self._fit()

    def _fit(self) -> None:
        """Fit the estimator; plans made from the previous fit are dropped."""
        start = time.perf_counter()
        self.estimator.fit()
        self.cache = {}
        self.counts.estimator_fit_ms += (time.perf_counter() - start) * 1e3

    def stats(self, counted: dict) -> dict:
        c = self.counts
        lookups = c.hits + c.misses
        # An ordinary step: the mean over responsive ones (the summary's mean iteration counts all).
        iteration_ms = c.responsive_ms / c.responsive_steps if c.responsive_steps else None
        # Probes run in the first step (``prepare_from``) are in its planning time already.
        overhead_ms = (self.measurer.collector_ms + c.estimator_fit_ms + counted["planning_ms_total"]
                       + c.probe_ms - c.probe_in_step_ms)
        return {**asdict(c), "phase": "sheltered" if self.sheltered else "responsive",
                "collector_ms": self.measurer.collector_ms,
                "scheduler_ms_mean": c.scheduler_ms / c.misses if c.misses else 0.0,
                "hit_rate": c.hits / lookups if lookups else 0.0, "cached_plans": len(self.cache),
                "responsive_iteration_ms": iteration_ms, "overhead_ms": overhead_ms,
                "overhead_iterations": overhead_ms / iteration_ms if iteration_ms else None,
                # Everything the sheltered phase cost beyond ordinary steps: the measuring passes
                # plus checkpointing every block and the live-bytes probe while collecting.
                "sheltered_extra_iterations": (
                    c.sheltered_ms / iteration_ms - c.sheltered_iterations - c.measuring_steps
                    if iteration_ms else None),
                "fit_residual_bytes": self.estimator.trust.residual_bytes,
                # ``choices: selective`` asked for, but block-level plans when it cannot be priced
                "selective_in_use": self._selective_known(),
                "offload_in_use": self._offload_known(),
                # how many (block, partial level) choices plans may take (``features.PARTIAL_LEVELS``)
                "partial_levels": self._partial_levels(),
                "recovery_margins": {str(k): v for k, v in self.recovery_margins.items()}}

    def state_dict(self) -> dict:
        return {"num_blocks": self.parts.num_blocks, "granularity": self.granularity,
                "estimator": self.estimator.state_dict(),
                "cache": [[list(k), list(v.plan), v.peak_bytes, v.fits] for k, v in self.cache.items()],
                "choices": self.choices,
                "choice_times": self.choice_times.state_dict() if self.choice_times is not None else None,
                "selective_keep": [[i, k] for i, k in self.parts.plan_runner.selective_keep.items()],
                "partial_keep": [[i, level, k] for i, levels in self.parts.plan_runner.partial_keep.items()
                                 for level, k in levels.items()],
                "recovery_margins": [[list(k), v] for k, v in self.recovery_margins.items()],
                "counters": asdict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the fitted estimator and plan cache; a fitted one skips the sheltered phase.
        Cached plans are kept only when the granularity is unchanged."""
        self.estimator.load_state_dict(state["estimator"])
        self.measurer.releases = self.estimator.releases
        self.counts = _counters_of(state)
        self.needs_prepare = False
        self._loaded = True
        self.cache = {}
        self.choice_times = (ChoiceTimes.from_state(state.get("choice_times"), self.estimator.feature_set)
                             if self.choices != "block" else None)
        self.parts.plan_runner.selective_keep = {int(i): int(k) for i, k in state.get("selective_keep", [])}
        partial_keep: dict = {}
        for i, level, k in state.get("partial_keep", []):
            partial_keep.setdefault(int(i), {})[level] = int(k)
        self.parts.plan_runner.partial_keep = partial_keep
        unknown = offload_unknown(self.choices, self.choice_times, "the saved estimator has no copy costs (saved "
                                  "without choices: offload, or their timing failed); move its estimator.json aside "
                                  "to probe again")
        if unknown is not None:
            self._warn(unknown)
        if state.get("granularity") == self.granularity and state.get("choices", "block") == self.choices:
            self.cache = {tuple(k): CachedPlan(_cached_plan(p, rest, self.parts.num_blocks), float(peak), bool(fits))
                          for k, p, peak, fits, *rest in state.get("cache", [])}
        self.recovery_margins = {tuple(k): v for k, v in state.get("recovery_margins", [])}


def _cached_plan(plan: list, rest: list, num_blocks: int) -> tuple:
    """A saved plan-cache entry's plan; the previous release saved block indices with the
    selective, offload and partial fields after the entry's fit (``blocks.plan_of_fields``)."""
    if all(isinstance(choice, str) for choice in plan) and len(plan) == num_blocks and not rest:
        return tuple(plan)
    return plan_of_fields(num_blocks, plan, *rest)


def Mimose(model, budget=None, **options) -> Planner:
    """``Planner(model, MimosePolicy, budget, **options)``: the options are ``MimosePolicy``'s
    (``estimate``, ``sheltered_steps``, ``granularity``, ``bucket``, ``prediction_margin``,
    ``choices``) and the planner's (``blocks``, ``safety_margin``, ``meter``)."""
    return Planner(model, MimosePolicy, budget, **options)
