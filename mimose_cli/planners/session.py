"""A planner's meter session: the meter its steps are counted on, who turns it on, and the memory
that lives between the steps (``track``)."""

import contextlib

from mimose_cli.memory import build_meter
from mimose_cli.planners.trial import model_device
from mimose_cli.planners.usage import check_trackable


class MeterSession:
    """The meter a planner's steps count on. A meter given to the planner (the training loop's) is
    its owner's to turn on and off, kept on for the whole run; without one, a planner that
    ``build``s one gets it here (``build_meter(kind, budget, device)``, ``kind`` on the CPU only), on only inside
    ``counting``: code between the steps (the optimizer step, evaluation) runs unmetered, uncapped
    and at full speed, as if there were no planner."""

    def __init__(self, model, meter=None, build: bool = False, budget_bytes=None, kind: str = "auto"):
        self.model = model
        self.owned = meter is None and build
        if self.owned:
            device = model_device(model)
            meter = build_meter(kind if device.type == "cpu" else "auto", budget_bytes, device)
        self.meter = meter
        self.tracked: list = []  # what ``track`` was given: counted again at every step's start
        self._counting = False  # inside a step or ``run``: what exists has been counted

    def track(self, *objects) -> None:
        """Count memory that lives between the steps in every step's figures and budget: the
        optimizer (its state appears at its first ``step()``, between planner steps), tensors
        kept from step to step. Counted again at each step's start, so what appeared since is
        seen; the model and the step's batch are counted without asking. Accepts what
        ``Meter.track`` does: modules, optimizers, tensors, dicts and lists of them."""
        check_trackable(objects)
        self.tracked.extend(objects)

    @contextlib.contextmanager
    def counting(self, batch):
        """Inside a step (or ``run``'s attempts): count what exists and, for a meter built here,
        turn it on. Storages counted stay counted until freed, wherever that happens (the ledger
        holds weak references); a storage is never counted twice. Nested calls count once."""
        if self._counting or self.meter is None:
            yield
            return
        self._counting = True
        try:
            with self.meter.activate() if self.owned else contextlib.nullcontext():
                existing = [self.model, batch, *self.tracked] if self.owned else self.tracked
                if existing:
                    self.meter.track(*existing)
                yield
        finally:
            self._counting = False

    def step(self):
        """One step of a meter built here (its per-step figures); a given meter's owner keeps its own."""
        return self.meter.step() if self.owned else contextlib.nullcontext()

    def peak_bytes(self) -> int | None:
        """The peak since the last reset (None without a meter)."""
        return self.meter.peak_bytes() if self.meter is not None else None

    def close(self) -> None:
        """Forget what ``track`` was given."""
        self.tracked = []
