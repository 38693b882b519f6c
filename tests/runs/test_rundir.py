"""The run directory survives a kill or a full disk: JSON replaced whole, lines written whole,
directories claimed race-free."""

import errno
import io
import json
import os
import threading

import pytest

from mimose_cli import files
from mimose_cli.files import read_jsonl, write_json
from mimose_cli.runs.rundir import _append_line, check_out_dir, new_run_dir, unique_dir


def test_a_failed_json_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    write_json(path, {"status": "completed"})

    class FullDisk(io.StringIO):
        def write(self, text):
            super().write(text[:5])  # part of it reached the disk, then the disk was full
            raise OSError(errno.ENOSPC, "No space left on device")

    def fdopen(fd, mode):
        os.close(fd)
        return FullDisk()

    monkeypatch.setattr(files.os, "fdopen", fdopen)
    with pytest.raises(OSError, match="No space"):
        write_json(path, {"status": "oom", "padding": "x" * 100})
    assert json.loads(path.read_text()) == {"status": "completed"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_metrics_line_is_one_write_call():
    class Counting(io.StringIO):
        calls = 0

        def write(self, text):
            self.calls += 1
            return super().write(text)

    file = Counting()
    _append_line(file, {"step": 1, "loss": 0.5})
    assert file.calls == 1 and file.getvalue() == '{"step": 1, "loss": 0.5}\n'


def test_only_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "lo')
    assert read_jsonl(path) == [{"step": 0}, {"step": 1}]
    path.write_text('{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl line 2: not JSON"):
        read_jsonl(path)


def test_directories_started_at_once_are_each_their_own(tmp_path):
    base = tmp_path / "runs" / "20260101-000000-quickstart-mimose"
    claimed, barrier = [], threading.Barrier(8)

    def claim():
        barrier.wait()
        claimed.append(unique_dir(base))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(claimed)) == 8 and all(p.is_dir() for p in claimed)
    assert sorted(p.name for p in claimed)[0] == base.name
    first, second = new_run_dir(tmp_path / "r", "q", "mimose"), new_run_dir(tmp_path / "r", "q", "mimose")
    assert first != second


def test_a_missing_out_dir_is_created_and_checked_without_leaving_anything(tmp_path):
    out = tmp_path / "new" / "runs"
    assert check_out_dir(out) == out and out.is_dir() and list(out.iterdir()) == []


def test_one_writer_per_run_directory(tmp_path):
    from mimose_cli.runs.rundir import RunLock

    with RunLock(tmp_path):
        with pytest.raises(ValueError, match=rf"{tmp_path} is being written by process {os.getpid()} "):
            with RunLock(tmp_path):
                pass
    with RunLock(tmp_path):  # released on exit
        pass


def test_a_lock_dies_with_its_process(tmp_path):
    import subprocess
    import sys

    from mimose_cli.runs.rundir import RunLock

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from mimose_cli.runs.rundir import RunLock; "
                               f"lock = RunLock({str(tmp_path)!r}).__enter__(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ValueError, match=f"process {holder.pid} "):
        with RunLock(tmp_path):
            pass
    holder.kill()
    holder.wait()
    with RunLock(tmp_path):  # killed, not released: free all the same
        pass
