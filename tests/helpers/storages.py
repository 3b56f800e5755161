"""The storages ops make within a dispatch mode: how many bytes they hold, and which outlive it."""
from __future__ import annotations

import functools
import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """The storages ops return within the mode: the bytes of new ones, and which are still alive.

    A new storage counts from the op that made it until it is freed. Outputs that are an input's
    storage (in-place ops, views) are not new.

    Attributes:
        live: the bytes of the new storages alive now.
        peak: the most bytes of new storages alive at once within the mode.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._made: set[int] = set()
        self._returned: dict[int, tuple[weakref.ref, int]] = {}  # any op's output storage
        self._maker: dict[int, str] = {}    # a new storage's op and first tensor, for messages

    def _freed(self, key: int, nbytes: int, _ref) -> None:
        if key in self._made:
            self.live -= nbytes
            self._made.discard(key)
        self._returned.pop(key, None)
        self._maker.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in self._returned:
                continue
            nbytes = storage.nbytes()
            ref = weakref.ref(storage, functools.partial(self._freed, key, nbytes))
            self._returned[key] = (ref, nbytes)
            if key not in given:
                self._made.add(key)
                self._maker[key] = (f"{func.overloadpacket.__name__} -> "
                                    f"{tuple(tensor.shape)} {tensor.dtype}")
                self.live += nbytes
        self.peak = max(self.peak, self.live)
        return out

    def alive(self, made_only: bool = False) -> dict[int, int]:
        """Bytes of each storage an op returned within the mode that is still alive, by its id.

        Views count too: a storage made before the mode may live on only in what the mode kept.
        ``made_only`` keeps the new storages alone."""
        gc.collect()
        return {key: nbytes for key, (ref, nbytes) in self._returned.items()
                if ref() is not None and (key in self._made or not made_only)}

    def made_alive(self) -> list[str]:
        """Each new storage still alive: its bytes and the op that made it (for a message)."""
        return sorted(f"{nbytes} B from {self._maker.get(key, '?')}"
                      for key, nbytes in self.alive(made_only=True).items())
