"""One pack/unpack hook pair that keeps a saved activation between forward and backward.

For *retain*, pack returns the tensor itself, detached (``detached``: the cheapest handle, and
unpack is the identity). For *compress* and *recompute*, it returns a ``Handle``, which unpack
resolves. A handle points at a source that makes the value once and hands it out per view:

- ``CompressedStorage``: one codec payload per storage; Q, K and V, three views of one storage, are
  encoded once. A partial-view site (sites.Site.partial_view: SwiGLU's gate half) gets a payload per
  saved view. The payload is decoded on the first unpack, shared by the other views and released
  after the last one.
- ``LayerCall`` itself, for recomputed sites. The first unpack rebuilds every recomputed site of
  this layer call and caches them; the layer supplies ``rebuild`` (segment re-runs and operators).
  Each unpack takes its value out of the cache, so the cache is empty once backward has used them
  all. What a rebuild reads (``sources``) stays in its saved form until then.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

from megatron_adacc.common.sites import (COMPRESS, MASK_CODEC, REBUILD_SOURCES, REBUILDS,
                                         REBUILT_BY, RECOMPUTE, SITES)


class LiveStorageMap:
    """Values keyed by a storage (and more of a key) while that storage lives.

    Once forward frees a storage its id may name a new one, so an entry holds a weak reference
    and a lookup checks it is the same storage. A strong one would keep a save the plan
    compresses or recomputes alive at full size until the layer's forward ends."""

    __slots__ = ("_entries",)

    def __init__(self):
        self._entries: dict[tuple, tuple[weakref.ref, object]] = {}

    def get(self, storage: torch.UntypedStorage, *key):
        entry = self._entries.get((id(storage), *key))
        return entry[1] if entry is not None and entry[0]() is storage else None

    def put(self, storage: torch.UntypedStorage, value, *key) -> None:
        self._entries[(id(storage), *key)] = (weakref.ref(storage), value)

    def clear(self) -> None:
        self._entries.clear()


class Handle:
    """A saved tensor that is not the tensor itself: resolved by its source at unpack."""

    __slots__ = ("source", "key")

    def __init__(self, source, key):
        self.source = source
        self.key = key

    def resolve(self) -> torch.Tensor:
        return self.source.take(self.key)


def is_parameter(tensor: torch.Tensor) -> bool:
    """isinstance(tensor, Parameter), at a third of its cost for a plain tensor.

    Parameter's metaclass makes that isinstance a Python call (about 1 us), paid on every save."""
    if type(tensor) is torch.Tensor:  # what the metaclass asks of a plain tensor
        return bool(getattr(tensor, "_is_param", False))
    return isinstance(tensor, torch.nn.Parameter)


def unpack(saved):
    return saved.resolve() if type(saved) is Handle else saved


def detached(tensor: torch.Tensor) -> torch.Tensor:
    """What a pack hook keeps of a tensor it keeps whole: its storage without its autograd history.

    A view stays a view of its detached base, which a rebuild may read whole. Autograd gives the
    unpacked value its history back."""
    # The tensor itself would close a reference cycle wherever an op saves its own output:
    # the output's grad_fn holds what the hook returned, which holds the output. Backward
    # breaks the cycle, garbage collection does not, so a forward never backpropagated (the
    # rectifier's samples, a step abandoned by an error) would leak every such output.
    if not tensor.requires_grad:  # no history: nothing to close a cycle through
        return tensor
    base = tensor._base
    if base is None:
        return tensor.detach()
    return base.detach().as_strided(tensor.size(), tensor.stride(), tensor.storage_offset())


