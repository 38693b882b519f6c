"""The simulated device at the allocator: c10's CPU allocator wrapped to count every allocation.

The dispatch-mode meter (``simulated``) sees ATen ops' outputs from Python, op by op: it costs
1.1-1.3x on realistic steps and sees nothing of compiled code, which Dynamo turns off under it.
This meter sits where a GPU's caching allocator does: ``counting_allocator.cpp`` replaces the
process's CPU allocator (``c10::SetCPUAllocator``, once per process) by one that charges each
allocation to the meter armed at that moment and raises ``torch.OutOfMemoryError`` (the
dispatch meter's message) *before* handing out memory past the budget, as a GPU would.
Eager ops, compiled code and kernels' scratch are all counted, with no per-op cost measurable
above noise (``benchmarks/meter_overhead.py``: 1.00-1.02x a step with no meter).

Built at first use with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; about 8 s),
cached in ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/mimose/torch_extensions``) per torch
and Python version, under a file lock so that processes starting together build it once; a
build killed half-way leaves torch's lock file behind, which would stall every later build, so
it is removed under ours. Where it cannot be built, ``build_meter`` falls back to the dispatch
meter, with one line saying so.

What differs from the dispatch meter, by design (docs: "Memory on a GPU and on the CPU"):
  - scratch memory a kernel allocates and frees inside an op is counted (a GPU sees it too), so
    a step's peak can be higher by an op's workspace;
  - a storage resized in place holds its old and new memory while it is copied, as on a GPU;
  - the budget is checked before the allocation, so the pressure handler (DTR) frees before the
    memory is taken; it runs only on the thread that armed the meter (an intra-op worker waiting
    for the GIL could deadlock), elsewhere the allocation fails at once;
  - ``torch.get_rng_state()`` (what checkpoint saves per block) is host memory, as on a GPU;
  - allocations of every thread of this process count while the meter is active (as a GPU's
    allocator sees every stream); a forked child (a DataLoader worker) is never charged;
  - pinned memory comes from the accelerator's host allocator, not c10's CPU allocator, and is
    never counted (host memory, as on a GPU; a CPU-only torch has none).
Storages made before the allocator was installed, or by another allocator (``torch.from_numpy``,
memory-mapped checkpoints), are counted when passed to ``track()``, as the dispatch meter does;
so are storages the allocator made while no meter was active.
"""

import contextlib
import fcntl
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch
from torch.utils import cpp_extension

try:
    import ninja  # the PyPI package the project depends on; without it the system's is looked for
except ImportError:
    ninja = None

from mimose_cli.memory.ledger import StorageLedger
from mimose_cli.memory.meter import Meter
from mimose_cli.memory.simulated import SimulatedMeter, _out_of_memory
from mimose_cli.torch_private import get_untyped_storages

_SOURCE = Path(__file__).with_name("counting_allocator.cpp")
_NAME = "mimose_counting_allocator"
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class AllocatorUnavailable(RuntimeError):
    """The counting allocator cannot be built or installed here; the message says why."""


_native = None  # the built extension, once loaded
_failure: AllocatorUnavailable | None = None  # why it could not be, once tried
_warned = False  # the fallback's line was shown


def build_directory() -> Path:
    """Where the extension is built and cached: per torch and Python version (a build for one
    torch does not load into another)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "mimose" / "torch_extensions"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}".replace("+", "_")
    return Path(root) / f"{_NAME}_{tag}"


def missing_tools() -> str:
    """What the build needs and this machine lacks ("" when nothing)."""
    compiler = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension compiles with
    missing = [f"a C++ compiler ({compiler})"] if shutil.which(compiler) is None else []
    if not cpp_extension.is_ninja_available():
        missing.append("ninja")
    return " and ".join(missing)


def load_allocator():
    """The extension, built at first use and installed as this process's CPU allocator; raises
    ``AllocatorUnavailable`` with the reason where it cannot be (and again at each call, without
    trying twice)."""
    global _native, _failure
    if _native is not None:
        return _native
    if _failure is not None:
        raise _failure
    try:
        _native = _build_and_install()
    except AllocatorUnavailable as error:
        _failure = error
        raise
    return _native


def _build_and_install():
    with _ninja_on_path():
        return _build_and_install_with_ninja_on_path()


@contextlib.contextmanager
def _ninja_on_path():
    """PATH with the ninja package's folder added while building: pip puts its ``ninja`` beside
    the interpreter, which PATH may not reach (a virtual environment run without activating it),
    and torch looks ninja up on PATH."""
    if ninja is None:
        yield
        return
    path = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join(p for p in (path, ninja.BIN_DIR) if p)
    try:
        yield
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path


def _build_and_install_with_ninja_on_path():
    missing = missing_tools()
    if missing:
        raise AllocatorUnavailable(f"no {missing} to build the allocator meter")
    directory = build_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with _exclusive(directory.parent / f"{directory.name}.lock"):
            (directory / "lock").unlink(missing_ok=True)  # torch's, left by a killed build: stale under ours
            module = cpp_extension.load(_NAME, [str(_SOURCE)], build_directory=str(directory),
                                        extra_cflags=["-O2"], verbose=False)
    except (RuntimeError, OSError, ImportError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise AllocatorUnavailable(f"the allocator meter did not build in {directory}: {first}") from error
    try:
        module.install()
    except RuntimeError as error:
        raise AllocatorUnavailable(str(error).splitlines()[0]) from error
    return module


@contextlib.contextmanager
def _exclusive(path: Path):
    """Hold an exclusive lock on ``path`` (released by the kernel if the process dies)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def allocator_or_fallback(budget_bytes: int | None):
    """An ``AllocatorMeter``, or where it cannot be built the dispatch meter, saying so once."""
    global _warned
    try:
        return AllocatorMeter(budget_bytes)
    except AllocatorUnavailable as error:
        if not _warned:
            _warned = True
            warnings.warn(f"{error}: using the dispatch-mode meter, under which compiled code runs eagerly",
                          stacklevel=3)
        return SimulatedMeter(budget_bytes)


