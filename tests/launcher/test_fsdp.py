"""``training.parallel: fsdp``: the model sharded by FSDP2 over two gloo processes on the CPU trains
as one process with the global batch, each rank within a per-device budget that one process
cannot run, and the dry run says what each rank holds."""

import copy
import io
import json
import os
import socket
import subprocess

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_param_group
from faults import driver
from rich.console import Console
from torch.distributed.fsdp import FSDPModule
from typer.testing import CliRunner

from mimose_cli.cli import app
from mimose_cli.launcher.distributed import World, local_batch, own_padding
from mimose_cli.launcher.recipe import RecipeError, load_recipe
from mimose_cli.launcher.models import model_config
from mimose_cli.launcher.sharded_preflight import RankNeeds, least_ranks, report_ranks, verdict
from mimose_cli.launcher.spawn import end_rank
from mimose_cli.launcher.sharding import device_mesh, held_param_bytes, mixed_precision, shard_model
from mimose_cli.launcher.train import run_training
from mimose_cli.launcher.preflight import BudgetRange
from mimose_cli.planners.base import build_planner
from mimose_cli.planners.blocks import discover_blocks

from helpers import QUICKSTART, bert_batch, tiny_bert

# Sequence classification (a per-example mean loss) without dropout (each rank would draw its own
# masks), planner full: the run checkpoints every block on every rank. At BUDGET a rank's step fits
# sharded (3.43 MiB at the largest input) while one process cannot even hold the model's state
# (4.49 MiB: weights, gradients, AdamW's moments and its step's scratch).
SHARDED = ["task=sequence_classification", "data.preset=qqp", "data.num_examples=32", "data.max_length=64",
           "training.batch_size=4", "training.max_steps=4", "training.warmup_steps=0", "training.checkpoint_every=null",
           "model.config_overrides={hidden_dropout_prob: 0.0, attention_probs_dropout_prob: 0.0}"]
BUDGET = "3.9MB"
BUDGET_BYTES = int(3.9e6)


def _cli(*args, out=None) -> subprocess.CompletedProcess:
    """``mimose train`` of the quickstart recipe with ``SHARDED`` in a process of its own."""
    command = driver.command(QUICKSTART, *SHARDED, *args, *(("--out", out) if out else ()))
    return subprocess.run(command, env=driver.ENV, capture_output=True, text=True, timeout=driver.TIMEOUT_S)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """``mimose train ... training.parallel=fsdp --nproc-per-node 2`` at BUDGET (torchrun, gloo)."""
    out = tmp_path_factory.mktemp("fsdp")
    done = _cli("training.parallel=fsdp", "--planner", "full", "--budget", BUDGET, "--nproc-per-node", "2", out=out)
    assert done.returncode == 0, done.stdout + done.stderr
    return driver.run_dir_in(out), done.stdout


def test_two_sharded_ranks_train_as_one_process_with_the_global_batch(sharded_run, tmp_path):
    run_dir, output = sharded_run
    recipe = load_recipe(QUICKSTART, SHARDED + ["training.batch_size=8", "planner.name=none", f"out_dir={tmp_path}"])
    one = run_training(recipe, view="none", save=False)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.input_shape for r in one.records] == [[8, max(r["input_shape"][1] for r in line["ranks"])]
                                                    for line in lines]
    assert [line["loss"] for line in lines] == pytest.approx([r.loss for r in one.records], rel=1e-5)
    assert len({line["loss"] for line in lines}) > 1  # it trained: the weights the ranks share changed alike
    assert "fsdp: 4 blocks and the root sharded over 2 ranks" in output


