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
import math
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
from mimose_cli.planners.inputs import infer_input_size, resized_batch, with_padding
from mimose_cli.planners.mimose.choices import (
    ChoiceTimes,
    bounded_for_offload,
    choice_plan_checked,
    copy_costs_ms,
    dispatch_costs_ms,
    freeing_ms,
    level_rows,
    probe_rates_ms,
)
from mimose_cli.planners.mimose.collector import InputReleases, ShuttlingCollector
from mimose_cli.planners.mimose.estimator import Estimator, Timeline, plan_peak_bytes
from mimose_cli.planners.mimose.features import feature_set_of, kept_quantities
from mimose_cli.planners.mimose.layout import first_runs_otherwise, left_out, stack_runs, twin_blocks
from mimose_cli.planners.mimose.scaling import (
    SELECTIVE_QUANTITIES,
    SIDE_PAIR,
    ScaledStep,
    ScalingError,
    deeper_by_one,
    partial_keeps,
    partial_prefixes,
    probe_batches,
    probe_sizes,
    raw_sample,
    run_difference,
    sample_difference,
    selective_keeps,
    structure_difference,
    twin_difference,
)
from mimose_cli.planners.mimose.scheduler import greedy_plan_checked
from mimose_cli.planners.parts import check_offload_device
from mimose_cli.planners.trial import probe_step, probe_with_runner, to_model_device
from mimose_cli.planners.usage import said, warn_user
from mimose_cli.torch_private import without_dispatch_modes


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


def _skipped(runs: list) -> list:
    """The blocks ``runs`` (``blocks.stack_runs``) leave out."""
    return [i for _, run in runs for i in run]


def _layers(runs: list) -> str:
    """The layers ``runs`` leave out, in words: "layers 3-6" (and "8-10")."""
    return "layers " + " and ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for _, run in runs)


class _TwinsRefused(ScalingError):
    """Probes that left layers out found blocks alike running otherwise (``mismatch``, a
    ``scaling.Mismatch``)."""

    def __init__(self, mismatch):
        super().__init__(f"blocks alike ran otherwise ({mismatch.why})")
        self.mismatch = mismatch


def _first_twin(mismatch, twins: dict) -> bool:
    """Whether ``mismatch`` (``scaling.Mismatch`` or None) is of the first block taken for its
    group's leader: then the leader, not the twin, may be the one that runs otherwise."""
    return mismatch is not None and mismatch.block == min(i for i, t in twins.items() if t == mismatch.twin)