class _ForeignLedger(StorageLedger):
    """Storages the counting allocator did not make, passed to ``track()``: counted with weak
    references as the dispatch meter counts them, their bytes mirrored into the counter so that
    its live bytes, peak and budget include them."""

    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def add(self, storage, counted: bool = True) -> int:
        before = self.live
        added = super().add(storage, counted)
        self.counter.add_external(self.live - before)
        return added

    def _free(self, ref) -> None:
        before = self.live
        super()._free(ref)
        self.counter.add_external(self.live - before)


class AllocatorMeter(Meter):
    """An exact simulated device at the allocator: live bytes, their peak, a hard budget."""

    kind = "allocator"
    supports_pressure_handler = True

    def __init__(self, budget_bytes: int | None = None):
        super().__init__()
        self._native = load_allocator()
        self._counter = self._native.Counter()
        self._foreign = _ForeignLedger(self._counter)
        self._handler = None
        self.budget_bytes = budget_bytes

    @property
    def budget_bytes(self) -> int | None:
        """The simulated device's size; None is unlimited. May be changed between steps."""
        budget = self._counter.budget
        return None if budget < 0 else budget

    @budget_bytes.setter
    def budget_bytes(self, value: int | None) -> None:
        self._counter.budget = -1 if value is None else int(value)

    @contextlib.contextmanager
    def activate(self):
        """Charge every allocation of this process to this meter (and enforce the budget) inside
        this context; one allocator meter is active at a time."""
        self._native.arm(self._counter)
        try:
            with _rng_state_on_host(self._native):
                yield self
        finally:
            self._native.disarm(self._counter)

    @contextlib.contextmanager
    def unlimited(self):
        budget, self.budget_bytes = self.budget_bytes, None
        try:
            yield self
        finally:
            self.budget_bytes = budget

    def host_copy(self, make):
        """``make()``'s tensor counted as host memory only: what this thread allocates while it
        is made is charged to no meter (host and device are one memory here)."""
        self._native.set_host_side(True)
        try:
            return super().host_copy(make)
        finally:
            self._native.set_host_side(False)

    def track(self, *objects) -> None:
        """Count storages that already exist (made before the meter was active, or by another
        allocator); each counted once however often seen. Accepts what the dispatch meter's
        ``track`` does; raises out-of-memory if the count then exceeds the budget."""
        added = sum(self._count(storage) for storage in _storages(objects))
        budget = self.budget_bytes
        if budget is not None and self._counter.live > budget:
            raise _out_of_memory(added, self._counter.live, budget)

    def _count(self, storage) -> int:
        if storage.nbytes() == 0:
            return 0
        added = self._counter.adopt(storage)
        return added if added >= 0 else self._foreign.add(storage)

    def set_pressure_handler(self, handler) -> None:
        """Call ``handler(need_bytes)`` before failing an allocation (before it is made, as a GPU
        allocator would): see the module docstring."""
        if self._handler is not None:
            raise RuntimeError("this allocator meter has a pressure handler already; clear it first")
        self._handler = handler
        self._counter.set_handler(handler)

    def clear_pressure_handler(self) -> None:
        self._handler = None
        self._counter.set_handler(None)

    def current_bytes(self) -> int:
        return self._counter.live

    def peak_bytes(self) -> int:
        return self._counter.peak

    def reset_peak(self) -> None:
        self._counter.reset_peak()
        self.host.reset_peak()

    def reached_bytes(self, error: BaseException) -> int:
        """What the step tried to hold when it ran out of memory: the refused allocation's live
        bytes (the peak stops below the budget)."""
        return max(super().reached_bytes(error), self._counter.refused)


@contextlib.contextmanager
def _rng_state_on_host(native):
    """Make ``torch.get_rng_state()``'s tensor host memory: non-reentrant checkpoint saves the CPU
    generator's state (5,056 bytes) per checkpointed block, which on a GPU lies in host memory and
    never counts against the device (the dispatch meter does not see it made either)."""
    original = torch.get_rng_state

    def get_rng_state():
        native.set_host_side(True)
        try:
            return original()
        finally:
            native.set_host_side(False)

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


def _storages(objects):
    """The storages of modules (parameters, buffers, grads), optimizers (state), tensors (and
    their grads) and dicts/lists/tuples of these, as the dispatch meter's ``track`` walks them."""
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            yield from _storages([*obj.parameters(), *obj.buffers()])
        elif isinstance(obj, torch.optim.Optimizer):
            yield from _storages(list(obj.state.values()))
        elif isinstance(obj, torch.Tensor):
            yield from _tensor_storages(obj)
        elif isinstance(obj, dict):
            yield from _storages(list(obj.values()))
        elif isinstance(obj, (list, tuple)):
            yield from _storages(obj)


def _tensor_storages(tensor):
    if tensor.layout is torch.strided and not tensor.is_meta:
        if type(tensor) in _PLAIN_TENSORS:
            yield tensor.untyped_storage()
        else:  # a subclass (DTensor): the storages it wraps, never a fake tensor's meta ones
            yield from (st for st in get_untyped_storages(tensor) if st.device.type != "meta")
    grad = tensor.grad if tensor.is_leaf else None
    if grad is not None:
        yield from _tensor_storages(grad)
