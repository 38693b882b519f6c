"""A full disk, injected in-process by a patched writer: the run ends with a clear error and a
directory ``mimose report`` reads, and ``--resume`` finishes it as if nothing had happened."""

import shutil
import subprocess

import pytest
import torch
from faults.driver import QUICKSTART, TINY, full_disk, records

from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.launcher.resume import resume_recipe
from mimose_cli.launcher.train import run_training
from mimose_cli.runs.rundir import load_run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    result = run_training(load_recipe(QUICKSTART, TINY + [f"out_dir={out}"]), view="none")
    return records(result.run_dir)


@pytest.mark.parametrize("where", ["metrics", "checkpoint"])
def test_full_disk_ends_the_run_readably_and_resume_finishes_it(tmp_path, reference, where):
    with full_disk(where, 8 if where == "metrics" else 2):  # checkpoint 2: the one after step 6
        result = run_training(load_recipe(QUICKSTART, TINY + [f"out_dir={tmp_path}"]), view="none")
    run_dir = result.run_dir
    assert result.summary["status"] == "failed" and result.exit_code == 1
    assert "No space left on device" in result.summary["error"] and str(run_dir) in result.summary["error"]
    assert not (run_dir / ".checkpoint.pt.tmp").exists() and not (run_dir / "model").exists()
    assert result.summary["checkpoint_step"] == (6 if where == "metrics" else 3)
    summary, seen = load_run(run_dir)  # mimose report's reading: the torn line is skipped
    assert summary["status"] == "failed" and len(seen) == (8 if where == "metrics" else 6)
    kept = torch.load(run_dir / "checkpoint.pt", weights_only=True)  # the earlier one, whole
    assert kept["progress"]["step"] == result.summary["checkpoint_step"]

    again = run_training(resume_recipe(run_dir), view="none", resume=run_dir)
    assert again.summary["status"] == "completed"
    # every batch once, the same losses bit for bit (the same batches and plans: the same ops in order)
    assert records(run_dir) == reference
    assert again.summary["resumed_from_steps"] == [result.summary["checkpoint_step"]]


@pytest.fixture
def small_disk(tmp_path):
    """A real file system of 4.5 MB (a tmpfs): room for one checkpoint of the tiny run, not for
    the next beside it. Skipped where this process cannot mount one (it needs root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4500k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs (a real full disk) needs root and mount")
    yield disk
    subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_real_full_disk_ends_the_run_and_its_resume_in_one_line(small_disk):
    """torch's serializer reports a full disk as its own RuntimeError ("unexpected pos ...") and
    safetensors as a SafetensorError: both end the run as the OSError does, in one line, with the
    earlier checkpoint whole; a resume on the still-full disk ends the same way."""
    result = run_training(load_recipe(QUICKSTART, TINY + [f"out_dir={small_disk}"]), view="none")
    assert result.summary["status"] == "failed" and result.exit_code == 1
    assert "No space left on device" in result.summary["error"]
    kept = torch.load(result.run_dir / "checkpoint.pt", weights_only=True)
    assert kept["progress"]["step"] == result.summary["checkpoint_step"] == 3
    again = run_training(resume_recipe(result.run_dir), view="none", resume=result.run_dir)
    assert again.summary["status"] == "failed" and "No space left on device" in again.summary["error"]
    assert torch.load(result.run_dir / "checkpoint.pt", weights_only=True)["progress"]["step"] == 3
