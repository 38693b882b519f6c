"""Mimose's probes: the steps before the first one that give its first estimate.

``Probes(parts, measurer, feature_set, choices, make_batch, step_fn).run(max_size)`` runs a plain
probe step (which inputs blocks let go of, ``collector.InputReleases``) and two measured ones at
two small sizes (``scaling.probe_sizes``), leaving out the middle layers of a long stack and the
measuring runs of blocks alike (``layout``), and scales them to samples at every size
(``scaling.ScaledStep``). It returns one ``ProbeResult``: the samples (or why there are none),
what it found besides (the inputs let go of, each choice's times, the heavy outputs each selective
checkpoint keeps), what it counted and what it would warn of. It writes nothing of the policy's:
``MimosePolicy`` takes the result in. The only thing it sets beyond its result is the collector's
``releases``, which its later measured steps need.
"""

import time
from dataclasses import dataclass, field

from mimose_cli.planners.inputs import infer_input_size, size_key, with_padding
from mimose_cli.planners.mimose.choices import ChoiceTimes, copy_costs_ms, dispatch_costs_ms, probe_rates_ms
from mimose_cli.planners.mimose.collector import InputReleases
from mimose_cli.planners.mimose.features import FeatureSet, Releases, widened
from mimose_cli.planners.mimose.layout import first_runs_otherwise, left_out, stack_runs, twin_blocks
from mimose_cli.planners.mimose.scaling import (
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
    settled,
    side_multiple,
    structure_difference,
    twin_difference,
)
from mimose_cli.planners.sharding import ProbesDiverged
from mimose_cli.planners.trial import ProbeRefused, probe_step, probe_with_runner, to_model_device
from mimose_cli.planners.usage import said
from mimose_cli.torch_private import without_dispatch_modes


@dataclass
class ProbeCounts:
    """What the probes count: each a ``MimoseCounters`` field of the same name, documented there."""

    probe_ms: float = 0.0
    probe_steps: int = 0
    probe_twins: int = 0
    probe_releases: int = 0
    probe_skipped: int = 0
    probe_sides_refused: str = ""
    probe_twins_refused: str = ""
    probe_skips_refused: str = ""
    probe_first_refused: str = ""


@dataclass
class TimedChoices:
    """What a probe's measuring runs say of the finer choices (``time_choices``)."""

    selective_keep: dict
    """block -> the heavy outputs its selective checkpoint keeps (``PlanRunner.selective_keep``)."""
    partial_keep: dict
    """block -> {partial level -> heavy outputs kept} (``PlanRunner.partial_keep``)."""
    times: ChoiceTimes | None
    """Each choice's recompute time per block; None where not asked for or not scaled."""


@dataclass
class ProbeResult:
    """What the probes found, for the policy to take in."""

    samples: list = field(default_factory=list)
    """``[(size, sample)]`` at the sizes that determine the fit; empty where ``fallback`` says why."""
    fallback: str = ""
    """Why the probe steps cannot be scaled to other sizes (the planner then learns from measured
    steps), or empty."""
    releases: Releases | None = None
    """The inputs blocks run plainly let go of (the last plain probe step's); None: none ran."""
    side_multiple: int | None = None
    """The multiple of an image's sides the estimate is trusted at, where the probes varied them:
    the one the model imposes, read from the probes' shapes (``scaling.side_multiple``)."""
    timed: TimedChoices | None = None
    """The heavy outputs each selective and partial checkpoint keeps, and with ``choices`` other
    than ``"block"`` each choice's times (the last measured probes'); None: none got that far."""
    counts: ProbeCounts = field(default_factory=ProbeCounts)
    warnings: list = field(default_factory=list)
    """What the probes would tell the user, in order, each once."""
    feature_set: FeatureSet | None = None
    """The features the samples are over where not the estimate's own (``features.widened``)."""


def time_choices(raws: list, sizes: list, feature_set, stand_in: dict, prefixes: list, costs: tuple | None,
                 rates: tuple | None = None) -> TimedChoices:
    """From measuring runs (``RawStep``s) at ``sizes``: how many heavy outputs each selective and
    partial checkpoint keeps (``scaling.selective_keeps``; ``prefixes``, ``scaling.partial_prefixes``:
    what the estimate's bytes for them assume), and with the dispatch modes' ``costs``
    (``choices.dispatch_costs_ms``; None: block-level plans, no times) each choice's recompute time
    per block (``ChoiceTimes.from_probes``, ``rates`` the ops' own). A block without a measuring
    run takes the block ``stand_in`` names. Mimose's probes and the oracle's measurements both."""
    keeps = selective_keeps(raws[0], len(prefixes), stand_in)
    times = None if costs is None else ChoiceTimes.from_probes(raws, sizes, feature_set, stand_in, costs, rates,
                                                               prefixes)
    return TimedChoices({i: k for i, k in enumerate(keeps) if k is not None}, partial_keeps(prefixes), times)


