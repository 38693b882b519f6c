"""The allocator meter counts what the dispatch meter counts, to the byte, plus compiled code;
it enforces its budget at allocation and falls back to the dispatch meter where it cannot build."""

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
import warnings

import numpy as np
import pytest
import torch
from torch.utils import cpp_extension

from mimose_cli.memory import allocator, build_meter
from mimose_cli.memory.allocator import AllocatorMeter, AllocatorUnavailable, load_allocator
from mimose_cli.units import format_bytes

from memory.test_simulated import B, D, bert_step_against_memtracker, expected_stack, make_stack, stack_forward
from helpers import require_allocator

F32 = 4


@pytest.fixture(scope="session")
def native():
    """The extension, built once per test session (about 10 s on a fresh machine)."""
    return require_allocator()


@pytest.fixture
def meter(native):
    return AllocatorMeter()


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_linear_stack_matches_hand_count(meter, ckpt):
    blocks = make_stack()
    with meter.activate():
        meter.track(blocks)
        x = torch.randn(B, D)
        with meter.step() as mem:
            loss = stack_forward(blocks, x, ckpt)
            after_forward = meter.current_bytes()
            loss.backward()
            del loss
    want_after_forward, want_peak = expected_stack(ckpt)
    assert after_forward == want_after_forward  # checkpoint's saved RNG state is host memory
    assert mem.peak_bytes == want_peak


@pytest.mark.filterwarnings("ignore:Module is None")  # MemTracker's own noise
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_bert_step_matches_memtracker_to_the_byte(meter, ckpt):
    """Eager BERT steps: no op of theirs allocates scratch on the CPU, so the allocator sees
    exactly the storages MemTracker's dispatch mode sees."""
    mem, want = bert_step_against_memtracker(meter, ckpt)
    assert mem.peak_bytes == want
    assert mem.end_bytes == mem.start_bytes


def test_budget_is_enforced_at_allocation(meter):
    blocks = make_stack()
    _, peak = expected_stack(ckpt=False)
    meter.budget_bytes = peak - 1
    x = torch.randn(B, D)
    with meter.activate():
        meter.track(blocks, x)
        with meter.step() as mem, pytest.raises(torch.OutOfMemoryError) as caught:
            stack_forward(blocks, x, ckpt=False).backward()
        assert str(caught.value).startswith("simulated device out of memory: tried to allocate ")
        assert str(caught.value).endswith(f"with a budget of {format_bytes(peak - 1)}")
        assert mem.peak_bytes <= peak - 1  # the refused allocation never happened
        assert meter.reached_bytes(caught.value) > peak - 1
        caught = None
        blocks.zero_grad(set_to_none=True)
        assert meter.current_bytes() == mem.start_bytes
        meter.budget_bytes = peak
        with meter.step() as fits:
            stack_forward(blocks, x, ckpt=False).backward()
    assert fits.peak_bytes == peak


def _compiled_step(x):
    return (x.sin() * 2 + 1).cos()


def test_out_of_memory_from_compiled_code(meter):
    """Inductor's own generated code allocates the output, and is refused at the budget."""
    compiled = torch.compile(_compiled_step, backend="inductor", fullgraph=True, dynamic=False)
    x = torch.randn(4096)
    compiled(x)  # compiles outside the meter
    with meter.activate():
        meter.track(x)
        with meter.step() as mem:
            compiled(x)
        assert mem.peak_bytes - mem.start_bytes == x.nbytes  # the output: the kernel is fused
        meter.budget_bytes = meter.current_bytes() + x.nbytes - 1
        with pytest.raises(torch.OutOfMemoryError, match="simulated device out of memory") as caught:
            compiled(x)
    # Raised inside the module inductor generated (neither torch's nor ours), in its allocation.
    frames = [Path(entry.path) for entry in caught.traceback]
    torch_dir = Path(torch.__file__).parent
    generated = [path for path in frames if not path.is_relative_to(torch_dir) and path != Path(__file__)]
    assert generated and "empty_strided_cpu" in generated[-1].read_text(), frames


def test_storages_from_before_activation(meter):
    before = torch.empty(1000)  # made while no meter was armed: counted only once tracked
    dropped_before = torch.empty(500)
    from_numpy = torch.from_numpy(np.zeros(250, dtype=np.float32))  # not our allocator's
    with meter.activate():
        start = meter.current_bytes()
        del dropped_before  # freeing it takes nothing off the count
        assert meter.current_bytes() == start
        meter.track(before, from_numpy, before)
        assert meter.current_bytes() == start + 1000 * F32 + 250 * F32
        during = torch.empty(100)
        assert meter.current_bytes() == start + 1100 * F32 + 250 * F32
        del from_numpy
        assert meter.current_bytes() == start + 1100 * F32
    del before, during  # freed after the meter is off: still taken off its count
    assert meter.current_bytes() == start


def test_storage_resize_counts_old_and_new_while_copying(meter):
    with meter.activate():
        storage = torch.empty(100).untyped_storage()
        start = meter.current_bytes()
        meter.reset_peak()
        storage.resize_(800)
        assert meter.current_bytes() == start - 400 + 800
        assert meter.peak_bytes() == start + 800  # the old 400 bytes live until copied


