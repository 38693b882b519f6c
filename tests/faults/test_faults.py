"""Faults injected into real runs (``python -m mimose_cli train`` in a subprocess), each followed by
``--resume``: the run must train every batch exactly once and end with the uninterrupted run's
losses, bit for bit (the same CPU, one thread, a checkpoint holding every state a step reads)."""

import random
import signal

import pytest
from faults.driver import interrupt, records, resume, run_dir_in, summary, train

from mimose_cli.runs.rundir import load_run

SEED = 20261130  # the steps the faults land on are random, but the same on every run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: (step, micro_step, loss) per micro-batch."""
    out = tmp_path_factory.mktemp("reference")
    done = train(out)
    assert done.returncode == 0, done.stdout + done.stderr
    return records(run_dir_in(out))


def _assert_same_run(run_dir, reference):
    """The interrupted and resumed run against the uninterrupted one: losses bit for bit, since the
    same recipe and seed give the same batches and plans, so the same ops in the same order."""
    got = records(run_dir)
    assert [(s, m) for s, m, _ in got] == [(s, m) for s, m, _ in reference]  # each batch once
    assert [loss for *_, loss in got] == [loss for *_, loss in reference]  # bit for bit
    assert summary(run_dir)["status"] == "completed"
    assert summary(run_dir)["steps"] == len(reference)


@pytest.mark.parametrize("name, exit_code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_signal_stops_after_the_step_and_resume_finishes_the_same_run(tmp_path, reference, name, exit_code):
    at_step = random.Random(f"{SEED}{name}").randrange(1, 12)
    code, output, sent = interrupt(getattr(signal, name), at_step, out=tmp_path)
    run_dir = run_dir_in(tmp_path)
    stopped = summary(run_dir)
    assert sent and code == exit_code, output
    assert stopped["status"] == "interrupted" and stopped["signal"] == name
    assert (run_dir / "estimator.json").exists() and (run_dir / "model" / "config.json").exists()
    # It stopped at a step boundary with a checkpoint there: nothing after it to train again.
    assert stopped["checkpoint_step"] == stopped["optimizer_steps"] >= at_step + 1
    assert "--resume" in output

    again = resume(run_dir)
    assert again.returncode == 0, again.stdout + again.stderr
    _assert_same_run(run_dir, reference)
    assert summary(run_dir)["resumed_from_steps"] == [stopped["checkpoint_step"]]
    # The fitted estimator came back with the checkpoint: no second probe steps.
    assert summary(run_dir)["planner"]["probe_ms"] == stopped["planner"]["probe_ms"] > 0
    # The optimizer's state is restored after the pre-flight: it is not counted twice there.
    assert summary(run_dir)["preflight"] == stopped["preflight"]


def test_sigkill_twice_then_resume_finishes_the_same_run(tmp_path, reference):
    rng = random.Random(f"{SEED}SIGKILL")
    first, second = rng.randrange(3, 8), rng.randrange(10, 15)  # step 3 is recorded after the first checkpoint
    code, output, sent = interrupt(signal.SIGKILL, first, out=tmp_path)
    run_dir = run_dir_in(tmp_path)
    assert sent and code == -signal.SIGKILL, output
    assert not (run_dir / "summary.json").exists()
    summary_seen, _ = load_run(run_dir)  # readable as it is: no torn line breaks the report
    assert summary_seen["status"] == "interrupted" and summary_seen["steps"] >= first + 1

    code, output, sent = interrupt(signal.SIGKILL, second, resume_dir=run_dir)
    assert sent and code == -signal.SIGKILL, output
    again = resume(run_dir)
    assert again.returncode == 0, again.stdout + again.stderr
    _assert_same_run(run_dir, reference)
    resumed = summary(run_dir)["resumed_from_steps"]
    assert len(resumed) == 2 and all(step % 3 == 0 for step in resumed)  # checkpoint_every=3