def test_every_rank_records_its_own_rows_plan_and_peak_within_the_budget(sharded_run):
    run_dir, _ = sharded_run
    lines = [json.loads(text) for text in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        ranks = line["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and not line["oom"]
        assert all(r["input_shape"][0] == 4 for r in ranks)
        assert line["input_size"] == ranks[line["rank"]]["input_shape"]  # a rank planned its own size
        assert all(r["plan"] == ["recompute"] * 4 for r in ranks)
        assert all(0 < r["peak_bytes"] <= BUDGET_BYTES for r in ranks)
    # Each rank padded its rows to their own longest: the ranks' lengths differ on some steps.
    assert any(len({r["input_shape"][1] for r in line["ranks"]}) == 2 for line in lines)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert [(r["rank"], r["oom_steps"], r["over_budget_steps"]) for r in summary["ranks"]] == [(0, 0, 0), (1, 0, 0)]
    report = CliRunner().invoke(app, ["report", str(run_dir)])
    assert report.exit_code == 0 and "peak memory per rank" in report.output


def test_a_root_that_returns_a_view_is_not_warned_of(tmp_path):
    """torch warns at each forward of an FSDP root whose output is a view (a multiple-choice
    head's reshaped logits: the quickstart's), since an in-place op on it would skip the
    pre-backward all-gather. The launcher's step reads the loss and writes to no output: not said."""
    import warnings

    from mimose_cli.launcher.models import build_model
    from mimose_cli.launcher.sharding import shard

    recipe = load_recipe(QUICKSTART)
    assert recipe.task == "multiple_choice"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = build_model(recipe, model_config(recipe)).train()
        shard(model, recipe, torch.device("cpu"), 1)
        with warnings.catch_warnings(record=True) as caught:
            ids = torch.randint(5, 100, (2, 4, 12))
            model(input_ids=ids, labels=torch.tensor([0, 1])).loss.backward()
    finally:
        dist.destroy_process_group()
    assert not [w for w in caught if "returned a view tensor" in str(w.message)]


def _dry_run_report(world: World, budget: str) -> str:
    """What ``mimose train --dry-run --nproc-per-node 2 training.parallel=fsdp`` prints at
    ``budget`` (rank 0's console; the other rank's is empty)."""
    recipe = load_recipe(QUICKSTART, [*SHARDED, "training.parallel=fsdp", "planner.name=full", f"budget={budget}"])
    console = Console(file=io.StringIO(), width=400)
    fits = report_ranks(recipe, model_config(recipe), console, world)
    return f"fits={fits}\n{console.file.getvalue()}"


def _dry_run_says_what_each_rank_holds(world: World) -> None:
    report = _dry_run_report(world, BUDGET)
    if not world.is_main:
        assert report == "fits=True\n"  # the verdict is every rank's, the print rank 0's
        return
    lines = report.splitlines()
    for rank in (0, 1):
        (line,) = [text for text in lines if text.strip().startswith(f"rank {rank}: holds 1/2 of the state")]
        assert "gathers up to" in line and "with every block checkpointed" in line, line
    assert lines[0] == "fits=True" and "fits sharded over 2 ranks; one device cannot hold it unsharded" in report
    assert "the fewest ranks that fit it: 2" in report


def test_one_process_is_refused_the_budget_the_sharded_ranks_fit():
    one = CliRunner().invoke(app, ["train", str(QUICKSTART), *SHARDED, "--planner", "full", "--budget", BUDGET,
                                   "--dry-run"])
    assert one.exit_code == 1 and "is too small for this recipe" in one.output


def test_a_sharded_dry_run_runs_under_torchrun(monkeypatch):
    from mimose_cli.launcher import spawn as launch

    calls = []
    monkeypatch.setattr(launch, "relaunch", lambda nproc, args: calls.append((nproc, args)) or 0)
    result = CliRunner().invoke(app, ["train", str(QUICKSTART), "training.parallel=fsdp", "--dry-run",
                                      "--nproc-per-node", "2"])
    assert result.exit_code == 0
    assert calls == [(2, ["train", str(QUICKSTART), "training.parallel=fsdp", "--view=auto", "--dry-run"])]


def test_one_process_is_refused_in_one_line_before_anything_is_built():
    for extra in ([], ["--dry-run"]):
        result = CliRunner().invoke(app, ["train", str(QUICKSTART), "training.parallel=fsdp", *extra])
        assert result.exit_code == 2
        assert "training.parallel=fsdp shards the model over several processes: add --nproc-per-node" in result.output
    with pytest.raises(ValueError, match="run it with --nproc-per-node 2 or more"):
        run_training(load_recipe(QUICKSTART, ["training.parallel=fsdp"]), view="none", world=World())
    compare = CliRunner().invoke(app, ["compare", str(QUICKSTART), "training.parallel=fsdp", "--budgets", "40MB"])
    assert compare.exit_code != 0 and "training.parallel=fsdp shards over several; set training.parallel=ddp" \
        in " ".join(compare.output.split())


def test_a_rank_pads_its_rows_only_to_their_own_longest():
    right = {"input_ids": torch.tensor([[5, 6, 0, 0, 0], [7, 0, 0, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]),
             "labels": torch.tensor([[5, 6, -100, -100, -100], [7, -100, -100, -100, -100]])}
    own = own_padding(right)
    assert own["input_ids"].tolist() == [[5, 6], [7, 0]] and own["labels"].tolist() == [[5, 6], [7, -100]]
    choices = {"input_ids": torch.ones(2, 3, 6, dtype=torch.long), "attention_mask": torch.zeros(2, 3, 6),
               "labels": torch.tensor([1, 2])}
    choices["attention_mask"][1, 2, :4] = 1
    assert own_padding(choices)["input_ids"].shape == (2, 3, 4) and own_padding(choices)["labels"].tolist() == [1, 2]
    left = {"input_ids": torch.tensor([[0, 0, 5, 6], [0, 0, 0, 7]]), "attention_mask": torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]]),
            "start_positions": torch.tensor([2, 3]), "end_positions": torch.tensor([3, 3])}
    own = own_padding(left)  # XLNet pads on the left: the answer's positions move with its tokens
    assert own["input_ids"].tolist() == [[5, 6], [0, 7]]
    assert (own["start_positions"].tolist(), own["end_positions"].tolist()) == ([0, 1], [1, 1])
    images = {"pixel_values": torch.zeros(2, 3, 8, 8), "labels": torch.tensor([0, 1])}
    assert own_padding(images) is images