def offload_unknown(choices: str, times: ChoiceTimes | None, why: str) -> str | None:
    """With ``choices="offload"`` but the copies' costs or the blocks' saved storages unknown
    (``ChoiceTimes.offload_at`` cannot price an offload): the warning to give once (plans still
    keep, checkpoint selectively or recompute); else None."""
    if choices == "offload" and times is not None and (times.copy_ms is None or times.storages is None):
        return (f"mimose: no block is offloaded (choices: offload asked for): {why}; plans keep, "
                "checkpoint selectively or recompute")
    return None


def _skipped(runs: list) -> list:
    """The blocks ``runs`` (``layout.stack_runs``) leave out."""
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


class Probes:
    """One run of the probes for a policy: ``parts`` the planner's, ``measurer`` its shuttling
    collector (which measures the probe steps), ``feature_set`` the estimate's, ``choices`` the
    policy's option; ``make_batch(size)`` a batch of that size, run by ``step_fn`` when given
    (training's autocast and loss scaling)."""

    def __init__(self, parts, measurer, feature_set, choices: str, make_batch, step_fn=None):
        self.parts = parts
        self.measurer = measurer
        self.feature_set = feature_set
        self.choices = choices
        self.make_batch = make_batch
        self.step_fn = step_fn
        self.result = ProbeResult()
        self.counts = self.result.counts

    def _warn(self, message: str | None) -> None:
        if message is not None and message not in self.result.warnings:
            self.result.warnings.append(message)

    def run(self, max_size: tuple) -> ProbeResult:
        """The probe steps, scaled to samples at every size up to ``max_size``; where they cannot
        be scaled, the result says why (``fallback``) and has no samples. Under FSDP a fallback
        on any rank is every rank's (``_agreed``): the sheltered phase then starts together."""
        return self._agreed(self._run(max_size))

    def _agreed(self, result: ProbeResult) -> ProbeResult:
        lockstep = self.parts.lockstep
        if lockstep is None:
            return result
        try:
            elsewhere = lockstep.any(bool(result.fallback)) and not result.fallback
        except ProbesDiverged as error:
            result.fallback = result.fallback or str(error)
            elsewhere = False
        if elsewhere:
            result.fallback = "another rank's probe steps could not be scaled"
        if result.fallback:
            result.samples = []
        return result

    def _run(self, max_size: tuple) -> ProbeResult:
        start = time.perf_counter()
        collector_ms = self.measurer.collector_ms
        try:
            # The probes' batches and steps are the planner's, not training's: the device's meter
            # (a dispatch mode on the CPU) is set aside, and the probe counts its own bytes.
            with without_dispatch_modes():
                self.result.samples = self._probe_samples(max_size)
        except ScalingError as err:
            self.result.fallback = str(err)
            return self.result
        finally:
            self.measurer.collector_ms = collector_ms  # the probes' measuring runs are in probe_ms
            self.counts.probe_ms += (time.perf_counter() - start) * 1e3
        times = None if self.result.timed is None else self.result.timed.times
        if times is not None:  # part of the probes' time
            start = time.perf_counter()
            times.meter_ms, times.mode_ms = dispatch_costs_ms()
            self.counts.probe_ms += (time.perf_counter() - start) * 1e3
        return self.result

    def _probe_samples(self, max_size: tuple) -> list:
        """The probe steps, scaled: ``[(size, sample)]`` at the sizes that determine the fit."""
        try:
            first = self.make_batch(max_size)
        except Exception as error:  # a batch this planner cannot cut (only inputs_embeds, ...)
            raise ScalingError(f"no probe batch can be made from this batch ({type(error).__name__}: "
                               f"{str(error)[:120]})") from error
        images = isinstance(first, dict) and size_key(first) == "pixel_values"
        del first
        if not images:
            return self._probes_at(self._probe_sizes(max_size, True), max_size)
        # An image's sides are probed at two sizes (a CNN takes any) when the largest image is at
        # least the larger (the probes cost no more than a real batch's images); a model that
        # takes only its own sides (position embeddings) is probed at them, only the batch varying.
        if min(max_size[1:]) >= SIDE_PAIR[1]:
            sizes = self._probe_sizes(max_size, True, image=True)
            try:
                return self._probes_at(sizes, max_size)
            except ScalingError as err:
                self.result.side_multiple = None
                self.counts.probe_sides_refused = str(err)
        else:
            self.counts.probe_sides_refused = (f"the largest image, {max_size[1]} x {max_size[2]}, is smaller than "
                                               f"{SIDE_PAIR[1]} px: its sides are probed as they are")
        return self._probes_at(self._probe_sizes(max_size, False), max_size)

    def _probes_at(self, sizes: list, max_size: tuple) -> list:
        """The plain probe step and the two measured ones at ``sizes``, scaled (``_probe_samples``)."""
        # A block like an earlier one (a layer of a stack) skips its measuring run, and the
        # layers of a long stack between the template and its last are left out of the probes
        # (the template stands for them): the probes cost about as much at any depth. Should the
        # left-out layers not be describable, every layer runs; should a group's first block not
        # run as the others, its second stands for them; should layers alike still not run
        # alike, every block is measured.
        for first_leads in (True, False):
            twins, runs = self._probe_layout(sizes[0], first_leads)
            mismatch = None  # blocks alike that did not run alike (``scaling.Mismatch``)
            if runs:
                try:
                    return self._left_out_probes(sizes, max_size, twins, runs)
                except ProbeRefused:
                    raise
                except ValueError as err:  # a ScalingError, or a list the layers cannot be taken out of
                    self.counts.probe_skips_refused = f"with {_layers(runs)} left out, {err}"
                    mismatch = err.mismatch if isinstance(err, _TwinsRefused) else None
            if twins and mismatch is None:
                raws = self._probe_pair(sizes, twins)
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
        return self._pair_samples(self._probe_pair(sizes, {}), sizes, max_size, {})

    def _pair_samples(self, raws: list, sizes: list, max_size: tuple, twins: dict) -> list:
        """The two measured probe steps (every layer run), scaled to samples at every size."""
        self.counts.probe_twins = len(raws[0].twins)
        prefixes = partial_prefixes(raws[0], self.parts.num_blocks, {})
        scaled = self._scaled(lambda feature_set: ScaledStep(raws[0], sizes[0], raws[1], sizes[1], feature_set,
                                                             self.parts.num_blocks, partial_keep=partial_keeps(prefixes)))
        self._time_choices(raws, sizes, max_size, twins, [], prefixes)
        return self._scaled_samples(scaled, max_size)

    def _scaled(self, scale):
        """``scale(feature_set)`` (a ``ScaledStep``) with the estimate's features, else, where no
        sum of them reads a tensor's bytes, with the wider set (``features.widened``: a B x B
        tensor), which the estimate then takes (``ProbeResult.feature_set``)."""
        try:
            return scale(self.feature_set)
        except ScalingError:
            wider = widened(self.feature_set)
            if wider is None:
                raise
            scaled = scale(wider)  # the wider set's error, if it cannot either
            self.feature_set = self.result.feature_set = wider
            return scaled

    def _scaled_samples(self, scaled: ScaledStep, max_size: tuple) -> list:
        """``scaled``'s samples at every size; where the probes varied an image's sides, the
        multiple of them the model imposes (``scaling.side_multiple``) is the one trusted."""
        if scaled.image and scaled.size_a[1:] != scaled.size_b[1:]:
            self.result.side_multiple = side_multiple(*scaled.shapes, scaled.size_a, scaled.size_b)
        return [(size, scaled.sample(size)) for size in scaled.sizes(max_size)]

    def _left_out_probes(self, sizes: list, max_size: tuple, twins: dict, runs: list) -> list:
        """The two measured probe steps with the layers of ``runs`` left out, scaled and written
        out for every layer (``scaling.Deepening``), checked by one more probe step at the smaller
        size with one layer more of each run kept: written out too, it must say the same (memory
        that grows with the layers outside them, the head stacking every layer's output, does
        not). Raises ValueError where they cannot stand for every layer."""
        with left_out(self.parts.model, self.parts.blocks, _skipped(runs)):
            raws = self._probe_pair(sizes, twins)
        mismatch = next(filter(None, map(twin_difference, raws)), None) or run_difference(raws[0], runs, twins)
        if mismatch is not None:  # nor would they with every layer run
            self.counts.probe_twins_refused = mismatch.why
            raise _TwinsRefused(mismatch)
        n = self.parts.num_blocks
        # What each partial level keeps, one count per block for the estimate and the runner: a
        # left-out layer's its template's, whose bytes it is written out with (``Deepening``).
        prefixes = partial_prefixes(raws[0], n, {i: template for template, skipped in runs for i in skipped})
        keep = partial_keeps(prefixes)
        scaled = self._scaled(lambda feature_set: ScaledStep(raws[0], sizes[0], raws[1], sizes[1], feature_set, n,
                                                             runs, keep))
        deeper = deeper_by_one(runs)
        with left_out(self.parts.model, self.parts.blocks, _skipped(deeper)):
            check = self._probe_step(sizes[0], twins)
        self.counts.probe_steps += 1
        where = sample_difference(raw_sample(raws[0], n, runs, keep), raw_sample(check, n, deeper, keep))
        if where is not None:
            raise ScalingError(f"{where} changes when one more of them runs (memory that grows with the layers)")
        self.counts.probe_twins = len(raws[0].twins)
        self.counts.probe_skipped = len(_skipped(runs))
        self._time_choices(raws, sizes, max_size, twins, runs, prefixes)
        return self._scaled_samples(scaled, max_size)

    def _time_choices(self, raws: list, sizes: list, max_size: tuple, twins: dict, runs: list, prefixes: list) -> None:
        """With ``choices="selective"`` or ``"offload"``: each choice's recompute time per block from
        the probes' measuring runs (``time_choices``), the ops' rates timed on a matmul and a
        pointwise op as large as the largest batch's (``choices.probe_rates_ms``; the device's
        meter is set aside here); a block run without a measuring run takes the block like it.
        With ``"offload"`` also the copies' costs (``choices.copy_costs_ms``). Whatever the
        choices, the runner learns how many heavy outputs each selective and partial checkpoint
        keeps (``prefixes``: what the estimate's bytes for them assume)."""
        stand_in = dict(twins)
        for template, skipped in runs:
            stand_in.update({i: twins.get(template, template) for i in skipped})
        timed = self.choices != "block"
        # The dispatch modes' costs are timed once the device's meter is back (``run``).
        found = time_choices(raws, sizes, self.feature_set, stand_in, prefixes, (0.0, 0.0) if timed else None,
                             self._rates(raws[1], sizes[1], max_size) if timed else None)
        self.result.timed = found
        if not timed:
            return
        if found.times is None:
            self._warn(f"mimose: plans stay block-level (choices: {self.choices} asked for): the probes' ops did not "
                       "run alike at their two sizes, so each choice's recompute time cannot be scaled")
        elif self.choices == "offload":
            found.times.copy_ms = self.parts.timed_or_warned(copy_costs_ms, "mimose: the copies' costs", self._warn)
            self._warn(offload_unknown(self.choices, found.times,
                                       "the copies' costs or the probes' saved storages are not known"))

    def _rates(self, raw, size: tuple, max_size: tuple) -> tuple | None:
        """The ops' ms per unit of work (``choices.probe_rates_ms``); None where they cannot be
        timed: the probes' own timings stand in."""
        rates = self.parts.timed_or_warned(lambda device: probe_rates_ms(raw, size, max_size, device),
                                           "mimose: the ops' rates", self._warn)
        if rates is None:
            self._warn("mimose: recompute times are scaled from the probes' own timings")
        return rates

    def _probe_pair(self, sizes: list, twins: dict) -> list:
        """The two measured probe steps at ``sizes`` (``RawStep``s), the first once more when it
        ran otherwise than the second: what only the first step of a process does (a GradScaler
        creating its scale, a lazily built cache). Under FSDP the ranks run the third step
        together where any rank's two differ (a collective's worker may let go of a buffer at
        another op from run to run), so that their probe steps stay the same."""
        raws = settled([self._probe_step(size, twins) for size in sizes])
        self.counts.probe_steps += 2
        again = structure_difference(*raws) is not None
        if self.parts.lockstep is not None:
            again = self.parts.lockstep.any(again)
        if again:
            raws = settled([self._probe_step(sizes[0], twins), raws[1]])
            self.counts.probe_steps += 1
        return raws

    def _probe_layout(self, size: tuple, first_leads: bool = True) -> tuple:
        """``(twins, runs)``: the blocks the probes take as an earlier block alike (``twin_blocks``)
        and the layers they leave out (``stack_runs``), after the plain probe step
        (``_probe_releases``). With ``first_leads`` a group's first block stands for the others,
        unless the plain probe step saw its inputs need gradients otherwise than the next one's
        (frozen embeddings): then, as without ``first_leads``, its second does, and the plain
        probe step runs again without the layers that leaves out."""
        if self.parts.lockstep is not None:
            # Under FSDP a block's bytes hold the gathered and reduced buffers of its neighbours,
            # which differ at a stack's ends: no block stands for another, none is left out.
            self.counts.probe_twins_refused = "FSDP: each block's gathered buffers are its own"
            return {}, self._probe_releases(size, [])[0]

        def layout(first_leads: bool) -> tuple:
            twins = twin_blocks(self.parts.blocks, first_leads)
            runs, self.counts.probe_skips_refused = stack_runs(self.parts.blocks, twins)
            return (twins, *self._probe_releases(size, runs))

        if first_leads:
            twins, runs, input_grads = layout(True)
            refused = first_runs_otherwise(twins, input_grads)
            if refused is None:
                return twins, runs
            self.counts.probe_first_refused = refused
        return layout(False)[:2]

    def _probe_releases(self, size: tuple, runs: list) -> tuple:
        """A plain probe step at ``size``: which inputs blocks run plainly let go of
        (``collector.InputReleases``); the collector measures their bytes from then on. The
        layers of ``runs`` are left out (``Releases.deepened``); where that cannot be described
        (or run), the step runs again with every layer. Returns the runs still to leave out and
        whether each block's tensor inputs needed gradients (``InputReleases.input_grads``)."""
        if runs:
            try:
                releases, input_grads = self._plain_probe(size, runs)
            except ProbeRefused:
                raise
            except ValueError as err:  # a ScalingError, or releases a deeper stack cannot have
                self.counts.probe_skips_refused, runs = f"with {_layers(runs)} left out, {err}", []
        if not runs:
            releases, input_grads = self._plain_probe(size, [])
        self.counts.probe_releases = releases.count
        self.result.releases = self.measurer.releases = releases
        return runs, input_grads

    def _plain_probe(self, size: tuple, runs: list) -> tuple:
        """The plain probe step's ``Releases`` and ``InputReleases.input_grads``, with the layers
        of ``runs`` left out."""
        runner = InputReleases(self.parts.model, self.parts.num_blocks)
        try:
            with left_out(self.parts.model, self.parts.blocks, _skipped(runs)):
                releases = probe_with_runner(self.parts, self._probe_batch(size), runner, self.step_fn)
        except ProbeRefused:
            raise
        except Exception as error:  # a model that cannot run this small a batch: say so, measure
            raise _probe_failed("plain probe step", size, error) from error
        if releases is None:
            raise ScalingError(f"the plain probe step at input size {size} ran out of memory")
        return (releases.deepened(runs) if runs else releases), runner.input_grads

    def _probe_sizes(self, max_size: tuple, vary_lengths: bool, image: bool = False) -> list:
        """The probes' two sizes at the smallest batch ``make_batch`` can make both of (two rows,
        or whole multiple-choice examples): the probes cost what their batches hold."""
        for batch in probe_batches(int(max_size[0])):
            sizes = probe_sizes(max_size, vary_lengths, self.parts.encoder_decoder, batch, image)
            if all(self._makes(size) for size in sizes):
                return sizes
        return probe_sizes(max_size, vary_lengths, self.parts.encoder_decoder, image=image)

    def _makes(self, size: tuple) -> bool:
        """Whether ``make_batch(size)`` gives a batch of exactly that size."""
        try:
            return infer_input_size(self.make_batch(size), self.parts.encoder_decoder) == tuple(size)
        except Exception:  # noqa: BLE001 - a size that cannot be made is one not to probe at
            return False

    def _probe_batch(self, size: tuple):
        """A probe's batch at ``size``, given padding (the last row's last position masked) when
        it has an attention mask: real batches padded to their longest row take the models'
        masked code paths, which hold more memory."""
        batch = to_model_device(self.parts.model, self.make_batch(size))
        made = infer_input_size(batch, self.parts.encoder_decoder)
        if made != tuple(size):
            raise ScalingError(f"a probe batch of input size {size} came out as {made}")
        return with_padding(batch)

    def _probe_step(self, size: tuple, twins=None):
        """One probe step at ``size`` (called with the device's meter set aside, ``run``), on
        ``_probe_batch``'s batch: measured by the collector with storage lifetimes, unseen by the
        training run (``trial.probe_step``). Blocks of ``twins`` skip their measuring run
        (``ShuttlingCollector.twins``)."""
        batch = self._probe_batch(size)
        try:
            self.measurer.lifetimes, self.measurer.twins = True, twins or {}
            self.measurer.begin(inputs=batch)
            with self.parts.router.using(self.measurer):
                peak = probe_step(self.parts, batch, self.step_fn)
        except Exception as error:  # a model that cannot run this small a batch: say so, measure
            self.measurer.abort()
            if isinstance(error, ProbeRefused):
                raise
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
