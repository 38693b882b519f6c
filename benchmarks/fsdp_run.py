"""Sharded and planned: `mimose train ... training.parallel=fsdp --nproc-per-node 2` (torchrun, gloo,
the CPU) of a model whose training state one device cannot hold at the budget, while the pre-flight
says two sharded ranks can; with mimose, with every block checkpointed (`full`, torchtitan's
default) and with the best every-n stride that fits (`hf-every-n` finds it at the largest input).

The planners run in rotated order, round after round (round r starts at the r-th planner), so
that a slow spell of the shared machine falls on each alike. Reported per run: status (a planner
that cannot plan a sharded model yet is refused in one line, and shown so), mean iteration time,
out-of-memory steps, every rank's peak against the budget, the prediction error of every rank
(predicted step peak against the measured one before the optimizer step; planners that predict
nothing show "-"), mean blocks checkpointed, and the largest relative difference of a step's loss
from one process with the global batch (no budget). Then the time ratios of mimose against the
two others, the median over the rounds. The dry runs first: fsdp at the budget, and one process
(ddp) at the same budget, which must refuse it.

    PYTHONPATH=. python benchmarks/fsdp_run.py [--steps 20] [--rounds 2] [--budget 70MB]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write_results

from mimose_cli.units import parse_size

ROOT = Path(__file__).resolve().parents[1]
PLANNERS = ("mimose", "full", "hf-every-n")
# BERT of 6 layers, hidden 256: 5.2 M parameters, 99 MiB of training state unsharded (weights,
# gradients, AdamW's moments, its step's scratch); qqp-like lengths up to 96, 4 examples per rank.
# No dropout: each rank would draw its own masks, and the losses are compared with one process's.
RECIPE = ["task=sequence_classification", "data.preset=qqp", "data.num_examples=400", "data.max_length=96",
          "training.checkpoint_every=null",
          "model.config_overrides={hidden_size: 256, intermediate_size: 1024, num_hidden_layers: 6, "
          "num_attention_heads: 4, hidden_dropout_prob: 0.0, attention_probs_dropout_prob: 0.0}"]


def mimose(*args) -> subprocess.CompletedProcess:
    """``python -m mimose_cli train`` of the quickstart recipe with ``RECIPE`` and ``args``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "mimose_cli", "train", str(ROOT / "recipes" / "quickstart.yaml"), *RECIPE,
               *map(str, args)]
    return subprocess.run(command, env=env, capture_output=True, text=True)


def dry_runs(budget: str) -> dict:
    """The per-rank dry run of fsdp at ``budget`` and the one-process dry run at the same budget."""
    sharded = mimose("training.batch_size=4", "training.parallel=fsdp", "--planner", "full", "--budget", budget,
                     "--nproc-per-node", 2, "--dry-run")
    one = mimose("training.batch_size=4", "--planner", "full", "--budget", budget, "--dry-run")
    print(sharded.stdout.strip())
    print(f"one process at {budget}: exit {one.returncode}: {one.stdout.strip().splitlines()[-1]}")
    verdict = sharded.stdout.strip().splitlines()[-1]
    return {"sharded_exit": sharded.returncode, "sharded_verdict": verdict, "one_process_exit": one.returncode,
            "one_process_verdict": one.stdout.strip().splitlines()[-1]}