def test_the_recipe_keys_are_strict(tmp_path):
    with pytest.raises(RecipeError, match=r"training.parallel='zero3' is invalid; expected 'ddp' or 'fsdp'"):
        load_recipe(QUICKSTART, ["training.parallel=zero3"])
    with pytest.raises(RecipeError, match="training.reshard_after_forward='yes' is invalid; expected true or false"):
        load_recipe(QUICKSTART, ["training.reshard_after_forward='yes'"])
    with pytest.warns(UserWarning, match="reshard_after_forward=false has no effect with training.parallel=ddp"):
        load_recipe(QUICKSTART, ["training.reshard_after_forward=false"])
    assert load_recipe(QUICKSTART).training.parallel == "ddp"


def test_precision_sets_what_fsdp_gathers_and_reduces_in():
    assert (mixed_precision("fp32").param_dtype, mixed_precision("fp32").reduce_dtype) == (None, None)
    assert (mixed_precision("bf16").param_dtype, mixed_precision("bf16").reduce_dtype) == (torch.bfloat16, torch.float32)
    assert (mixed_precision("fp16").param_dtype, mixed_precision("fp16").reduce_dtype) == (torch.float16, torch.float32)


def _needs(rank, full, state=(150, 200)):
    weights, optimizer = state
    return RankNeeds(rank, 2, weights, optimizer, 10, BudgetRange((4, 64), full, full + 50))


def test_the_fewest_ranks_scale_the_state_alone():
    # Rank 1 needs 1000 at 2 ranks: 500 of state (weights and gradients 150 each, optimizer 200)
    # and 500 that sharding does not divide. Unsharded, the state is 1300 (scratch included).
    ranks = [_needs(0, 900), _needs(1, 1000)]
    assert [ranks[1].estimate(n) for n in (1, 2, 3, 4)] == [1500, 1000, 834, 750]
    assert least_ranks(ranks, 1000) == 2 and least_ranks(ranks, 800) == 4 and least_ranks(ranks, 500) is None
    fits, line = verdict(ranks, 1000)
    assert fits and "one device cannot hold it unsharded (" in line and "1.27 KiB before any activation" in line
    assert "the fewest ranks that fit it: 2" in line
    fits, line = verdict(ranks, 800)
    assert not fits and "rank 1 needs 1000 B" in line and "the fewest ranks that fit it: 4" in line
    fits, line = verdict([_needs(0, 900, (50, 100)), _needs(1, 1000, (50, 100))], 1000)
    assert fits and "one device may hold it unsharded too" in line
    assert verdict(ranks, None) == (True, None)