class CompressedStorage:
    """The payload of one compressed storage and the views of it that were saved."""

    __slots__ = ("codec", "payload", "views", "decoded", "ruler", "__weakref__")

    def __init__(self, codec, root: torch.Tensor, ruler):
        self.codec = codec
        self.payload = codec.encode(root)
        self.views = 0
        self.decoded = None
        self.ruler = ruler

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes

    def view_handle(self, tensor: torch.Tensor, root: torch.Tensor) -> Handle:
        self.views += 1
        # The decoded root is contiguous: a view encoded as its own root is all of it.
        geometry = None if tensor is root else (
            tensor.size(), tensor.stride(), tensor.storage_offset() - root.storage_offset())
        return Handle(self, geometry)

    def read(self, geometry) -> torch.Tensor:
        """The value of one view without handing it out (None: the whole encoded root).

        A rebuild reads its compressed starting tensor this way, and autograd still takes that
        view later."""
        if self.decoded is None:
            if self.payload is None:
                raise RuntimeError(
                    "a compressed activation was unpacked twice; backward through an Adacc "
                    "layer with retain_graph=True is not supported"
                )
            self.decoded = self.codec.decode(self.payload)
            if self.ruler is not None:
                self.ruler.transient(self.decoded)
        return self.decoded if geometry is None else self.decoded.as_strided(*geometry)

    def take(self, geometry) -> torch.Tensor:
        value = self.read(geometry)
        self.views -= 1
        if self.views == 0:  # every view has its value: free the payload and the decoded root
            self.decoded = None
            self.payload = None
        return value


def _encoding_root(tensor: torch.Tensor) -> torch.Tensor:
    """What to encode so that every saved view of ``tensor``'s storage views the decoded copy.

    Decode returns a contiguous tensor, so this is the whole base, in memory order. A dense base may
    have permuted dimensions: SDPA's output is [b, heads, s, dim] laid out as [s, b, heads, dim]. It
    is encoded as its contiguous permutation, so the saved strides hold on the decoded copy.
    Anything else non-contiguous is its own root.
    """
    base = tensor._base if tensor._base is not None else tensor
    if not base.is_contiguous():
        order = sorted(range(base.dim()), key=lambda dim: -base.stride(dim))
        in_memory_order = base.permute(order)
        base = in_memory_order if in_memory_order.is_contiguous() else tensor
    return base


class RebuildComplete(Exception):
    """Raised from the capture hook once a segment re-run has saved every site it is for.

    The rest of the layer's forward is not needed."""


