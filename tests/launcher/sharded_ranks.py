"""A tiny FSDP2 run for the sharded-checkpoint and rank-failure tests (not a test module): under
``python -m mimose_cli.launcher.torchrun --standalone --nproc-per-node N sharded_ranks.py RUN_DIR
STEPS [options]`` each gloo rank trains a 3-block BERT ``fully_shard``ed per block and at the root
on its own batches, checkpoints with ``launcher.sharded`` every ``--every`` steps, and at the end
writes the gathered model and its losses. Failures end it as the launcher's loop does
(``failures.stopped_by``): rank 0 prints the one line, the failing rank exits 1.

Options: ``--resume`` (from RUN_DIR's checkpoint), ``--oom-at S`` (rank 1 runs out of memory in
the backward of step S), ``--kill WHERE:S`` (SIGKILL in the save of step S: ``write`` on rank 1
while writing its files, ``switch`` on rank 0 after the rename, before ``current`` points to it),
``--reshard`` (load RUN_DIR's checkpoint into this world's model and write its logits)."""

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import get_linear_schedule_with_warmup

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # helpers, when run as a script
from helpers import QUICKSTART, bert_batch, sharded_probe_batch, tiny_bert  # noqa: E402

from mimose_cli.launcher import sharded  # noqa: E402
from mimose_cli.launcher.checkpoint import Progress  # noqa: E402
from mimose_cli.launcher.distributed import World  # noqa: E402
from mimose_cli.launcher.failures import RankOutOfMemory, out_of_memory, stopped_by  # noqa: E402
from mimose_cli.launcher.recipe import load_recipe  # noqa: E402
from mimose_cli.launcher.signals import StopRequest  # noqa: E402
from mimose_cli.launcher.spawn import end_rank, leave_exit_status  # noqa: E402



class StepCounter:
    """Stands in for a planner: a rank's own state, saved and restored with its rank."""

    def __init__(self):
        self.steps = 0

    def state_dict(self):
        return {"name": "counter", "steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def build(world: World):
    mesh = init_device_mesh("cpu", (world.size,))
    model = tiny_bert(layers=3, seed=0)
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return SimpleNamespace(model=model, optimizer=optimizer, scaler=None, world=world, device=torch.device("cpu"),
                           scheduler=get_linear_schedule_with_warmup(optimizer, 1, 20), planner=StepCounter(),
                           recipe=load_recipe(QUICKSTART), meter=SimpleNamespace(track=lambda *a: None), step=0)


def _die_in(where: str, at: int, rank: int) -> None:
    """SIGKILL this process at ``where`` in the save of step ``at``."""
    if where == "write" and rank == 1:
        write = sharded.write_durably

        def killing_write(path, state):
            write(path, state)
            if Path(path).parent.name == f".step-{at:08d}.tmp":
                os.kill(os.getpid(), signal.SIGKILL)

        sharded.write_durably = killing_write
    if where == "switch" and rank == 0:
        point = sharded._point_to

        def killing_point(root, name):
            if name == f"step-{at:08d}":
                os.kill(os.getpid(), signal.SIGKILL)
            point(root, name)

        sharded._point_to = killing_point


def _out_of_memory(grad):
    raise torch.OutOfMemoryError("injected: out of memory in backward")


def train_step(trainer, step: int, oom_at: int | None) -> float:
    rank = trainer.world.rank
    batch = bert_batch(2, 8 + 4 * (step % 3), seed=10 * step + rank)
    try:
        hidden = []
        if step == oom_at and rank == 1:  # mid-backward: after the last block's reduce-scatter began
            handle = trainer.model.bert.encoder.layer[1].register_forward_hook(
                lambda module, args, output: hidden.append(output[0] if isinstance(output, tuple) else output))
        loss = trainer.model(**batch).loss
        if hidden:
            handle.remove()
            hidden[0].register_hook(_out_of_memory)
        loss.backward()
    except torch.OutOfMemoryError as error:
        raise out_of_memory(rank, step, 0, tuple(batch["input_ids"].shape), error) from None
    trainer.optimizer.step()
    trainer.scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.planner.steps += 1
    return loss.item()


def logits(model) -> list:
    model.eval()
    with torch.no_grad():
        out = model(**sharded_probe_batch()).logits.tolist()
    model.train()
    return out


def run(args, world: World) -> int:
    run_dir = Path(args.run_dir)
    trainer = build(world)
    torch.manual_seed(world.rank)  # dropout: each rank its own masks (a resume restores the RNG)
    if args.reshard:
        folder = sharded.load_sharded_checkpoint(run_dir)["folder"]
        sharded.load_sharded_model(trainer.model, folder)
        resharded = logits(trainer.model)  # every rank: a sharded forward is collective
        if world.is_main:
            (run_dir / f"logits-resharded-{world.size}.json").write_text(json.dumps(resharded))
        return 0
    start, losses = 0, {}
    if args.resume:
        checkpoint = sharded.load_sharded_checkpoint(run_dir)
        start = sharded.restore_sharded_trainer(trainer, checkpoint).step
        sharded.restore_sharded_step_state(trainer, checkpoint)
    if args.kill:
        where, at = args.kill.split(":")
        _die_in(where, int(at), world.rank)
    try:
        for step in range(start, args.steps):
            losses[step] = train_step(trainer, step, args.oom_at)
            (run_dir / f"losses-{args.tag}-rank{world.rank}.json").write_text(json.dumps(losses))  # a kill keeps them
            trainer.step = step + 1
            if trainer.step % args.every == 0:
                sharded.save_sharded_checkpoint(run_dir, trainer, Progress(step=trainer.step))
    except (RankOutOfMemory, RuntimeError) as error:
        stopped = stopped_by(error, run_dir, world.rank, trainer.step)
        if stopped is None:
            raise
        if world.is_main:
            print(f"error: {stopped.error}", file=sys.stderr, flush=True)
        return 1 if world.is_main or stopped.failed_rank == world.rank else 0
    trained = logits(trainer.model)
    if world.is_main:
        (run_dir / f"logits-{args.tag}.json").write_text(json.dumps(trained))
    sharded.save_sharded_model(trainer.model, run_dir, world)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--reshard", action="store_true")
    parser.add_argument("--oom-at", type=int)
    parser.add_argument("--kill")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = World.from_env()
    dist.init_process_group("gloo")
    try:
        with StopRequest(announce=False):  # as the launcher's ranks: torchrun's SIGTERM waits for the end
            code = run(args, world)
    except ValueError as error:  # the launcher's user mistakes: one line
        print(f"error: {error}", file=sys.stderr, flush=True)
        code = 2
    finally:
        dist.destroy_process_group()
    leave_exit_status(code)  # as the launcher's rank 0 does: torchrun then adds no line of its own
    return code


if __name__ == "__main__":
    end_rank(main())  # as the launcher's ranks end: Python's shutdown could abort on gloo's threads
