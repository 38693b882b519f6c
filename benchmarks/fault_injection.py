"""Faults injected into real runs, and how many the runs survived.

Signal trials: the tiny recipe of tests/faults (quickstart cut to 16 steps of a tiny BERT, a
checkpoint every 3 steps) runs as ``python -m mimose_cli train`` in a subprocess; up to --faults
signals, each drawn from SIGTERM, SIGINT, SIGHUP (a closed terminal) and SIGKILL, are sent at
random steps (each beyond the last step recorded, the first from step 3 on, once a checkpoint
exists), the run being resumed with ``--resume`` after each, and finally resumed to its end.
Full-disk trials run in this process: metrics.jsonl (at a random line) or a checkpoint (a random
one but the first) fails with ENOSPC part-way through its write, then the run is resumed to its
end. Final-save trials: a
SIGKILL while the finished run writes its model (once its temporary model directory exists),
then ``--resume`` must finish that save without training again. Concurrent-resume trials: a run
stopped by SIGTERM is resumed by two ``--resume`` processes started together; one must train it to
its end, the other be refused in one line (the run directory's lock) or find nothing left to do.

A fault is survived when its exit status is the expected one (143 SIGTERM, 130 SIGINT, 129
SIGHUP, killed, 1 full disk), the directory is readable by ``mimose report`` right after it, and the run, once
resumed to its end, has trained every batch exactly once with the uninterrupted run's losses bit
for bit. Writes benchmarks/results/fault_injection.json.

    python benchmarks/fault_injection.py [--trials 6] [--faults 3] [--disk-trials 6] [--save-trials 3]
        [--concurrent-trials 3] [--seed 0]
"""

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from faults.driver import (  # noqa: E402
    ENV,
    QUICKSTART,
    SIGNALS,
    TIMEOUT_S,
    TINY,
    command,
    full_disk,
    interrupt,
    last_step,
    records,
    resume,
    run_dir_in,
    summary,
    train,
)

from mimose_cli.launcher.recipe import load_recipe  # noqa: E402
from mimose_cli.launcher.resume import resume_recipe  # noqa: E402
from mimose_cli.launcher.train import run_training  # noqa: E402
from mimose_cli.runs.rundir import load_run  # noqa: E402

from _results import write_results  # noqa: E402

EXPECTED = {"SIGTERM": 143, "SIGINT": 130, "SIGHUP": 129, "SIGKILL": -9}
LAST_STEP = 15


def signal_trial(rng: random.Random, out: Path, faults: int, reference: list) -> list:
    """One run hit by up to ``faults`` signals, resumed after each; one row per signal sent."""
    rows, run_dir = [], None
    for _ in range(faults):
        low = max(3, last_step(run_dir / "metrics.jsonl") + 1 if run_dir else 3)
        if low > LAST_STEP - 1:
            break
        kind, at_step = rng.choice(sorted(SIGNALS)), rng.randrange(low, min(low + 5, LAST_STEP))
        code, _, sent = interrupt(SIGNALS[kind], at_step, out=out, resume_dir=run_dir)
        run_dir = run_dir or run_dir_in(out)
        if not sent:
            break
        load_run(run_dir)  # raises when the directory is not readable
        rows.append({"fault": kind, "at_step": at_step, "exit_code": code, "expected": code == EXPECTED[kind]})
        if (run_dir / "summary.json").exists() and summary(run_dir)["status"] == "completed":
            break  # the signal landed after the last step: nothing to resume
    if run_dir is not None and summary_status(run_dir) != "completed":
        resume(run_dir)
    same = run_dir is not None and summary_status(run_dir) == "completed" and records(run_dir) == reference
    for row in rows:
        row["survived"] = row["expected"] and same
    return rows


def summary_status(run_dir: Path):
    return summary(run_dir)["status"] if (run_dir / "summary.json").exists() else None


def disk_trial(rng: random.Random, out: Path, reference: list) -> dict:
    where = rng.choice(["metrics", "checkpoint"])
    # metrics: from line 3 on (the first checkpoint is written before it); checkpoint: not the first.
    after = rng.randrange(3, LAST_STEP + 1) if where == "metrics" else rng.randrange(2, 7)
    with full_disk(where, after):
        failed = run_training(load_recipe(QUICKSTART, TINY + [f"out_dir={out}"]), view="none")
    load_run(failed.run_dir)
    again = run_training(resume_recipe(failed.run_dir), view="none", resume=failed.run_dir)
    same = again.summary["status"] == "completed" and records(failed.run_dir) == reference
    expected = failed.exit_code == 1 and "No space left" in failed.summary["error"]
    return {"fault": f"full disk ({where})", "at": after, "exit_code": failed.exit_code,
            "expected": expected, "survived": expected and same}


