"""Every script in examples/ runs as a user would run it (a fresh process, the repository on the
path) and prints what it promises: CI runs the test suite, so CI runs the examples."""

import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT

EXAMPLES = ROOT / "examples"

# What each example must print: every pattern matches some line of its output.
EXPECTED = {
    "hf_trainer.py": [
        r"'mimose/peak_bytes': \d+, 'mimose/blocks_checkpointed'",  # the Trainer's own log lines
        r"^mimose: 16 micro-batches, (?P<checkpointed>\d+) with blocks checkpointed "
        r"\((?P<measured>\d+) of them while measuring\), 0 retries; "
        r"peak (?P<peak>[\d.]+) MB of the (?P<budget>[\d.]+) MB budget$",
    ],
    "trl_sft.py": [
        r"^SFTConfig\(gradient_checkpointing=True -> False\); 6 steps, losses equal to the run without "
        r"mimose \([\d., ]+\); LoRA weights after training bit-identical$",
        r"^mimose: 12 micro-batches, (?P<checkpointed>\d+) with blocks checkpointed "
        r"\((?P<measured>\d+) of them while measuring\), 0 retries; "
        r"peak (?P<peak>[\d.]+) MB of the (?P<budget>[\d.]+) MB budget$",
    ],
}


def test_every_example_has_expectations():
    assert sorted(path.name for path in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


def _run(name: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name):
    out = _run(name)
    found = {}
    for pattern in EXPECTED[name]:
        match = re.search(pattern, out, re.MULTILINE)
        assert match, f"{name} printed no line matching {pattern!r}:\n{out[-3000:]}"
        found.update(match.groupdict())
    micro_batches = {"hf_trainer.py": 16, "trl_sft.py": 12}[name]
    # The budget bites: some planned micro-batches checkpoint, not all; and it holds.
    assert 0 < int(found["checkpointed"]) - int(found["measured"]) and int(found["checkpointed"]) < micro_batches
    assert float(found["peak"]) <= float(found["budget"])