class LayerCall:
    """One forward call of one Adacc layer: its pack hook, and what must outlive forward.

    That is everything backward needs: payload handles, recompute anchors, RNG states, the cache."""

    def __init__(self, layer_index: int, attributor, actions: dict, ruler,
                 rebuild: Callable[["LayerCall"], None] | None):
        self.layer_index = layer_index
        self.attributor = attributor
        self.actions = actions  # site -> (action, codec); absent: retain
        self.ruler = ruler
        self.rebuild = rebuild  # None when the plan recomputes nothing in this layer
        self._compressed = LiveStorageMap()  # by encoded root; forward only
        # The compressed partial views encoded alone: all but those an edge rebuilding
        # something here reads whole.
        read_whole = {source for edge in REBUILDS if edge.between and any(
            actions.get(product, (None,))[0] == RECOMPUTE for product in edge.products)
            for source in edge.sources}
        self.views_alone = {site for site, (action, _) in actions.items()
                            if action == COMPRESS and SITES[site].partial_view} - read_whole
        # recompute state
        self.ordinals: dict[str, int] = {}
        self.wanted: set[tuple[str, int]] = set()
        self.saved_dtypes: dict[str, torch.dtype] = {}  # of the recomputed sites
        # segment index -> the wanted saves in it that no operator rebuilds (a re-run's)
        self.segments: dict[int, set[tuple[str, int]]] = {}
        # site -> its saved form (tensor or Handle), and whether the tensor required grad
        self.sources: dict[str, object] = {}
        self.source_requires_grad: dict[str, bool] = {}
        # What the running rebuild step captures: these sites' wanted saves; a segment
        # re-run stops once `awaited` is empty.
        self.capturing: frozenset[str] = frozenset()
        self.awaited: set[tuple[str, int]] | None = None
        # The residual stream's dtype. A 16-bit model's RMSNorm saves an fp32 copy of its
        # input (a segment's start site): a rebuild reads it cast back, which is exact.
        self.residual_dtype: torch.dtype | None = None
        # Whether a recomputed site needs a segment re-run, for which forward captures the
        # RNG states (of the layer, then of the MLP segment) it drew with: only a re-run
        # draws random numbers (no operator does), and each capture copies every generator's.
        self.has_segment_reruns = any(action == RECOMPUTE and site not in REBUILT_BY
                                      for site, (action, _) in actions.items())
        self.rng_states: list = [None, None]
        self.call_args: tuple = ()
        self.call_kwargs: dict = {}
        self.cache: dict[tuple[str, int], torch.Tensor] = {}
        self.rebuilt = False
        # Every site this call saved, whatever its action: whether a plan recomputes all the
        # layer's recomputable saves is known only from what the layer saves.
        self.saved_sites: set[str | None] = set()

    # --- forward -------------------------------------------------------------------------
    def pack(self, tensor):
        if is_parameter(tensor):
            return tensor
        site = self.attributor.site_of(tensor)
        self.saved_sites.add(site)
        decision = self.actions.get(site)
        if decision is None:
            if self.ruler is not None:
                self.ruler.keep_tensor(self.layer_index, site, tensor)
            saved = detached(tensor)
        elif decision[0] == COMPRESS:
            saved = self._compress(site, tensor, decision[1])
        else:
            key = (site, self.ordinals.get(site, 0))
            self.ordinals[site] = key[1] + 1
            self.wanted.add(key)
            self.saved_dtypes[site] = tensor.dtype
            if site not in REBUILT_BY:
                self.segments.setdefault(self.attributor.segment, set()).add(key)
            saved = Handle(self, key)
        if self.rebuild is not None and site in REBUILD_SOURCES:
            self.sources[site] = saved
            self.source_requires_grad[site] = tensor.requires_grad
        return saved

    def _compress(self, site: str, tensor: torch.Tensor, codec) -> Handle:
        if getattr(codec, "name", None) == MASK_CODEC and tensor.is_floating_point() and (
                tensor.requires_grad or tensor.grad_fn is not None):
            # A mask is bool or drawn by a dropout; a computed value would be binarised.
            raise RuntimeError(f"layer {self.layer_index}: {site} is a computed "
                               f"{tensor.dtype} tensor, not a mask; the bitmask codec would "
                               "corrupt it")
        root = tensor if site in self.views_alone else _encoding_root(tensor)
        storage, key = root.untyped_storage(), (root.storage_offset(), root.shape, root.stride())
        source = self._compressed.get(storage, *key)
        if source is None:
            source = CompressedStorage(codec, root, self.ruler)
            self._compressed.put(storage, source, *key)
            if self.ruler is not None:
                self.ruler.keep_object(self.layer_index, site, source, source.nbytes)
        return source.view_handle(tensor, root)

    def forward_done(self) -> None:
        self._compressed.clear()

    def measured_unpack(self, saved):
        """The layer's unpack hook while a ruler watches: returns the value and tells the ruler."""
        self.ruler.backward_reads()
        return unpack(saved)

    # --- backward ------------------------------------------------------------------------
    def take(self, key) -> torch.Tensor:
        value = self.cache.pop(key, None)
        if value is None:
            if self.rebuilt:
                raise RuntimeError(
                    f"layer {self.layer_index}: recomputed site {key[0]} was unpacked twice; "
                    "backward through an Adacc layer with retain_graph=True is not supported"
                )
            self.rebuilt = True
            self.rebuild(self)
            value = self.cache.pop(key)
        if not self.cache:  # every rebuilt value handed out: drop what rebuilding needed
            self.sources, self.source_requires_grad = {}, {}
            self.rng_states = [None, None]
            self.call_args, self.call_kwargs = (), {}
        return value

    def capture(self, sites, awaited: set | None = None) -> None:
        """Start a rebuild step that captures the wanted saves of ``sites``.

        A segment re-run passes the keys it is for as ``awaited`` and stops once all are saved."""
        self.capturing = frozenset(sites)
        self.awaited = awaited
        self.ordinals = {}

    def keep(self, key, tensor: torch.Tensor) -> None:
        """A rebuilt value, cached until backward takes it.

        A view stays a view of its detached base, which an operator may read whole
        (sites.Rebuild.between)."""
        self.cache[key] = detached(tensor)
        if self.ruler is not None:
            self.ruler.transient(tensor)

    def capture_pack(self, tensor):
        """The pack hook while rebuilding: keep this step's wanted saves, discard the rest."""
        if is_parameter(tensor):
            return None
        site = self.attributor.site_of(tensor)
        if site in self.capturing:
            key = (site, self.ordinals.get(site, 0))
            self.ordinals[site] = key[1] + 1
            if key in self.wanted:
                self.keep(key, tensor)
                if self.awaited is not None:
                    self.awaited.discard(key)
                    if not self.awaited:
                        raise RebuildComplete
        return None