def test_other_threads_count_and_forked_children_do_not(meter):
    meter.budget_bytes = 10_000
    held = []
    with meter.activate():
        start = meter.current_bytes()
        thread = threading.Thread(target=lambda: held.append(torch.empty(1000)))
        thread.start()
        thread.join()
        assert meter.current_bytes() == start + 1000 * F32
        # A DataLoader worker's memory is its own: a child over the budget is not refused.
        child = subprocess.run([sys.executable, "-c", _FORK_CHILD], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr


_FORK_CHILD = """
import os, torch
from mimose_cli.memory.allocator import AllocatorMeter
meter = AllocatorMeter(budget_bytes=1000)
with meter.activate():
    pid = os.fork()
    if pid == 0:
        torch.empty(10_000)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
"""


def test_host_copies_are_not_the_devices(meter):
    with meter.activate():
        start = meter.current_bytes()
        copy = meter.host_copy(lambda: torch.empty(1000))
        assert meter.current_bytes() == start
        assert meter.host_bytes() == 1000 * F32
        del copy
        assert meter.host_bytes() == 0


def test_pressure_handler_frees_before_the_allocation(meter):
    held = [torch.empty(1000)]
    asked = []

    def relieve(need_bytes):
        asked.append(need_bytes)
        held.clear()

    with meter.activate():
        meter.track(held)
        meter.budget_bytes = meter.current_bytes() + 500 * F32
        meter.set_pressure_handler(relieve)
        try:
            kept = torch.empty(1000)
        finally:
            meter.clear_pressure_handler()
        assert asked == [500 * F32]
        assert meter.peak_bytes() <= meter.budget_bytes
        with pytest.raises(torch.OutOfMemoryError):  # cleared: fails at once
            torch.empty(1000)
    del kept


def test_one_allocator_meter_active_at_a_time(meter):
    other = AllocatorMeter()
    with meter.activate(), pytest.raises(RuntimeError, match="already active"):
        with other.activate():
            pass


def test_memory_made_before_installation_frees_through_its_own_allocator(native):
    """oneDNN frees its buffers through whichever CPU allocator is current: memory it made before
    the counting allocator was installed must go back to the allocator that made it."""
    script = """
import torch
from mimose_cli.memory.allocator import AllocatorMeter
x = torch.randn(64, 256, 256)
torch.nn.functional.gelu(x)  # oneDNN's buffers, made by c10's own allocator
meter = AllocatorMeter()
with meter.activate():
    for _ in range(3):
        torch.nn.functional.gelu(x)
print("ok")
"""
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr


@pytest.fixture
def unbuilt(monkeypatch):
    """The allocator module as in a process that has not built it yet."""
    monkeypatch.setattr(allocator, "_native", None)
    monkeypatch.setattr(allocator, "_failure", None)
    monkeypatch.setattr(allocator, "_warned", False)


def test_the_cpus_default_meter_is_the_allocator(native):
    assert build_meter("auto", budget_bytes=10**6, device=torch.device("cpu")).kind == "allocator"
    assert build_meter(budget_bytes=10**6).budget_bytes == 10**6


@pytest.mark.parametrize("kind", ["allocator", "auto"])
def test_falls_back_to_the_dispatch_meter_in_one_line(unbuilt, monkeypatch, kind):
    def failed_build(*args, **kwargs):
        raise RuntimeError("Error building extension 'mimose_counting_allocator'\nmore lines")

    monkeypatch.setattr(cpp_extension, "load", failed_build)
    with pytest.warns(UserWarning) as caught:
        meter = build_meter(kind, budget_bytes=10**6)
    assert meter.kind == "simulated" and meter.budget_bytes == 10**6
    (line,) = [str(w.message) for w in caught]
    assert "\n" not in line
    assert "did not build" in line and "Error building extension" in line
    assert line.endswith("using the dispatch-mode meter, under which compiled code runs eagerly")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build_meter(kind).kind == "simulated"  # said once per process


def test_without_ninja_it_says_what_is_missing(unbuilt, monkeypatch):
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(AllocatorUnavailable, match="^no ninja to build the allocator meter$"):
        load_allocator()


def test_a_build_killed_half_way_does_not_stall_the_next(native):
    """torch leaves its lock file in the build directory when a build is killed (Ctrl-C during
    the first run), and every later build would wait on it forever: it is removed under our lock."""
    (allocator.build_directory() / "lock").touch()
    script = "from mimose_cli.memory.allocator import load_allocator; load_allocator(); print('ok')"
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr


def test_the_ninja_package_is_found_when_path_does_not_reach_it(monkeypatch):
    """pip puts the ninja package's binary beside the interpreter, which PATH may not reach (a
    virtual environment run without activating it): the build looks there too, and only then."""
    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert not cpp_extension.is_ninja_available()
    with allocator._ninja_on_path():
        assert cpp_extension.is_ninja_available()
        assert shutil.which("ninja") == str(Path(ninja.BIN_DIR) / "ninja")
    assert os.environ["PATH"] == "/nonexistent"


def test_an_unwritable_cache_falls_back_in_one_line(unbuilt, monkeypatch, tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(not_a_folder))
    with pytest.warns(UserWarning, match=f"^the allocator meter did not build in {not_a_folder}/.*: "
                                         "using the dispatch-mode meter"):
        assert build_meter("allocator").kind == "simulated"
