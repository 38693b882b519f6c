"""A rank that fails never leaves the others running or waiting: a rank out of memory in a sharded
step ends every rank through the training loop with one line (``failures.py``), and a killed
``--nproc-per-node`` launcher stops its ranks (``signals.stop_with_parent``)."""

import json
import os
import signal
import socket
import subprocess
import time

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from faults import driver
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from mimose_cli.launcher import step, train
from mimose_cli.launcher.distributed import World
from mimose_cli.launcher.failures import (
    OUT_OF_MEMORY_FILE,
    OutOfMemoryRecord,
    RankOutOfMemory,
    out_of_memory,
    sizes_out_of_memory,
)
from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.launcher.spawn import end_rank

from helpers import QUICKSTART

FAILED_STEP = 3
RECIPE = [*driver.TINY, "training.max_steps=6", "training.checkpoint_every=2"]


def _free_port() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def _rank(rank: int, port: int, out: str) -> None:
    """One rank of a 2-process run of RECIPE; rank 1's step FAILED_STEP raises what a sharded step
    raises when it runs out of memory (its first micro-batch)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if rank == 1:
        micro_batch = train.micro_batch

        def failing(trainer, batch, counter, micro_step):
            if trainer.step == FAILED_STEP:
                error = torch.OutOfMemoryError("injected: out of memory in backward")
                raise out_of_memory(1, trainer.step, micro_step, (2, 32), error)
            return micro_batch(trainer, batch, counter, micro_step)

        train.micro_batch = failing
    recipe = load_recipe(QUICKSTART, [*RECIPE, f"out_dir={out}"])
    train.run_training(recipe, view="none", world=World(rank, 2))
    end_rank(0)  # as the launcher's ranks end: Python's shutdown could abort on gloo's threads


def test_a_rank_out_of_memory_ends_every_rank_through_the_loop_and_keeps_the_checkpoint(tmp_path):
    ranks = torch.multiprocessing.spawn(_rank, args=(_free_port(), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 60
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("a rank still runs 60 s after the other's failure began")
    run_dir = driver.run_dir_in(tmp_path)
    summary = driver.summary(run_dir)
    assert summary["status"] == "oom" and summary["failed_rank"] == 1
    assert summary["error"].startswith(f"rank 1 ran out of memory at step {FAILED_STEP} on input size (2, 32) "
                                       "(injected: out of memory in backward)")
    assert summary["checkpoint_step"] == 2 and summary["model_dir"] is None
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["progress"]["step"] == 2
    assert sizes_out_of_memory(run_dir) == [(2, 32)]
    assert json.loads((run_dir / OUT_OF_MEMORY_FILE).read_text())["rank"] == 1


def test_out_of_memory_in_a_sharded_step_raises_before_any_collective(tmp_path, monkeypatch):
    """Under FSDP a micro-batch out of memory is not recorded for the ranks to agree on (an
    all-reduce the peers, waiting inside the step's collectives, would never join): it raises
    RankOutOfMemory with the rank, the optimizer step and the planner's input size."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))

        def out_of_memory_step(*args):
            raise torch.OutOfMemoryError("injected: out of memory in backward")

        monkeypatch.setattr(step, "train_step", out_of_memory_step)
        trainer = SimpleNamespace(model=model, world=World(1, 2), step=3,
                                  planner=SimpleNamespace(last=SimpleNamespace(input_size=(2, 8))),
                                  recipe=SimpleNamespace(training=SimpleNamespace(gradient_accumulation_steps=2)))
        with pytest.raises(RankOutOfMemory) as raised:
            step.micro_batch(trainer, {"input_ids": torch.zeros(4, 8, dtype=torch.long)}, None, micro_step=1)
        assert raised.value.record == OutOfMemoryRecord(1, 3, 1, [2, 8], "injected: out of memory in backward")
    finally:
        dist.destroy_process_group()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read()
    except OSError:  # gone meanwhile
        return b""


def _processes_of(out) -> list:
    """The pids whose command line names ``out`` (the launcher, torchrun's agent, the ranks)."""
    return [int(name) for name in os.listdir("/proc")
            if name.isdigit() and int(name) != os.getpid() and str(out).encode() in _cmdline(int(name))]


@pytest.mark.skipif(not os.path.isdir("/proc") or not os.uname().sysname == "Linux",
                    reason="PR_SET_PDEATHSIG and /proc are Linux's")
@pytest.mark.parametrize("killed", ["launcher", "agent"])
def test_a_killed_launcher_stops_its_ranks_after_their_step_with_a_checkpoint(tmp_path, killed):
    """SIGKILL, which nobody can forward, to ``mimose train --nproc-per-node 2`` or to its torchrun
    agent: the ranks get SIGTERM (their parent's death) and stop as SIGTERM stops them."""
    command = driver.command(QUICKSTART, *driver.TINY, "training.max_steps=400", "training.checkpoint_every=null",
                             "--out", tmp_path, "--nproc-per-node", "2")
    launcher = subprocess.Popen(command, env=driver.ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + driver.TIMEOUT_S
    while (driver._new_run_dir(tmp_path) is None or driver.last_step(driver.run_dir_in(tmp_path) / "metrics.jsonl") < 2):
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    assert len(_processes_of(tmp_path)) == 4  # the launcher, torchrun's agent and 2 ranks
    if killed == "launcher":
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    else:
        (agent,) = [pid for pid in _processes_of(tmp_path) if b"mimose_cli.launcher.torchrun" in _cmdline(pid)]
        os.kill(agent, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while _processes_of(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _processes_of(tmp_path)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks still training 60 s after the {killed} was killed"
    summary = driver.summary(driver.run_dir_in(tmp_path))
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM"
    assert 2 <= summary["checkpoint_step"] == summary["optimizer_steps"] < 400