def _rank_checks(rank: int, port: int) -> None:
    """In each of two spawned ranks: the gradients of a sharded step equal one process's on the
    global batch, checkpointing adds no all-gather, bf16 gathers in bf16, and the dry run's figures
    per rank (one spawn for them all: starting processes is what costs)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        _gradients_are_the_global_batchs(World(rank, 2))
        _checkpointing_gathers_nothing_more()
        _bf16_gathers_in_bf16_and_keeps_fp32_shards()
        _dry_run_says_what_each_rank_holds(World(rank, 2))
    finally:
        dist.destroy_process_group()
    end_rank(0)  # as the launcher's ranks end: Python's shutdown could abort on gloo's threads


def _bert_without_dropout(layers=3):
    model = tiny_bert(layers=layers)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _gradients_are_the_global_batchs(world: World) -> None:
    """7 rows: rank 0 takes 4, rank 1 takes 3, each loss weighted by ``local_batch``; FSDP averages
    the ranks' gradients in its reduce-scatter, which gives the 7 rows' mean."""
    model = _bert_without_dropout()
    reference = copy.deepcopy(model)
    batch = bert_batch(7, 12)
    reference(**batch).loss.backward()
    blocks = discover_blocks(model)
    shard_model(model, blocks, device_mesh(torch.device("cpu"), world.size))
    assert isinstance(model, FSDPModule) and all(isinstance(block, FSDPModule) for _, block in blocks)
    # One FSDP unit per block: nothing inside a block is a unit of its own.
    assert not any(isinstance(inner, FSDPModule) for _, block in blocks for inner in list(block.modules())[1:])
    assert held_param_bytes(model) < held_param_bytes(reference) * 0.6
    part, weight = local_batch(batch, world)
    with build_planner("full", model, None, blocks=blocks) as planner, planner.step(part):
        (model(**part).loss * weight).backward()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad.full_tensor(), theirs.grad, rtol=1e-4, atol=1e-6, msg=name)


def _checkpointing_gathers_nothing_more() -> None:
    """Every block checkpointed against none: the same all-gathers per step, with
    ``reshard_after_forward`` true (a unit gathered in forward and again in backward) or false
    (in forward only). The recompute runs inside the unit's backward, after its gather, and calls
    the block's forward, not the module: FSDP's hooks do not run in it. (Hence no
    ``set_reshard_after_backward(False)``: it would keep every block gathered between steps.)"""
    gathers = []
    real = fsdp_param_group.foreach_all_gather

    def counted(*args, **kwargs):
        gathers[-1] += 1
        return real(*args, **kwargs)

    fsdp_param_group.foreach_all_gather = counted
    try:
        for reshard in (True, False):
            model = _bert_without_dropout()
            blocks = discover_blocks(model)
            shard_model(model, blocks, device_mesh(torch.device("cpu"), 2), reshard_after_forward=reshard)
            for name in ("none", "full"):
                with build_planner(name, model, None, blocks=blocks) as planner:
                    for _ in range(2):  # the second step's count: no first-step lazy initialisation
                        gathers.append(0)
                        with planner.step(bert_batch(2, 8)):
                            model(**bert_batch(2, 8)).loss.backward()
    finally:
        fsdp_param_group.foreach_all_gather = real
    units = 3 + 1
    assert gathers[1::2] == [2 * units, 2 * units, units, units], gathers


def _bf16_gathers_in_bf16_and_keeps_fp32_shards() -> None:
    """training.precision=bf16: a block computes with its weights gathered in bf16; the shards and
    their gradients (reduce-scattered in fp32) stay fp32."""
    model = _bert_without_dropout()
    blocks = discover_blocks(model)
    shard_model(model, blocks, device_mesh(torch.device("cpu"), 2), precision="bf16")
    seen = []
    dense = blocks[0][1].intermediate.dense
    dense.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**bert_batch(2, 8)).loss
    loss.backward()
    assert seen == [torch.bfloat16]
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


def test_gradients_gathers_and_the_dry_run_across_two_sharded_processes():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    torch.multiprocessing.spawn(_rank_checks, args=(port,), nprocs=2)
