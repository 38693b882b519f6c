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

import time
import warnings
from typing import NamedTuple

import numpy as np

from mimose_cli.planners.base import Decision, Planner, StepInfo
from mimose_cli.planners.collector import ShuttlingCollector
from mimose_cli.planners.estimator import Estimator, peak_timeline
from mimose_cli.planners.features import SEQ2SEQ, TOKENS
from mimose_cli.planners.scheduler import greedy_plan_checked


class CachedPlan(NamedTuple):
    """A plan-cache entry: the plan, its predicted peak above the step's start, and whether that
    fits the budget."""

    plan: tuple
    peak_bytes: float
    fits: bool


class Mimose(Planner):
    """Input-aware checkpointing: the paper's collector, estimator, scheduler and plan cache."""

    name = "mimose"
    builds_meter = True
    state_file = "estimator.json"

    def __init__(self, model, budget=None, *, blocks=None, safety_margin="auto", meter=None,
                 sheltered_steps: int = 5, granularity: int = 1, bucket: float = 0.10,
                 prediction_margin: float = 0.001):
        if not isinstance(sheltered_steps, int) or sheltered_steps < 1:
            raise ValueError(f"sheltered_steps={sheltered_steps!r} is invalid; expected an integer >= 1")
        if not isinstance(granularity, int) or granularity < 1:
            raise ValueError(f"granularity={granularity!r} is invalid; expected an integer >= 1")
        if not 0.0 <= bucket < 1.0:
            raise ValueError(f"bucket={bucket!r} is invalid; expected a fraction in [0, 1)")
        if not 0.0 <= prediction_margin < 1.0:
            raise ValueError(f"prediction_margin={prediction_margin!r} is invalid; expected a fraction in [0, 1)")
        super().__init__(model, budget, blocks=blocks, safety_margin=safety_margin, meter=meter)
        self.sheltered_steps = sheltered_steps
        self.granularity = granularity
        self.bucket = bucket
        # Predictions are exact to ~100 bytes on the simulated device (the sheltered steps are
        # measured checkpointed, the planned ones are not): a relative margin absorbs that.
        self.prediction_margin = prediction_margin
        self.estimator = Estimator(self.num_blocks, SEQ2SEQ if self.encoder_decoder else TOKENS)
        self.measurer = ShuttlingCollector(model, self.blocks, self.recompute_clock)
        self.cache: dict = {}
        self.sheltered_done = 0
        self.sheltered_attempts = 0
        self.fit_ms = 0.0
        self.recovery_margins: dict = {}  # cache key -> bytes kept free after it ran out of memory
        self.untrusted_reasons: dict = {}  # why predictions were not trusted -> steps
        self.counts = {"hits": 0, "misses": 0, "scheduler_ms": 0.0, "unfit_plans": 0,
                       "untrusted": 0, "measuring": 0,
                       "underpredictions": 0, "max_underprediction_bytes": 0,
                       "sheltered_ms": 0.0, "responsive_ms": 0.0, "responsive_steps": 0}
        self.warnings: list = []
        if self.budget_bytes is None:
            self._warn("mimose without a budget checkpoints nothing; it only fits its estimator")

    def _warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            warnings.warn(message, stacklevel=3)

    @property
    def sheltered(self) -> bool:
        """True while the collector runs: until ``sheltered_steps`` samples, unless loaded."""
        return not self.estimator.fitted

    def cache_key(self, size: tuple) -> tuple:
        """The plan-cache key: the batch size, and every other dimension rounded up."""
        g = self.granularity
        return (size[0],) + tuple(-(-d // g) * g for d in size[1:])

    def decide(self, size: tuple) -> Decision:
        """Sheltered: measure. Responsive: the cached plan for this size, else a new plan from the
        estimator when the rule in docs/MIMOSE.md trusts its prediction, else measure."""
        if self.sheltered:
            return self._measuring(size, "sheltered")
        if self.limit_bytes is None:
            return Decision(())
        key = self.cache_key(size)
        base = self._start_bytes()
        entry = self.cache.get(key)
        # A cached plan holds while the bytes at the step's start still leave it room.
        hit = entry is not None and (not entry.fits or base + entry.peak_bytes <= self.limit_bytes)
        if not hit:
            reason = self.estimator.trust.reason(key)
            if reason is not None:
                return self._untrusted(size, reason)
            entry = self._plan_miss(key, base)
        self.counts["hits" if hit else "misses"] += 1
        return Decision(entry.plan, cache_hit=hit, predicted_peak_bytes=int(base + entry.peak_bytes))

    def _measuring(self, size: tuple, phase: str) -> Decision:
        """A step the collector measures (every block checkpointed); a retry after such a step
        ran out of memory is not measured again, only checkpointed."""
        plan = tuple(range(self.num_blocks))
        if self.attempt:
            return Decision(plan, "recovery")
        return Decision(plan, phase, measure=True)

    def _untrusted(self, size: tuple, reason: str) -> Decision:
        """No trusted prediction at this size: measure it (every block checkpointed meanwhile),
        and once measuring has been tried ``3 x sheltered_steps`` times, just checkpoint every
        block. Either way the reason is in ``stats``, never a guess."""
        self.counts["untrusted"] += 1
        if self.counts["measuring"] < 3 * self.sheltered_steps:
            self._note(f"not trusted, measured: {reason}", size)
            return self._measuring(size, "measuring")
        self._note(f"not trusted, every block checkpointed: {reason}", size)
        return Decision(tuple(range(self.num_blocks)), "untrusted")

    def _note(self, message: str, size: tuple) -> None:
        """Count a reason in ``stats``; warn the first time one is seen."""
        count = self.untrusted_reasons.get(message, 0)
        self.untrusted_reasons[message] = count + 1
        if not count:
            self._warn(f"mimose: input size {tuple(size)} {message}")

    def _start_bytes(self) -> int:
        """Bytes live at the step's start. Gradients already live (accumulation in a loop of the
        user's) count here and again where the fitted timeline allocates them in backward: over-,
        never under-predicted (``planner.run`` sets them aside, so there it is exact)."""
        return self.meter.current_bytes() if self.meter is not None else 0

    def _plan_miss(self, key: tuple, base: int) -> tuple:
        start = time.perf_counter()
        pred = self.estimator.predict(key)

        def predict_peak(plan):
            return base + self._timeline_peak(pred, plan)

        limit = self.limit_bytes - self.recovery_margins.get(key, 0)
        plan, peak, fits = greedy_plan_checked(pred.savings.tolist(), predict_peak, limit, self.bucket)
        if not fits:
            self.counts["unfit_plans"] += 1
            self._warn(f"input size {key} is predicted not to fit the budget even with every "
                       "block checkpointed; the step may run out of memory")
        entry = CachedPlan(plan, peak - base, fits)
        self.cache[key] = entry
        self.counts["scheduler_ms"] += (time.perf_counter() - start) * 1e3
        return entry

    def size_key(self, size: tuple) -> tuple:
        return self.cache_key(size)

    def predict_peak(self, size: tuple, plan: tuple) -> int | None:
        """The trusted prediction for ``plan`` at ``size``, or None (not fitted, not trusted)."""
        key = self.cache_key(size)
        if not self.estimator.fitted or self.estimator.trust.reason(key) is not None:
            return None
        return int(self._start_bytes() + self._timeline_peak(self.estimator.predict(key), plan))

    def _timeline_peak(self, pred, plan) -> float:
        """The predicted peak above the step's start for ``plan``, with the prediction margin
        and the fit's residual (``Trust.residual_bytes``) on top."""
        masks = np.zeros(self.num_blocks, dtype=bool)
        masks[list(plan)] = True
        peak = float(peak_timeline(pred, masks).max())
        return peak * (1.0 + self.prediction_margin) + self.estimator.trust.residual_bytes

    def recover(self, info: StepInfo, failures: int, reached_bytes: int) -> None:
        """First failure of a planned step: plan that size again with a margin (the larger of
        5 % of the budget and the prediction's shortfall, and twice the margin a failure of
        this size already left); a measuring step is retried unmeasured (``_measuring``);
        a second failure, or a step with no prediction, checkpoints every block."""
        if info.phase in ("sheltered", "measuring") and failures == 1:
            return  # the retry runs checkpointed without the measuring runs
        if failures > 1 or info.phase != "responsive" or info.predicted_peak_bytes is None:
            super().recover(info, failures, reached_bytes)
            return
        key = self.cache_key(info.input_size)
        shortfall = reached_bytes - info.predicted_peak_bytes
        margin = max(0.05 * self.limit_bytes, shortfall, 2 * self.recovery_margins.get(key, 0))
        self.recovery_margins[key] = int(margin)
        self.cache.pop(key, None)

    def observe(self, info: StepInfo, peak_bytes, sample) -> None:
        """Learn from a measured step's sample; count a planned step's under-prediction."""
        self.counts["sheltered_ms" if info.measured else "responsive_ms"] += info.step_ms
        self.counts["responsive_steps"] += 0 if info.measured else 1
        if info.measured:
            self._collect(info, sample)
        if info.predicted_peak_bytes is None or peak_bytes is None:
            return
        under = peak_bytes - info.predicted_peak_bytes
        if under > 0:
            self.counts["underpredictions"] += 1
            self.counts["max_underprediction_bytes"] = max(self.counts["max_underprediction_bytes"], under)

    def _collect(self, info: StepInfo, sample) -> None:
        if info.phase == "measuring":  # a size the fit did not determine: one more sample, refit
            self.counts["measuring"] += 1
            if sample is not None:
                self.estimator.add(info.input_size, *sample)
                self._fit()
            return
        self.sheltered_attempts += 1
        if sample is not None:
            self.estimator.add(info.input_size, *sample)
            self.sheltered_done += 1
        # Steps whose blocks were all filtered out do not count; after three times the planned
        # length the estimator makes do with what it has.
        enough = self.sheltered_done >= self.sheltered_steps or (
            self.sheltered_done and self.sheltered_attempts >= 3 * self.sheltered_steps)
        if not self.sheltered_done and self.sheltered_attempts == 3 * self.sheltered_steps:
            self._warn("the collector could not measure any block (checkpointed by the model "
                       "itself?); mimose keeps checkpointing every block")
        if enough:
            self._fit()

    def _fit(self) -> None:
        """Fit the estimator; plans made from the previous fit are dropped."""
        start = time.perf_counter()
        self.estimator.fit()
        self.cache = {}
        self.fit_ms += (time.perf_counter() - start) * 1e3

    @property
    def stats(self) -> dict:
        c = self.counts
        lookups = c["hits"] + c["misses"]
        iteration_ms = c["responsive_ms"] / c["responsive_steps"] if c["responsive_steps"] else None
        overhead_ms = self.measurer.collector_ms + self.fit_ms + self.total_planning_ms
        return {**super().stats, "phase": "sheltered" if self.sheltered else "responsive",
                "sheltered_iterations": self.sheltered_done, "collector_ms": self.measurer.collector_ms,
                "sheltered_ms": c["sheltered_ms"], "estimator_fit_ms": self.fit_ms,
                "scheduler_ms_mean": c["scheduler_ms"] / c["misses"] if c["misses"] else 0.0,
                "misses": c["misses"], "hits": c["hits"],
                "hit_rate": c["hits"] / lookups if lookups else 0.0,
                "cached_plans": len(self.cache), "unfit_plans": c["unfit_plans"],
                "underpredictions": c["underpredictions"],
                "max_underprediction_bytes": c["max_underprediction_bytes"],
                "mean_iteration_ms": iteration_ms,
                "overhead_ms": overhead_ms,
                "overhead_iterations": overhead_ms / iteration_ms if iteration_ms else None,
                # Everything the sheltered phase cost beyond ordinary steps: the measuring passes
                # plus checkpointing every block and the live-bytes probe while collecting.
                "sheltered_extra_iterations": (
                    c["sheltered_ms"] / iteration_ms - self.sheltered_done - c["measuring"]
                    if iteration_ms else None),
                # The trust rule's record (docs/MIMOSE.md): steps whose size the fit did not
                # determine, how many of them were measured, and why.
                "untrusted_steps": c["untrusted"], "measuring_steps": c["measuring"],
                "untrusted_reasons": dict(self.untrusted_reasons),
                "fit_residual_bytes": self.estimator.trust.residual_bytes,
                "recovery_margins": {str(k): v for k, v in self.recovery_margins.items()},
                "warnings": list(self.warnings)}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "num_blocks": self.num_blocks, "granularity": self.granularity,
                "sheltered_done": self.sheltered_done, "sheltered_attempts": self.sheltered_attempts,
                "estimator": self.estimator.state_dict(),
                "cache": [[list(k), list(v.plan), v.peak_bytes, v.fits] for k, v in self.cache.items()],
                "recovery_margins": [[list(k), v] for k, v in self.recovery_margins.items()],
                "counts": dict(self.counts), "fit_ms": self.fit_ms,
                "untrusted_reasons": dict(self.untrusted_reasons), "warnings": list(self.warnings)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the fitted estimator and plan cache; a fitted one skips the sheltered phase.
        Cached plans are kept only when the granularity is unchanged."""
        if state.get("name", self.name) != self.name:
            raise ValueError(f"this state was written by planner {state.get('name')!r}, not mimose")
        super().load_state_dict(state)
        self.estimator.load_state_dict(state["estimator"])
        self.sheltered_done = state.get("sheltered_done", 0)
        self.sheltered_attempts = state.get("sheltered_attempts", self.sheltered_done)
        self.cache = {}
        if state.get("granularity") == self.granularity:
            self.cache = {tuple(k): CachedPlan(tuple(p), float(peak), bool(fits))
                          for k, p, peak, fits in state.get("cache", [])}
        self.recovery_margins = {tuple(k): v for k, v in state.get("recovery_margins", [])}
        self.counts.update(state.get("counts", {}))
        self.fit_ms = state.get("fit_ms", 0.0)
        self.untrusted_reasons = dict(state.get("untrusted_reasons", {}))
        self.warnings = list(state.get("warnings", []))
