"""Planners by name, the one table of them: ``PLANNERS`` maps each name to its policy class
(``planners.contract.Policy``) and the options a recipe may give it (``planners.options``).

Importable without torch, so that a recipe's planner and its options are checked before anything
is built: the shipped policies are named by where they live and imported when first asked for.
``PLANNERS["mine"] = MyPolicy`` adds a planner without options; ``PLANNERS.register("mine",
MyPolicy, MyOptions)`` one with them. ``planners.base.build_planner`` builds one by name.
"""

import importlib
from collections.abc import MutableMapping
from dataclasses import dataclass

from mimose_cli.planners.options import (
    EveryNOptions,
    FullOptions,
    MimoseOptions,
    NoneOptions,
    NoOptions,
    OracleOptions,
    SublinearOptions,
)


@dataclass
class Registered:
    """One planner: its policy (the class, or ``"module:Class"`` under ``mimose_cli.planners``
    until first asked for) and its options class."""

    policy: object
    options: type = NoOptions

    def load(self) -> type:
        if isinstance(self.policy, str):
            module, _, name = self.policy.partition(":")
            self.policy = getattr(importlib.import_module(f"mimose_cli.planners.{module}"), name)
        return self.policy

    def names(self, policy: type) -> bool:
        """Whether this entry is ``policy`` (without importing an entry not loaded yet)."""
        if isinstance(self.policy, str):
            return f"mimose_cli.planners.{self.policy}" == f"{policy.__module__}:{policy.__qualname__}"
        return self.policy is policy


class Registry(MutableMapping):
    """Planner name -> policy class; ``options(name)`` its options class."""

    def __init__(self, entries: dict):
        self._entries = dict(entries)

    def __getitem__(self, name: str) -> type:
        return self._entries[name].load()

    def __setitem__(self, name: str, policy: type) -> None:
        self.register(name, policy)

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name) -> bool:
        return name in self._entries

    def register(self, name: str, policy: type, options: type = NoOptions) -> None:
        """Add (or replace) planner ``name``: ``policy`` with ``options`` (a ``planners.options``-style
        dataclass, the only place its ranges and rules live)."""
        self._entries[name] = Registered(policy, options)

    def options(self, name: str) -> type:
        """The options class of planner ``name``."""
        return self._entries[name].options

    def options_of(self, policy: type) -> type:
        """The options class ``policy`` was registered with, or the nearest registered class it
        derives from (a subclass of ``MimosePolicy`` takes Mimose's options); ``NoOptions`` where
        none was."""
        for cls in policy.__mro__:
            found = next((entry.options for entry in self._entries.values() if entry.names(cls)), None)
            if found is not None:
                return found
        return NoOptions


PLANNERS = Registry({
    "mimose": Registered("mimose.policy:MimosePolicy", MimoseOptions),
    "none": Registered("baselines.uniform:NoCheckpointingPolicy", NoneOptions),
    "full": Registered("baselines.uniform:FullCheckpointingPolicy", FullOptions),
    "sublinear": Registered("baselines.sublinear:SublinearPolicy", SublinearOptions),
    "dtr": Registered("baselines.dtr:DTRPolicy"),
    "oracle": Registered("baselines.oracle:OraclePolicy", OracleOptions),
    "hf-every-n": Registered("baselines.every_n:EveryNPolicy", EveryNOptions),
    "offload": Registered("baselines.full_offload:FullOffloadPolicy"),
})
