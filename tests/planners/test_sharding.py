"""Planning a model sharded by FSDP2 (``fully_shard``): two gloo ranks on the CPU, each planning
its own batch inside its own budget, train as the unsharded model does; what cannot be planned
under FSDP is refused in one line."""

import json
import socket
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

import mimose_cli
from mimose_cli.launcher.spawn import end_rank
from mimose_cli.memory import build_meter
from mimose_cli.memory.probe import LiveProbe
from mimose_cli.planners.mimose.collector import RawStep, Trace
from mimose_cli.planners.mimose.scaling import settled, structure_difference
from mimose_cli.planners.recovery import RankOutOfMemoryError
from mimose_cli.planners.sharding import Lockstep, ProbesDiverged
from mimose_cli.torch_private import TorchDispatchMode

from helpers import bert_batch, tiny_bert

BUDGET = 6 * 2**20
LENGTHS = ([48, 64, 40], [144, 128, 160])  # rank r's batches: rank 1's need blocks checkpointed at BUDGET
BATCH = 4
OTHERS = ("full", "sublinear", "hf-every-n", "oracle")
TIMEOUT_S = 120


def _model():
    model = tiny_bert(layers=4, max_length=256)
    for module in model.modules():  # each rank would draw its own dropout masks
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _sharded(model, world: int):
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _disagreement(rank: int) -> str:
    """Rank 0 asks for a probe step, rank 1 for none: both must hear of it, neither wait."""
    lockstep = Lockstep()
    try:
        with lockstep.session():
            if rank == 0:
                lockstep.ticket("probe step over 9 modules")
    except ProbesDiverged as error:
        return str(error)
    return "no error" if not lockstep.diverged else "diverged, said at the end"


def _train(rank: int, model, meter) -> list:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = []
    with mimose_cli.Mimose(model, BUDGET, meter=meter) as planner:
        planner.track(optimizer)
        for length in LENGTHS[rank]:
            batch = bert_batch(BATCH, length)
            meter.track(batch)
            with meter.step() as mem:
                with planner.step(batch) as info:
                    loss = model(**batch).loss
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps.append({"size": list(info.input_size), "plan": list(info.plan), "loss": loss.item(),
                          "predicted": info.predicted_peak_bytes, "peak": mem.peak_bytes, "phase": info.phase})
        stats = planner.stats
        margin = planner.safety_margin_bytes
    return steps, {**{k: stats[k] for k in ("estimate_source", "estimate_fallback", "probe_steps")}, "margin": margin}


def _one_rank_probes_again(rank: int, model, meter) -> dict:
    """Rank 1 sees its two probe steps differ (as when a collective's worker let go of a buffer
    at another op), rank 0 does not: both must run the third probe step."""
    from mimose_cli.planners.mimose import probes

    original = probes.structure_difference
    if rank == 1:
        calls = iter(["injected: tensors lived at other ops"])
        probes.structure_difference = lambda a, b: next(calls, None)
    try:
        with mimose_cli.Mimose(model, BUDGET, meter=meter) as planner:
            batch = bert_batch(BATCH, LENGTHS[rank][0])
            meter.track(batch)
            with planner.step(batch):
                model(**batch).loss.backward()
            model.zero_grad(set_to_none=True)
            return {k: planner.stats[k] for k in ("estimate_source", "estimate_fallback", "probe_steps")}
    finally:
        probes.structure_difference = original


def _others(rank: int, model, meter) -> dict:
    """Two steps of each other planner (each prepared for this rank's longest batch first): rank 0
    repeats its size, rank 1 does not, so the oracle has measured rank 0's size already when rank
    1's is new (it measures on both ranks then)."""
    ran = {}
    for name in OTHERS:
        with mimose_cli.build_planner(name, model, BUDGET, meter=meter) as planner:
            planner.prepare(lambda size: bert_batch(*size), (BATCH, max(LENGTHS[rank])))
            peaks = []
            for length in (LENGTHS[rank][0], LENGTHS[rank][rank]):
                batch = bert_batch(BATCH, length)
                meter.track(batch)
                with meter.step() as mem, planner.step(batch) as info:
                    model(**batch).loss.backward()
                model.zero_grad(set_to_none=True)
                peaks.append(mem.peak_bytes)
            ran[name] = {"plan": list(info.plan), "peak": max(peaks)}
    return ran