def lines(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(out: Path, planner: str, budget: str, steps: int) -> dict:
    """One sharded run; its figures (``status`` "refused" with the error when it did not start)."""
    start = time.perf_counter()
    done = mimose("training.batch_size=4", "training.parallel=fsdp", "--planner", planner, "--budget", budget,
                  "--nproc-per-node", 2, f"training.max_steps={steps}", "--out", out, "--view", "none")
    wall_s = time.perf_counter() - start
    runs = [p for p in out.iterdir() if p.is_dir()] if out.exists() else []
    if not runs:
        error = next((line for line in done.stderr.splitlines() if line.startswith("error:")), done.stderr[-300:])
        return {"planner": planner, "status": "refused", "error": error, "wall_s": wall_s}
    (run_dir,) = runs
    summary = json.loads((run_dir / "summary.json").read_text())
    records = lines(run_dir)
    return {"planner": planner, "status": summary["status"], "error": summary.get("error"), "wall_s": wall_s,
            "mean_iter_ms": summary["mean_iter_ms"], "oom_steps": summary["oom_steps"],
            "every_n_layers": summary["planner"].get("every_n_layers"),
            "mean_checkpointed_blocks": summary["mean_checkpointed_blocks"],
            "ranks": [{**rank, "max_prediction_error": prediction_error(records, rank["rank"]),
                       **signed_errors(records, rank["rank"])} for rank in summary["ranks"]],
            "losses": [line["loss"] for line in records]}


def prediction_errors(records: list, rank: int) -> list:
    """The relative errors (predicted - measured) / measured of the rank's predicted step peaks
    against its measured ones (before the optimizer step); empty when the planner predicted nothing."""
    return [(f["predicted_peak_bytes"] - f["fwd_bwd_peak_bytes"]) / f["fwd_bwd_peak_bytes"]
            for line in records for f in line["ranks"] if f["rank"] == rank
            and f.get("predicted_peak_bytes") is not None and f.get("fwd_bwd_peak_bytes")]


def prediction_error(records: list, rank: int) -> float | None:
    """The largest relative error, either way (``prediction_errors``); None when none."""
    errors = prediction_errors(records, rank)
    return max(map(abs, errors)) if errors else None


def signed_errors(records: list, rank: int) -> dict:
    """The most negative (under) and most positive (over) relative error; None when none."""
    errors = prediction_errors(records, rank)
    return {"min_prediction_error": min(errors) if errors else None,
            "max_signed_prediction_error": max(errors) if errors else None}


def one_process_losses(out: Path, steps: int) -> list:
    """The losses of one process with the global batch (8) and no budget: the reference."""
    done = mimose("training.batch_size=8", "budget=null", "--planner", "none", f"training.max_steps={steps}",
                  "--out", out, "--view", "none")
    assert done.returncode == 0, done.stderr[-2000:]
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return [line["loss"] for line in lines(run_dir)]


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list, budget_bytes: int) -> None:
    print("| round | planner | status | mean iter ms | OOM steps | every n | mean blocks | rank peaks MiB "
          f"(budget {budget_bytes / 2**20:.2f}) | max prediction error per rank | error range per rank (under … over) "
          "| max loss difference |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] == "refused":
            print(f"| {r['round']} | {r['planner']} | refused: {r['error']} | | | | | | | | |")
            continue
        peaks = " / ".join(f"{rank['peak_bytes'] / 2**20:.2f}" for rank in r["ranks"])
        errors = " / ".join(_fmt(rank["max_prediction_error"], ".2%") for rank in r["ranks"])
        ranges = " / ".join(f"{_fmt(rank['min_prediction_error'], '+.2%')} … "
                            f"{_fmt(rank['max_signed_prediction_error'], '+.2%')}" for rank in r["ranks"])
        print(f"| {r['round']} | {r['planner']} | {r['status']} | {r['mean_iter_ms']:.0f} | {r['oom_steps']} "
              f"| {_fmt(r['every_n_layers'], 'd')} | {r['mean_checkpointed_blocks']:.2f} | {peaks} | {errors} | {ranges} "
              f"| {_fmt(r['max_loss_difference'], '.1e')} |")


def ratios(rows: list) -> dict:
    """mimose's mean iteration time over each other planner's, the median over the rounds (None
    where either did not complete a run)."""
    out = {}
    for other in PLANNERS[1:]:
        per_round = []
        for round_ in sorted({r["round"] for r in rows}):
            times = {r["planner"]: r.get("mean_iter_ms") for r in rows if r["round"] == round_
                     and r["status"] == "completed"}
            if times.get("mimose") and times.get(other):
                per_round.append(times["mimose"] / times[other])
        out[f"mimose_over_{other}"] = statistics.median(per_round) if per_round else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget", default="70MB")
    args = parser.parse_args()
    budget_bytes = parse_size(args.budget)
    checks = dry_runs(args.budget)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        reference = one_process_losses(Path(tmp) / "one", args.steps)
        for round_ in range(args.rounds):
            order = PLANNERS[round_ % len(PLANNERS):] + PLANNERS[:round_ % len(PLANNERS)]
            for planner in order:
                row = {"round": round_, **train(Path(tmp) / f"{round_}-{planner}", planner, args.budget, args.steps)}
                losses = row.pop("losses", None)
                row["max_loss_difference"] = None if not losses or len(losses) != len(reference) else max(
                    abs(a - b) / abs(b) for a, b in zip(losses, reference))
                rows.append(row)
    print(f"{args.steps} steps, 2 ranks x 4 examples, budget {args.budget}, {args.rounds} rotated rounds")
    table(rows, budget_bytes)
    times = ratios(rows)
    print("time ratios (median over rounds): " + ", ".join(f"{k} {_fmt(v, '.3f')}" for k, v in times.items()))
    write_results("fsdp_run", rows, steps=args.steps, rounds=args.rounds, budget=args.budget, **checks, **times,
                  targets={"mimose_over_full": 0.85, "mimose_over_hf-every-n": 0.95, "prediction_error": 0.02})


if __name__ == "__main__":
    main()