def save_trial(out: Path, reference: list) -> dict | None:
    """SIGKILL while the model of the finished run is written, then ``--resume``; None when the
    save was over before the kill could land (the run completed)."""
    proc = subprocess.Popen(command(QUICKSTART, *TINY, "--out", out), env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline, sent = time.monotonic() + TIMEOUT_S, False
    while proc.poll() is None and time.monotonic() < deadline:
        run_dir = next((p for p in out.iterdir() if p.is_dir()), None) if out.exists() else None
        if run_dir is not None and (run_dir / ".model.tmp").exists():
            proc.send_signal(signal.SIGKILL)
            sent = True
            break
        time.sleep(0.001)
    code = proc.wait(timeout=TIMEOUT_S)
    run_dir = run_dir_in(out)
    if not sent or summary_status(run_dir) == "completed":
        return None
    load_run(run_dir)
    done = resume(run_dir)
    whole = (done.returncode == 0 and summary_status(run_dir) == "completed"
             and (run_dir / "model" / "config.json").is_file() and not (run_dir / ".model.tmp").exists())
    return {"fault": "SIGKILL in the final save", "at": "model", "exit_code": code, "expected": code == -9,
            "survived": code == -9 and whole and records(run_dir) == reference}


def concurrent_trial(rng: random.Random, out: Path, reference: list) -> dict:
    """Two ``--resume`` at once on a run stopped by SIGTERM: one trains it to its end, the other
    is refused in one line (or, started after the first ended, finds nothing left to train)."""
    at_step = rng.randrange(3, LAST_STEP - 4)
    code, _, _ = interrupt(signal.SIGTERM, at_step, out=out)
    run_dir = run_dir_in(out)
    procs = [subprocess.Popen(command("--resume", run_dir), env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]  # read as they run: no pipe fills up
    results = [(p.returncode, text) for p, text in zip(procs, outputs)]
    trained = [c for c, _ in results if c == 0]
    others = [text for c, text in results if c != 0]
    refused = all("is being written by" in text or "raise training.max_steps" in text for text in others)
    expected = code == 143 and len(trained) == 1 and len(others) == 1 and refused
    return {"fault": "two --resume at once", "at_step": at_step, "exit_code": [c for c, _ in results],
            "refused_by": ["lock" if "is being written by" in text else "nothing left" for text in others],
            "expected": expected, "survived": expected and summary_status(run_dir) == "completed"
            and records(run_dir) == reference}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--faults", type=int, default=3, help="signals per signal trial, at most")
    parser.add_argument("--disk-trials", type=int, default=6)
    parser.add_argument("--save-trials", type=int, default=3)
    parser.add_argument("--concurrent-trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        done = train(tmp / "reference")
        assert done.returncode == 0, done.stderr
        reference = records(run_dir_in(tmp / "reference"))
        for trial in range(args.trials):
            rows += signal_trial(rng, tmp / f"signals-{trial}", args.faults, reference)
        save_attempts = 0
        saved = lambda: sum(r["fault"].endswith("final save") for r in rows)  # noqa: E731
        while saved() < args.save_trials and save_attempts < 4 * args.save_trials:
            row = save_trial(tmp / f"save-{save_attempts}", reference)
            save_attempts += 1
            if row is not None:
                rows.append(row)
        for trial in range(args.concurrent_trials):
            rows.append(concurrent_trial(rng, tmp / f"concurrent-{trial}", reference))
        torch.set_num_threads(1)  # as the subprocesses run (OMP_NUM_THREADS=1)
        disk_reference = records(run_training(load_recipe(QUICKSTART, TINY + [f"out_dir={tmp / 'disk-ref'}"]),
                                              view="none").run_dir)
        for trial in range(args.disk_trials):
            rows.append(disk_trial(rng, tmp / f"disk-{trial}", disk_reference))
    kinds = sorted({row["fault"] for row in rows})
    injected, survived = Counter(r["fault"] for r in rows), Counter(r["fault"] for r in rows if r["survived"])
    print(f"{'fault':<26} {'injected':>8} {'survived':>8}")
    for kind in kinds:
        print(f"{kind:<26} {injected[kind]:>8} {survived[kind]:>8}")
    print(f"{'total':<26} {sum(injected.values()):>8} {sum(survived.values()):>8}")
    write_results("fault_injection", rows, seed=args.seed, trials=args.trials, faults_per_trial=args.faults,
                  disk_trials=args.disk_trials, save_attempts=save_attempts, concurrent_trials=args.concurrent_trials,
                  injected=sum(injected.values()), survived=sum(survived.values()),
                  recipe=["recipes/quickstart.yaml", *TINY])


if __name__ == "__main__":
    main()