def _probe_failed(what: str, size: tuple, error: Exception) -> ScalingError:
    """A probe step that raised, in one line (the planner then learns from measured steps)."""
    return ScalingError(f"the {what} at input size {size} failed ({said(error, 160)})")


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
        self._probed = estimate != "probes"  # the probes run once, before the first step
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
        run by ``step_fn`` when given (training's autocast and loss scaling)."""
        self._probe(make_batch, tuple(max_input_size), step_fn)

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

    def _probe(self, make_batch, max_size: tuple, step_fn=None) -> None:
        """Run the two probe steps (``planners.scaling``) and fit the estimator from samples
        scaled from them; where they cannot be scaled, say why once and learn from measured
        steps (the sheltered phase) instead."""
        if self._probed or self.estimator.fitted:
            self._probed = True
            return
        self._probed = True
        start = time.perf_counter()
        collector_ms = self.measurer.collector_ms
        try:
            # The probes' batches and steps are the planner's, not training's: the device's meter
            # (a dispatch mode on the CPU) is set aside, and the probe counts its own bytes.
            with without_dispatch_modes():
                samples = self._probe_samples(make_batch, max_size, step_fn)
        except ScalingError as err:
            self.counts.estimate_fallback = str(err)
            self._warn(f"mimose: learning from measured steps (a sheltered phase of {self.sheltered_steps}): "
                       f"the probe steps cannot be scaled to other input sizes: {err}")
            return
        finally:
            self.measurer.collector_ms = collector_ms  # the probes' measuring runs are in probe_ms
            self.counts.probe_ms += (time.perf_counter() - start) * 1e3
        if self.choice_times is not None:  # part of the probes' time
            start = time.perf_counter()
            self.choice_times.meter_ms, self.choice_times.mode_ms = dispatch_costs_ms()
            self.counts.probe_ms += (time.perf_counter() - start) * 1e3
        for size, sample in samples:
            self.estimator.add(size, *sample)
        self.counts.probe_samples = len(samples)
        self.counts.estimate_source = "probes"
        self._fit()

    def _probe_samples(self, make_batch, max_size: tuple, step_fn) -> list:
        """The probe steps, scaled: ``[(size, sample)]`` at the sizes that determine the fit."""
        try:
            first = make_batch(max_size)
        except Exception as error:  # a batch this planner cannot cut (only inputs_embeds, ...)
            raise ScalingError(f"no probe batch can be made from this batch ({type(error).__name__}: "
                               f"{str(error)[:120]})") from error
        images = isinstance(first, dict) and first.get("pixel_values") is not None
        del first
        if not images:
            return self._probes_at(self._probe_sizes(make_batch, max_size, True), max_size, make_batch, step_fn)
        # An image's sides are probed at two sizes (a CNN takes any) when the largest image is at
        # least the larger (the probes cost no more than a real batch's images); a model that
        # takes only its own sides (position embeddings) is probed at them, only the batch varying.
        if min(max_size[1:]) >= SIDE_PAIR[1]:
            sizes = self._probe_sizes(make_batch, max_size, True, image=True)
            try:
                samples = self._probes_at(sizes, max_size, make_batch, step_fn)
                self.estimator.side_multiple = math.gcd(*SIDE_PAIR)
                return samples
            except ScalingError as err:
                self.counts.probe_sides_refused = str(err)
        else:
            self.counts.probe_sides_refused = (f"the largest image, {max_size[1]} x {max_size[2]}, is smaller than "
                                               f"{SIDE_PAIR[1]} px: its sides are probed as they are")
        return self._probes_at(self._probe_sizes(make_batch, max_size, False), max_size, make_batch, step_fn)

    def _probes_at(self, sizes: list, max_size: tuple, make_batch, step_fn) -> list:
        """The plain probe step and the two measured ones at ``sizes``, scaled (``_probe_samples``)."""
        # A block like an earlier one (a layer of a stack) skips its measuring run, and the
        # layers of a long stack between the template and its last are left out of the probes
        # (the template stands for them): the probes cost about as much at any depth. Should the
        # left-out layers not be describable, every layer runs; should a group's first block not
        # run as the others, its second stands for them; should layers alike still not run
        # alike, every block is measured.
        for first_leads in (True, False):
            twins, runs = self._probe_layout(make_batch, sizes[0], step_fn, first_leads)
            mismatch = None  # blocks alike that did not run alike (``scaling.Mismatch``)
            if runs:
                try:
                    return self._left_out_probes(sizes, max_size, make_batch, step_fn, twins, runs)
                except ValueError as err:  # a ScalingError, or a list the layers cannot be taken out of
                    self.counts.probe_skips_refused = f"with {_layers(runs)} left out, {err}"
                    mismatch = err.mismatch if isinstance(err, _TwinsRefused) else None
            if twins and mismatch is None:
                raws = self._probe_pair(make_batch, sizes, step_fn, twins)
                mismatch = next(filter(None, map(twin_difference, raws)), None)
                if mismatch is None:
                    return self._pair_samples(raws, sizes, max_size, twins)
                self.counts.probe_twins_refused = mismatch.why
            if not (first_leads and _first_twin(mismatch, twins)) or self.counts.probe_first_refused:
                break
            # The group's first twin ran otherwise than the block standing for the group: that
            # block may be the odd one (a stack's first layer), so the second stands for them.
            self.counts.probe_first_refused = f"blocks alike ran otherwise ({mismatch.why})"
            self.counts.probe_twins_refused = ""
        return self._pair_samples(self._probe_pair(make_batch, sizes, step_fn, {}), sizes, max_size, {})

    def _pair_samples(self, raws: list, sizes: list, max_size: tuple, twins: dict) -> list:
        """The two measured probe steps (every layer run), scaled to samples at every size."""
        self.counts.probe_twins = len(raws[0].twins)
        prefixes = partial_prefixes(raws[0], self.parts.num_blocks, {})
        scaled = ScaledStep(raws[0], sizes[0], raws[1], sizes[1], self.estimator.feature_set, self.parts.num_blocks,
                            partial_keep=partial_keeps(prefixes))
        self._time_choices(raws, sizes, max_size, twins, [], prefixes)
        return [(size, scaled.sample(size)) for size in scaled.sizes(max_size)]

    def _left_out_probes(self, sizes: list, max_size: tuple, make_batch, step_fn, twins: dict, runs: list) -> list:
        """The two measured probe steps with the layers of ``runs`` left out, scaled and written
        out for every layer (``scaling.Deepening``), checked by one more probe step at the smaller
        size with one layer more of each run kept: written out too, it must say the same (memory
        that grows with the layers outside them, the head stacking every layer's output, does
        not). Raises ValueError where they cannot stand for every layer."""
        with left_out(self.parts.model, self.parts.blocks, _skipped(runs)):
            raws = self._probe_pair(make_batch, sizes, step_fn, twins)
        mismatch = next(filter(None, map(twin_difference, raws)), None) or run_difference(raws[0], runs, twins)
        if mismatch is not None:  # nor would they with every layer run
            self.counts.probe_twins_refused = mismatch.why
            raise _TwinsRefused(mismatch)
        n = self.parts.num_blocks
        # What each partial level keeps, one count per block for the estimate and the runner: a
        # left-out layer's its template's, whose bytes it is written out with (``Deepening``).
        prefixes = partial_prefixes(raws[0], n, {i: template for template, skipped in runs for i in skipped})
        keep = partial_keeps(prefixes)
        scaled = ScaledStep(raws[0], sizes[0], raws[1], sizes[1], self.estimator.feature_set, n, runs, keep)
        deeper = deeper_by_one(runs)
        with left_out(self.parts.model, self.parts.blocks, _skipped(deeper)):
            check = self._probe_step(make_batch, sizes[0], step_fn, twins)
        self.counts.probe_steps += 1
        where = sample_difference(raw_sample(raws[0], n, runs, keep), raw_sample(check, n, deeper, keep))
        if where is not None:
            raise ScalingError(f"{where} changes when one more of them runs (memory that grows with the layers)")
        self.counts.probe_twins = len(raws[0].twins)
        self.counts.probe_skipped = len(_skipped(runs))
        self._time_choices(raws, sizes, max_size, twins, runs, prefixes)
        return [(size, scaled.sample(size)) for size in scaled.sizes(max_size)]

    def _time_choices(self, raws: list, sizes: list, max_size: tuple, twins: dict, runs: list, prefixes: list) -> None:
        """With ``choices="selective"`` or ``"offload"``: each choice's recompute time per block from
        the probes' measuring runs (``ChoiceTimes``), the ops' rates timed on a matmul and a
        pointwise op as large as the largest batch's (``choices.probe_rates_ms``; the device's
        meter is set aside here); a block run without a measuring run takes the block like it.
        With ``"offload"`` also the copies' costs (``choices.copy_costs_ms``). Whatever the
        choices, the runner learns how many heavy outputs each selective and partial checkpoint
        keeps (``prefixes``: what the estimate's bytes for them assume)."""
        stand_in = dict(twins)
        for template, skipped in runs:
            stand_in.update({i: twins.get(template, template) for i in skipped})
        keeps = selective_keeps(raws[0], self.parts.num_blocks, stand_in)
        self.parts.plan_runner.selective_keep = {i: k for i, k in enumerate(keeps) if k is not None}
        self.parts.plan_runner.partial_keep = partial_keeps(prefixes)
        if self.choices == "block":
            return
        # The dispatch modes' costs are timed once the device's meter is back (``_probe``).
        self.choice_times = ChoiceTimes.from_probes(raws, sizes, self.estimator.feature_set, stand_in, (0.0, 0.0),
                                                    self._rates(raws[1], sizes[1], max_size), prefixes)
        if self.choice_times is None:
            self._warn(f"mimose: plans stay block-level (choices: {self.choices} asked for): the probes' ops did not "
                       "run alike at their two sizes, so each choice's recompute time cannot be scaled")
        elif self.choices == "offload":
            self.choice_times.copy_ms = self.parts.timed_or_warned(copy_costs_ms, "mimose: the copies' costs",
                                                                   self._warn)
            self._warn_if_offload_unknown("the copies' costs or the probes' saved storages are not known")

    def _warn_if_offload_unknown(self, why: str) -> None:
        """With ``choices="offload"`` but the copies' costs or the blocks' saved storages unknown
        (``choices.ChoiceTimes.offload_at`` cannot price an offload): say so once (plans still keep,
        checkpoint selectively or recompute)."""
        times = self.choice_times
        if self.choices == "offload" and times is not None and (times.copy_ms is None or times.storages is None):
            self._warn(f"mimose: no block is offloaded (choices: offload asked for): {why}; plans keep, "
                       "checkpoint selectively or recompute")

    def _rates(self, raw, size: tuple, max_size: tuple) -> tuple | None:
        """The ops' ms per unit of work (``choices.probe_rates_ms``); None where they cannot be
        timed: the probes' own timings stand in."""
        rates = self.parts.timed_or_warned(lambda device: probe_rates_ms(raw, size, max_size, device),
                                           "mimose: the ops' rates", self._warn)
        if rates is None:
            self._warn("mimose: recompute times are scaled from the probes' own timings")
        return rates

    def _probe_pair(self, make_batch, sizes: list, step_fn, twins: dict) -> list:
        """The two measured probe steps at ``sizes`` (``RawStep``s), the first once more when it
        ran otherwise than the second: what only the first step of a process does (a GradScaler
        creating its scale, a lazily built cache)."""
        raws = [self._probe_step(make_batch, size, step_fn, twins) for size in sizes]
        self.counts.probe_steps += 2
        if structure_difference(*raws) is not None:
            raws[0] = self._probe_step(make_batch, sizes[0], step_fn, twins)
            self.counts.probe_steps += 1
        return raws

    def _probe_layout(self, make_batch, size: tuple, step_fn, first_leads: bool = True) -> tuple:
        """``(twins, runs)``: the blocks the probes take as an earlier block alike (``twin_blocks``)
        and the layers they leave out (``stack_runs``), after the plain probe step
        (``_probe_releases``). With ``first_leads`` a group's first block stands for the others,
        unless the plain probe step saw its inputs need gradients otherwise than the next one's
        (frozen embeddings): then, as without ``first_leads``, its second does, and the plain
        probe step runs again without the layers that leaves out."""
        def layout(first_leads: bool) -> tuple:
            twins = twin_blocks(self.parts.blocks, first_leads)
            runs, self.counts.probe_skips_refused = stack_runs(self.parts.blocks, twins)
            return (twins, *self._probe_releases(make_batch, size, step_fn, runs))

        if first_leads:
            twins, runs, input_grads = layout(True)
            refused = first_runs_otherwise(twins, input_grads)
            if refused is None:
                return twins, runs
            self.counts.probe_first_refused = refused
        return layout(False)[:2]

    def _probe_releases(self, make_batch, size: tuple, step_fn, runs: list) -> tuple:
        """A plain probe step at ``size``: which inputs blocks run plainly let go of
        (``collector.InputReleases``); the collector measures their bytes from then on. The
        layers of ``runs`` are left out (``Releases.deepened``); where that cannot be described
        (or run), the step runs again with every layer. Returns the runs still to leave out and
        whether each block's tensor inputs needed gradients (``InputReleases.input_grads``)."""
        if runs:
            try:
                releases, input_grads = self._plain_probe(make_batch, size, step_fn, runs)
            except ValueError as err:  # a ScalingError, or releases a deeper stack cannot have
                self.counts.probe_skips_refused, runs = f"with {_layers(runs)} left out, {err}", []
        if not runs:
            releases, input_grads = self._plain_probe(make_batch, size, step_fn, [])
        self.counts.probe_releases = releases.count
        self.estimator.releases = self.measurer.releases = releases
        return runs, input_grads

    def _plain_probe(self, make_batch, size: tuple, step_fn, runs: list) -> tuple:
        """The plain probe step's ``Releases`` and ``InputReleases.input_grads``, with the layers
        of ``runs`` left out."""
        runner = InputReleases(self.parts.model, self.parts.num_blocks)
        try:
            with left_out(self.parts.model, self.parts.blocks, _skipped(runs)):
                releases = probe_with_runner(self.parts, self._probe_batch(make_batch, size), runner, step_fn)
        except Exception as error:  # a model that cannot run this small a batch: say so, measure
            raise _probe_failed("plain probe step", size, error) from error
        if releases is None:
            raise ScalingError(f"the plain probe step at input size {size} ran out of memory")
        return (releases.deepened(runs) if runs else releases), runner.input_grads

    def _probe_sizes(self, make_batch, max_size: tuple, vary_lengths: bool, image: bool = False) -> list:
        """The probes' two sizes at the smallest batch ``make_batch`` can make both of (two rows,
        or whole multiple-choice examples): the probes cost what their batches hold."""
        for batch in probe_batches(int(max_size[0])):
            sizes = probe_sizes(max_size, vary_lengths, self.parts.encoder_decoder, batch, image)
            if all(self._makes(make_batch, size) for size in sizes):
                return sizes
        return probe_sizes(max_size, vary_lengths, self.parts.encoder_decoder, image=image)

    def _makes(self, make_batch, size: tuple) -> bool:
        """Whether ``make_batch(size)`` gives a batch of exactly that size."""
        try:
            return infer_input_size(make_batch(size), self.parts.encoder_decoder) == tuple(size)
        except Exception:  # noqa: BLE001 - a size that cannot be made is one not to probe at
            return False

    def _probe_batch(self, make_batch, size: tuple):
        """A probe's batch at ``size``, given padding (the last row's last position masked) when
        it has an attention mask: real batches padded to their longest row take the models'
        masked code paths, which hold more memory."""
        batch = to_model_device(self.parts.model, make_batch(size))
        made = infer_input_size(batch, self.parts.encoder_decoder)
        if made != tuple(size):
            raise ScalingError(f"a probe batch of input size {size} came out as {made}")
        return with_padding(batch)

    def _probe_step(self, make_batch, size: tuple, step_fn=None, twins=None):
        """One probe step at ``size`` (called with the device's meter set aside, ``_probe``), on
        ``_probe_batch``'s batch: measured by the collector with storage lifetimes, unseen by the
        training run (``trial.probe_step``). Blocks of ``twins`` skip their measuring run
        (``ShuttlingCollector.twins``)."""
        batch = self._probe_batch(make_batch, size)
        try:
            self.measurer.lifetimes, self.measurer.twins = True, twins or {}
            self.measurer.begin(inputs=batch)
            with self.parts.router.using(self.measurer):
                peak = probe_step(self.parts, batch, step_fn)
        except Exception as error:  # a model that cannot run this small a batch: say so, measure
            self.measurer.abort()
            raise _probe_failed("probe step", size, error) from error
        except BaseException:
            self.measurer.abort()
            raise
        finally:
            self.measurer.lifetimes, self.measurer.twins = False, {}
        if peak is None:
            self.measurer.abort()
            raise ScalingError(f"the probe step at input size {size} ran out of memory")
        raw = self.measurer.end()
        if raw is None:
            raise ScalingError("the collector could not measure any block (checkpointed by the model itself?)")
        return raw

    def decide(self, size: tuple, context: StepContext = NO_CONTEXT) -> Decision:
        """Sheltered: measure. Responsive: the cached plan for this size, else a new plan from the
        estimator when the rule in docs/MIMOSE.md trusts its prediction, else measure. Before
        the first step the probes give the estimate (``prepare``, or here from this batch)."""
        if not self._probed:
            batch = context.batch
            if isinstance(batch, dict) and any(batch.get(k) is not None for k in ("input_ids", "pixel_values")):
                before = self.counts.probe_ms
                self._probe(lambda s: resized_batch(batch, s), size, context.step_fn)
                self.counts.probe_in_step_ms += self.counts.probe_ms - before
            else:
                self._probed = True
                self.counts.estimate_fallback = ("no batch to probe with: pass planner.step(batch) a dict with "
                                                 "input_ids or pixel_values, or call planner.prepare(make_batch, max_input_size)")
                self._warn(f"mimose: learning from measured steps: {self.counts.estimate_fallback}")
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
            whole_ms, offloaded = freeing_ms(recompute_ms, offload_ms)
            pred = bounded_for_offload(pred, offloaded, self.choice_times.storages)
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
        return peak * (1.0 + self.prediction_margin) + self.estimator.trust.residual_bytes

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
        if under > 0:  # the margin is in the prediction: the fit is wrong at this size
            self.counts.underpredictions += 1
            self.counts.max_underprediction_bytes = max(self.counts.max_underprediction_bytes, under)
            self.contradicted.add(self.cache_key(info.input_size))

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
        # Probes run in ``decide`` are in the planning time already.
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
        self._probed = True
        self._loaded = True
        self.cache = {}
        self.choice_times = (ChoiceTimes.from_state(state.get("choice_times"), self.estimator.feature_set)
                             if self.choices != "block" else None)
        self.parts.plan_runner.selective_keep = {int(i): int(k) for i, k in state.get("selective_keep", [])}
        partial_keep: dict = {}
        for i, level, k in state.get("partial_keep", []):
            partial_keep.setdefault(int(i), {})[level] = int(k)
        self.parts.plan_runner.partial_keep = partial_keep
        self._warn_if_offload_unknown("the saved estimator has no copy costs (saved without choices: offload, "
                                      "or their timing failed); move its estimator.json aside to probe again")
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
