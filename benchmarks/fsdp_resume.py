"""SIGTERM mid-run under `training.parallel=fsdp`, then `--resume` from the sharded checkpoint:
the resumed run's losses against the uninterrupted run's, through the CLI with Mimose on 2 ranks
(torchrun, gloo, the CPU) at a budget one process refuses.

The launcher gets SIGTERM once rank 0 has recorded KILL_AT steps; it forwards it to the ranks,
which stop after their step with a sharded checkpoint; `mimose train --resume` continues from it.

    PYTHONPATH=. python benchmarks/fsdp_resume.py [--steps 30] [--kill-at 12]
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write_results

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ["task=sequence_classification", "data.preset=qqp", "data.num_examples=400", "data.max_length=64",
          "training.batch_size=4", "training.warmup_steps=0", "training.checkpoint_every=5",
          "model.config_overrides={hidden_dropout_prob: 0.0, attention_probs_dropout_prob: 0.0}",
          "training.parallel=fsdp", "--budget", "3.9MB", "--nproc-per-node", "2"]


def _command(*args) -> list:
    return [sys.executable, "-m", "mimose_cli", "train", *args]


def _losses(out: Path) -> list:
    run = next(out.iterdir())
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _cut(out: Path, steps: int, kill_at: int) -> tuple:
    """The run, SIGTERM once KILL_AT steps are recorded; its exit status and directory."""
    launcher = subprocess.Popen(_command(str(ROOT / "recipes/quickstart.yaml"), *RECIPE,
                                         f"training.max_steps={steps}", "--out", str(out), "--view", "plain"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ)
    while launcher.poll() is None:
        metrics = list(out.glob("*/metrics.jsonl"))
        if metrics and len(metrics[0].read_text().splitlines()) >= kill_at:
            launcher.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    return launcher.wait(timeout=300), next(out.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        whole, cut = Path(tmp, "whole"), Path(tmp, "cut")
        subprocess.run(_command(str(ROOT / "recipes/quickstart.yaml"), *RECIPE, f"training.max_steps={args.steps}",
                                "--out", str(whole), "--view", "plain"),
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
        status, run_dir = _cut(cut, args.steps, args.kill_at)
        summary = json.loads((run_dir / "summary.json").read_text())
        stopped_at = summary.get("checkpoint_step")
        resumed = subprocess.run(_command("--resume", str(run_dir), "--nproc-per-node", "2", "--view", "plain"),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
        a, b = _losses(whole), _losses(cut)
    worst = max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)), default=None)
    row = {"steps": args.steps, "sigterm_exit": status, "stopped_status": summary["status"],
           "signal": summary.get("signal"), "checkpoint_step": stopped_at, "resume_exit": resumed.returncode,
           "steps_recorded": len(b), "max_relative_loss_difference": worst}
    print("| SIGTERM exit | stopped | checkpoint at step | resume exit | steps recorded | largest loss difference |")
    print("|---|---|---|---|---|---|")
    print(f"| {status} | {summary['status']} ({summary.get('signal')}) | {stopped_at} | {resumed.returncode} | "
          f"{len(b)} of {len(a)} | {worst:.1e} |")
    if resumed.returncode:
        print(resumed.stderr[-2000:])
    write_results("fsdp_resume", [row])


if __name__ == "__main__":
    main()