class _Gathers(TorchDispatchMode):
    """Counts the all-gathers a step runs."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.namespace == "c10d" and "allgather" in func.name()
        return func(*args, **(kwargs or {}))


def _gathers(rank: int, model) -> dict:
    """All-gathers in one step with no block and with every block checkpointed."""
    counts = {}
    for name in ("none", "full"):
        with mimose_cli.build_planner(name, model) as planner, _Gathers() as gathers:
            batch = bert_batch(BATCH, LENGTHS[rank][0])
            with planner.step(batch):
                model(**batch).loss.backward()
            model.zero_grad(set_to_none=True)
        counts[name] = gathers.count
    return counts


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        said = _disagreement(rank)
        model = _sharded(_model(), 2)
        meter = build_meter("simulated", BUDGET)
        with meter.activate():
            meter.track(model)
            steps, stats = _train(rank, model, meter)
            others = _others(rank, model, meter)
            again = _one_rank_probes_again(rank, model, meter)
        gathers = _gathers(rank, model)
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump({"said": said, "steps": steps, "stats": stats, "others": others, "gathers": gathers,
                       "again": again}, f)
    finally:
        dist.destroy_process_group()
    end_rank(0)  # as the launcher's ranks end: Python's shutdown could abort on gloo's threads


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list:
    out = tmp_path_factory.mktemp("fsdp")
    spawned = torch.multiprocessing.spawn(_rank, args=(_free_port(), str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not spawned.join(timeout=1):  # raises when a rank failed
        if time.monotonic() > deadline:
            for process in spawned.processes:
                process.kill()
            pytest.fail("the FSDP ranks hang")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _unsharded_losses() -> list:
    """The one-process run the two ranks stand for: each step's loss on each rank's batch, and
    one update from the mean of the two losses (FSDP averages the ranks' gradients)."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = [[], []]
    for step in range(len(LENGTHS[0])):
        per_rank = [model(**bert_batch(BATCH, LENGTHS[r][step])).loss for r in range(2)]
        (sum(per_rank) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        for r in range(2):
            losses[r].append(per_rank[r].item())
    return losses


def test_each_rank_plans_its_own_batch_and_trains_as_the_unsharded_model(ranks):
    """Rank 1's long batches need blocks checkpointed at the budget, rank 0's short ones none; the
    probes ran on both (no fallback) and every step's prediction is within 2 % of the meter's
    peak, never under it by more than the margin the simulated device keeps under FSDP: the
    largest unit's gathered parameters (the root's here), one of which the process group's worker
    may let go of a few ops later in one run than in another."""
    root = sum(p.numel() * p.element_size() for name, p in _model().named_parameters() if ".layer." not in name)
    for rank, result in enumerate(ranks):
        assert [tuple(s["size"]) for s in result["steps"]] == [(BATCH, n) for n in LENGTHS[rank]]
        assert result["stats"]["estimate_source"] == "probes", result["stats"]
        assert result["stats"]["margin"] == root
        for step in result["steps"]:
            assert step["peak"] <= BUDGET - root
            assert step["peak"] - root <= step["predicted"] <= 1.02 * step["peak"], (rank, step)
    assert all(choice == "keep" for step in ranks[0]["steps"] for choice in step["plan"])
    assert all(any(choice != "keep" for choice in step["plan"]) for step in ranks[1]["steps"]), ranks[1]["steps"]
    expected = _unsharded_losses()
    for rank, result in enumerate(ranks):
        assert [s["loss"] for s in result["steps"]] == pytest.approx(expected[rank], rel=1e-5, abs=1e-6)


def test_a_third_probe_step_one_rank_needs_runs_on_every_rank(ranks):
    for result in ranks:
        assert result["again"]["estimate_source"] == "probes", result["again"]
        assert result["again"]["probe_steps"] == 3


def test_the_other_planners_plan_a_sharded_model(ranks):
    for result in ranks:
        assert sorted(result["others"]) == sorted(OTHERS)
        for name, ran in result["others"].items():
            assert ran["peak"] <= BUDGET, name
    assert all(c == "recompute" for c in ranks[1]["others"]["full"]["plan"])


def test_a_checkpointed_block_is_not_gathered_again_in_its_recompute(ranks):
    """The router checkpoints a block's ``forward``, inside its FSDP unit's hooks: recomputing it
    in backward reuses the parameters FSDP's pre-backward gathered."""
    for result in ranks:
        assert result["gathers"]["full"] == result["gathers"]["none"] > 0, result["gathers"]


def test_ranks_that_disagree_on_a_probe_step_both_say_so(ranks):
    """Rank 0 asked for a probe step that rank 1 did not: the step ran nowhere, rank 0 raised
    ``ProbesDiverged`` and rank 1 heard of it on leaving its session; neither hung."""
    assert ranks[0]["said"].startswith("rank 0's planner asked for a probe step")
    assert ranks[1]["said"] == "diverged, said at the end"


@pytest.fixture
def one_rank():
    """A one-process gloo group: FSDP2 runs, with nothing to exchange."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp1_and_dtr_under_fsdp_are_refused_in_one_line(one_rank):
    with pytest.raises(ValueError, match="not FullyShardedDataParallel \\(FSDP1\\): shard with .*fully_shard"):
        mimose_cli.Mimose(FullyShardedDataParallel(_model(), device_id=torch.device("cpu")), "1GB")
    model = _sharded(_model(), 1)
    with pytest.raises(ValueError, match="planner 'dtr' cannot plan an FSDP-sharded model"):
        mimose_cli.build_planner("dtr", model, "1GB")
    mimose_cli.Mimose(model, "1GB").close()  # FSDP2 is planned


def test_an_fsdp_unit_inside_a_block_is_refused(one_rank):
    model = _model()
    fully_shard(model.bert.encoder.layer[1].attention)
    fully_shard(model)
    with pytest.raises(ValueError, match="block bert.encoder.layer.1 holds FSDP units inside it \\(attention\\)"):
        mimose_cli.Mimose(model, "1GB")


def test_out_of_memory_under_fsdp_is_not_retried_and_names_the_rank(one_rank):
    """A retry would run one more forward and backward on this rank than on the others."""
    model = _sharded(_model(), 1)
    meter = build_meter("simulated", 2 * 2**20)
    with meter.activate(), mimose_cli.build_planner("none", model, meter=meter) as planner:
        meter.track(model)
        batch = bert_batch(BATCH, 128)
        with pytest.raises(RankOutOfMemoryError, match=f"rank 0 ran out of memory at step 0, input size \\({BATCH}, 128\\)"):
            planner.run(lambda b: model(**b).loss.backward(), batch)
        assert planner.retries_total == 0


def _raw(live: list, died: list, comm: list) -> RawStep:
    """A probe step of four ops and two storages, an activation (100 B, live throughout) and a
    collective's buffer (50 B, from the second op)."""
    points = len(live)
    return RawStep(marks=[], mark_points=np.array([], dtype=np.int64),
                   trace=Trace(np.array(live, dtype=float), np.zeros(points, dtype=bool), np.zeros(points, dtype=bool)),
                   op_points=np.arange(points), per_block={}, dropped={}, nbytes=np.array([100.0, 50.0]),
                   born=np.array([0, 1]), died=np.array(died), points=points, shapes=[None, None], twins={},
                   comm=np.array(comm))


def test_a_collectives_buffer_dies_where_its_worker_thread_let_go_at_the_latest():
    """The process group's worker thread frees a buffer it held a moment after the step's last
    reference, at an op that varies from run to run: two probes that differ only there are alike,
    and each is taken with the buffer held until the later of the two (an upper bound)."""
    early = _raw([100, 150, 100, 100], died=[4, 2], comm=[False, True])  # freed by the worker: marked
    late = _raw([100, 150, 150, 100], died=[4, 3], comm=[False, False])  # freed by the step itself
    assert structure_difference(early, late) is None
    for raw in settled([early, late]):
        assert raw.died.tolist() == [4, 3] and raw.trace.live.tolist() == [100, 150, 150, 100]
    unmarked = _raw([100, 150, 100, 100], died=[4, 2], comm=[False, False])
    assert structure_difference(unmarked, late) == "tensors lived at other ops at the other input size"


def test_a_buffer_that_outlived_one_probes_step_dies_at_its_end_in_both():
    """The root's reduce-scatter buffer is let go of by its work: two ops before the step's end in
    one probe, after it in the other (alive at every point). Neither saw it as a collective's, yet
    the probes are alike, each holding it to the end; one that died at two points inside both
    steps still makes them differ."""
    inside = _raw([100, 150, 100, 100], died=[4, 2], comm=[False, False])
    outlived = _raw([100, 150, 150, 150], died=[4, 4], comm=[False, False])
    raws = settled([inside, outlived])
    assert structure_difference(*raws) is None
    for raw in raws:
        assert raw.died.tolist() == [4, 4] and raw.trace.live.tolist() == [100, 150, 150, 150]
    later = _raw([100, 150, 150, 100], died=[4, 3], comm=[False, False])
    assert structure_difference(*settled([inside, later])) == "tensors lived at other ops at the other input size"


def test_probes_of_different_lengths_are_left_for_the_structure_check_to_refuse():
    short = _raw([100, 150, 100, 100], died=[4, 2], comm=[False, False])
    long = _raw([100, 150, 150, 150, 150], died=[5, 5], comm=[False, False])
    settled_ = settled([short, long])
    assert settled_[0] is short and settled_[1] is long
    assert structure_difference(*settled_).startswith("the op sequence changed")


def test_a_storage_another_thread_frees_is_taken_for_a_collectives_buffer():
    """What frees it there is the process group's worker thread letting go of a collective's
    tensors; a storage the step itself frees is not."""
    probe = LiveProbe(lifetimes=True)
    with probe:
        held = [torch.ones(4) * 2, torch.ones(8) * 3]  # two ops' outputs: counted
        thread = threading.Thread(target=held.pop)  # drops the second's last reference
        thread.start()
        thread.join()
        del held[0]
    assert [probe.ledger.nbytes[i] for i in probe.ledger.comm] == [8 * 4]  # the second product's alone
