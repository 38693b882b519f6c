"""Bytes of activations held for backward, from autograd's saved-tensor hooks."""

import torch
from torch.utils.weak import WeakIdKeyDictionary

from mimose_cli.torch_private import tree_leaves


def storage_ids(tree) -> set:
    """``id`` of the untyped storage of every tensor in a (nested) structure: the key this
    package counts storages by (alive storages have distinct ids)."""
    return {id(t.untyped_storage()) for t in tree_leaves(tree)
            if isinstance(t, torch.Tensor) and t.layout is torch.strided}


def storage_bytes(tensors, exclude_ids=frozenset()) -> int:
    """Bytes of the unique storages of ``tensors``, those in ``exclude_ids`` left out: what
    dropping these tensors frees when nothing else holds them."""
    seen = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if id(storage) not in exclude_ids:
            seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s trainable parameters (their gradients take as much)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


class SavedBytesCounter:
    """Counts the unique storage bytes autograd saves for backward inside ``with counter:``.

    Usage::

        counter = SavedBytesCounter(exclude=model.parameters())
        with counter:
            loss = model(**batch).loss
        counter.bytes  # activation bytes this forward holds for backward

    Each storage is counted once, so views of one tensor (and a tensor saved by several
    ops) count once; storages of the ``exclude`` tensors (parameters, which live anyway) are
    not counted. Input tensors saved by the first layers (e.g. ``input_ids`` saved by an
    embedding) are counted: they are held for backward too.

    Tensors saved inside a non-reentrant ``torch.utils.checkpoint`` region do not reach
    this counter: checkpoint's own inner hooks take them and drop them until backward
    recomputes them, so they are not held, and not counting them is correct. The counter
    works the same on every device and is cheap: one dictionary look-up per saved tensor.
    """

    def __init__(self, exclude=(), keep: bool = True, pin: bool = False):
        # Kept as tensors, not storage ids: ids are read on __enter__, after any .to(device);
        # ``pin`` reads them once, now (a counter entered for every block of one step).
        self._exclude = list(exclude)
        # keep=False: a forward that is never backwarded (the profiler's): autograd is handed
        # nothing, and the counter holds what was saved until ``reset()`` so that the memory
        # behaves as a block's does until it ends.
        self._keep = keep
        self._held: list = []
        self._excluded_ids: set[int] = storage_ids(self._exclude) if pin else set()
        self._pinned = pin
        self._seen = WeakIdKeyDictionary()
        self._hooks = None
        self.bytes = 0
        self.storages = 0
        """How many storages ``bytes`` counts."""

    def reset(self) -> None:
        """Forget what was counted, to count the next step or block from zero."""
        self._seen = WeakIdKeyDictionary()
        self._held = []
        self.bytes = 0
        self.storages = 0

    def live_bytes(self) -> int:
        """Bytes of the storages counted that are still alive (held by something other than
        the graph that saved them, once that graph is gone)."""
        return sum(storage.nbytes() for storage in list(self._seen.keys()))

    def __enter__(self) -> "SavedBytesCounter":
        if not self._pinned:
            self._excluded_ids = storage_ids(self._exclude)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack if self._keep else _never_unpacked)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._hooks.__exit__(*exc_info)
        self._hooks = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.layout is not torch.strided:
            return tensor
        storage = tensor.untyped_storage()
        # Keyed by the storage object, weakly: a freed storage's id cannot alias a new one.
        if id(storage) not in self._excluded_ids and storage not in self._seen:
            self._seen[storage] = True
            self.bytes += storage.nbytes()
            self.storages += 1
        if not self._keep:
            self._held.append(tensor)
            return None
        # A detached alias, not the tensor: an op that saves its own output would otherwise make
        # a cycle through autograd's C++ graph (tensor -> grad_fn -> saved tensor) that only
        # backward breaks; a forward that fails (out of memory) would leave its activations
        # live for good. The alias keeps the same storage, so the bytes held are the same.
        return tensor.detach()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _never_unpacked(_):
    raise RuntimeError("a forward counted with keep=False is never backwarded")
