"""Planning a model sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``): what is refused,
and how every rank's planner runs the same collectives.

Each forward and backward of a sharded model all-gathers and reduce-scatters parameters, so
every rank must run exactly as many of them, in the same order, as every other: a probe step one
rank runs and another does not leaves the first waiting forever. The plans themselves change no
collective (a checkpointed block recomputes inside its own backward, after FSDP gathered its
parameters), so each rank plans its own batch; only the steps a planner runs for itself (probes,
measurements) and the decisions that choose them must agree. ``Lockstep`` makes them: every probe
step is announced first (``ticket``) and runs only where every rank announced the same; a rank
done probing answers the others until all are (``session``), so a disagreement becomes an error
on every rank (``ProbesDiverged``), never a hang.
"""

import contextlib
import zlib

import torch
import torch.distributed as dist

from mimose_cli.torch_private import without_dispatch_modes

_FSDP1 = "FullyShardedDataParallel"
_FSDP2 = "FSDPModule"
_END = 0  # the kind of exchange of a rank done probing; a probe step's ticket is positive
_SPREAD = 2**31 - 1  # an exchange of figures (``spread``, ``any``)
_POISON = -1  # the kind a rank that saw the ranks disagree sends: no rank's matches it


class ProbesDiverged(ValueError):
    """The ranks' planners asked for different probe steps (or one asked and another did not):
    the step was run on no rank. Raised on every rank at once."""


def sharded_units(model) -> list:
    """The modules of ``model`` that ``fully_shard`` made FSDP units, outermost first."""
    return [m for m in model.modules() if any(c.__name__ == _FSDP2 for c in type(m).__mro__)]


def largest_gathered_bytes(model) -> int:
    """The bytes of the largest FSDP unit's parameters, unsharded (what one all-gather or
    reduce-scatter of it holds; in their stored dtype, at least a mixed-precision gather's)."""
    taken, largest = set(), 0
    for unit in reversed(sharded_units(model)):  # innermost first: a unit owns what no unit inside it does
        owned = [p for p in unit.parameters() if id(p) not in taken]
        taken.update(map(id, owned))
        largest = max(largest, sum(p.numel() * p.element_size() for p in owned))
    return largest


def check_sharding(model, blocks: list, policy_name: str) -> bool:
    """ValueError in one line for what cannot be planned under FSDP: FSDP1, DTR (it evicts one
    tensor at a time, which FSDP's buffers are not), an FSDP unit inside a block (its checkpoint
    would all-gather that unit again in the recompute). Returns whether the model is FSDP2-sharded."""
    names = {cls.__name__ for module in model.modules() for cls in type(module).__mro__}
    if _FSDP1 in names:
        raise ValueError("mimose plans FSDP2 models, not FullyShardedDataParallel (FSDP1): shard with "
                         "torch.distributed.fsdp.fully_shard on each block, then on the root")
    units = {id(m) for m in sharded_units(model)}
    if not units:
        return False
    if policy_name == "dtr":
        raise ValueError("planner 'dtr' cannot plan an FSDP-sharded model (it evicts tensors one by one, "
                         "FSDP gathers and frees each block's parameters itself): use mimose, sublinear or hf-every-n")
    for name, block in blocks:
        inner = [n for n, m in block.named_modules() if n and id(m) in units]
        if inner:
            raise ValueError(f"block {name} holds FSDP units inside it ({', '.join(inner[:3])}): a checkpointed block "
                             f"would all-gather them again in its recompute; fully_shard the block itself "
                             f"(fully_shard(model.{name})), not its parts")
    return True


def _group_device():
    """The device a collective of the default group takes its tensors on (NCCL: the GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Lockstep:
    """The agreement between the ranks' planners over the default process group (the one
    ``fully_shard``'s mesh spans). ``session`` around whatever may run probe steps (a policy's
    ``prepare`` and ``decide``); ``ticket`` before each of them; ``any`` for a decision."""

    def __init__(self):
        if not dist.is_initialized():
            raise ValueError("the model is FSDP2-sharded but torch.distributed is not initialized: plan it in the "
                             "processes that sharded it (torchrun), after init_process_group")
        self.rank = dist.get_rank()
        self._open = False
        self._diverged = False

    def spread(self, value: int) -> tuple:
        """``(smallest, largest)`` of every rank's ``value``; ``ProbesDiverged`` where another
        rank is not at an exchange of values too."""
        return self._exchange(_SPREAD, value, "an exchange of figures")

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (as ``spread``)."""
        return self._exchange(_SPREAD, int(bool(flag)), "an agreement")[1] == 1

    def ticket(self, label: str) -> None:
        """Announce a probe step described by ``label`` (which blocks run); ``ProbesDiverged``
        on every rank unless every rank announced the same, in a session."""
        assert self._open, "a probe step under FSDP outside Lockstep.session"
        self._exchange(1 + zlib.crc32(label.encode()) % (2**31 - 3), 0, f"a probe step ({label})")

    def _exchange(self, kind: int, value: int, what: str) -> tuple:
        """``(smallest, largest)`` of every rank's ``value`` in one all-reduce, which also checks
        that every rank is at an exchange of the same ``kind``: else (or once a rank saw the ranks
        disagree) ``ProbesDiverged`` on every rank of it."""
        kind = _POISON if self._diverged else kind
        with without_dispatch_modes():  # the planner's own bytes and ops: no meter or probe sees them
            both = torch.tensor([kind, -kind, value, -value], dtype=torch.int64, device=_group_device())
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            both = both.tolist()
        if both[0] != -both[1] or kind == _POISON:
            self._diverged = True
            raise ProbesDiverged(f"rank {self.rank}'s planner asked for {what} that another rank did not: the "
                                 "ranks' probe steps would no longer match")
        return -both[3], both[2]

    @contextlib.contextmanager
    def session(self):
        """Around what may run probe steps, entered by every rank at the same point. On leaving
        (also by an error), the rank answers the others' tickets until every rank has left, so
        no rank waits on one that stopped probing."""
        if self._open:  # nested (prepare inside a step's decide): the outer one ends it
            yield self
            return
        self._open, self._diverged = True, False
        try:
            yield self
        finally:
            self._open = False
            diverged = self._diverged
            while True:  # another rank still probing meets this end at its next exchange
                self._diverged = False  # this rank's end is sent as such until every rank's is
                try:
                    self._exchange(_END, 0, "the end of its probe steps")
                    break
                except ProbesDiverged:
                    diverged = True
            self._diverged = diverged

    @property
    def diverged(self) -> bool:
        """Whether the last session's ranks disagreed on a probe step."""
        return self._diverged


def lockstep_for(model, blocks: list, policy_name: str):
    """A ``Lockstep`` for an FSDP2-sharded model (after ``check_sharding``), else None."""
    return Lockstep() if check_sharding(model, blocks, policy_name) else None
