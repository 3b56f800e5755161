"""The byte ruler: activation bytes kept alive for backward, read from the live objects.

One ruler measures every way of running the model, so methods compare fairly:

- Adacc layers with decisions report what their pack hook keeps: a retained tensor's storage, a
  payload's ``nbytes``, nothing for a recompute handle. In backward they report the transient values
  they decode or rebuild.
- An accounting-only saved-tensor hook around the whole step sees everything else: stock megatron
  layers, Adacc layers without decisions, megatron's own checkpoint functions, embedding, final norm
  and loss. Hooks nest and the innermost wins, so it never sees, nor disturbs, an Adacc layer's
  saves.

Each storage is counted once, under the (layer, site) that saved it first. It leaves the count when
it is freed: a weakref callback on the UntypedStorage, whose Python object lives exactly as long as
the storage. The peak is the largest live total during the step.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from megatron_adacc.runtime.attribution import SiteAttributor
from megatron_adacc.runtime.storage import detached, is_parameter

NON_LAYER = -1  # the layer index of saves outside every transformer layer
UNATTRIBUTED = "other"
TRANSIENT = (NON_LAYER, "transient")  # the label of decoded and rebuilt values

_active: list["ActivationRuler"] = []


def active_ruler() -> "ActivationRuler | None":
    return _active[-1] if _active else None


@dataclass
class ActivationReport:
    after_forward_bytes: int  # kept alive when forward finished (max over micro-batches)
    peak_bytes: int  # largest live total during the step, transients of backward included
    by_site: dict[tuple[int, str], int] = field(default_factory=dict)  # after forward
    # the most bytes of decoded and rebuilt values alive at once (one layer's backward: a
    # layer frees all of them before the next one backprops)
    transient_peak_bytes: int = 0

    def layer_bytes(self, layer: int) -> int:
        return sum(b for (lay, _), b in self.by_site.items() if lay == layer)

    def to_dict(self) -> dict:
        per_layer: dict[str, dict[str, int]] = defaultdict(dict)
        for (layer, site), nbytes in sorted(self.by_site.items()):
            per_layer["non_layer" if layer == NON_LAYER else str(layer)][site] = nbytes
        return {
            "after_forward_bytes": self.after_forward_bytes,
            "peak_bytes": self.peak_bytes,
            "transient_peak_bytes": self.transient_peak_bytes,
            "by_layer_site": dict(per_layer),
        }


class ActivationRuler:
    """Context manager around forward (and backward, for the peak) of one training step.

        with ActivationRuler(model) as ruler:
            loss = forward(); loss.backward()
        report = ruler.report()

    The forwards end when a backward first reads a saved tensor after them. Adacc layers report
    their reads; the ruler's hook sees its own. ``forward_done()`` marks the end explicitly, for a
    forward with no backward.
    """

    def __init__(self, model: torch.nn.Module | None = None, strict: bool = False):
        self._model = model
        self._strict = strict
        self._live: dict[int, tuple[weakref.ref, int, tuple[int, str]]] = {}
        self._by_site: dict[tuple[int, str], int] = defaultdict(int)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.transient_bytes = 0  # live decoded and rebuilt values
        self.transient_peak_bytes = 0
        self.after_forward_bytes = 0
        self._after_forward_by_site: dict[tuple[int, str], int] = {}
        self._stock: list = []  # (layer index, attributor) of the running layer
        self._stock_attributors: list[SiteAttributor] = []
        self._module_hooks = []
        self._hooks = None
        self._forward_open = False  # saved something since the last forward end

    # --- scope ---------------------------------------------------------------------------
    def __enter__(self) -> "ActivationRuler":
        if self._model is not None:
            self._watch_stock_layers(self._model)
        _active.append(self)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        _active.remove(self)
        for hook in self._module_hooks:
            hook.remove()
        self._module_hooks.clear()
        for attributor in self._stock_attributors:
            attributor.detach()
        self._stock_attributors.clear()

    def _watch_stock_layers(self, model) -> None:
        from megatron.core.transformer.transformer_layer import TransformerLayer

        # Every layer, Adacc ones included: an Adacc layer without decisions runs as the
        # stock layer does, hook-free, so its saves reach this outer hook; one with
        # decisions packs inside its own hooks (innermost wins) and this attributor idles.
        for module in model.modules():
            if isinstance(module, TransformerLayer):
                attributor = SiteAttributor(
                    module, strict=self._strict or getattr(module, "strict", False))
                attributor.attach()
                self._stock_attributors.append(attributor)
                self._module_hooks.append(
                    module.register_forward_pre_hook(self._stock_enter(module, attributor)))
                self._module_hooks.append(
                    module.register_forward_hook(self._stock_exit, always_call=True))

    def _stock_enter(self, layer, attributor):
        def enter(module, args):
            attributor.begin()
            self._stock.append((layer.layer_number - 1, attributor))
        return enter

    def _stock_exit(self, module, args, output):
        if self._stock:
            self._stock.pop()[1].end()

    # --- what is kept --------------------------------------------------------------------
    def _pack(self, tensor):
        if is_parameter(tensor):
            return tensor
        if self._stock:
            layer, attributor = self._stock[-1]
            site = attributor.site_of(tensor) or UNATTRIBUTED
        else:
            layer, site = NON_LAYER, UNATTRIBUTED
        self.keep_tensor(layer, site, tensor)
        return detached(tensor)

    def keep_tensor(self, layer: int, site: str | None, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage (once) while it is alive."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self._live:
            self._add(key, storage, storage.nbytes(), (layer, site or UNATTRIBUTED))

    def keep_object(self, layer: int, site: str, obj, nbytes: int) -> None:
        """Count `nbytes` while `obj` (e.g. a compressed payload's holder) is alive."""
        self._add(id(obj), obj, nbytes, (layer, site))

    def transient(self, tensor: torch.Tensor) -> None:
        """A value that exists only during backward (decoded or rebuilt).

        It counts toward the peak, never toward the after-forward bytes."""
        self.keep_tensor(*TRANSIENT, tensor)

    def _add(self, key: int, obj, nbytes: int, label: tuple[int, str]) -> None:
        # Saves made while backward runs (megatron's checkpoint re-running a forward, a
        # rebuild, a decoded value) belong to backward: they must not start a forward.
        if torch._C._current_autograd_node() is None:
            self._forward_open = True
        ref = weakref.ref(obj, lambda _ref, key=key: self._drop(key))
        self._live[key] = (ref, nbytes, label)
        self._by_site[label] += nbytes
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        if label == TRANSIENT:
            self.transient_bytes += nbytes
            self.transient_peak_bytes = max(self.transient_peak_bytes, self.transient_bytes)

    def _drop(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._by_site[entry[2]] -= entry[1]
            self.live_bytes -= entry[1]
            if entry[2] == TRANSIENT:
                self.transient_bytes -= entry[1]

    def _unpack(self, saved):
        self.backward_reads()
        return saved

    def backward_reads(self) -> None:
        """A backward read a saved value, so the forwards that saved since the last read have ended.

        Under 1F1B several micro-batches' forwards run before the first backward. That backward
        may first read an Adacc layer's values, none that this ruler's hook saved."""
        if self._forward_open:
            self.forward_done()

    # --- readings ------------------------------------------------------------------------
    def forward_done(self) -> None:
        """Snapshot of the bytes kept for backward (the end of a forward)."""
        self._forward_open = False
        if self.live_bytes >= self.after_forward_bytes:
            self.after_forward_bytes = self.live_bytes
            self._after_forward_by_site = {k: v for k, v in self._by_site.items() if v}

    def report(self) -> ActivationReport:
        return ActivationReport(self.after_forward_bytes, self.peak_bytes,
                                dict(self._after_forward_by_site), self.transient_peak_bytes)


def measure_step(model: torch.nn.Module, loss_fn,
                 strict: bool = False) -> tuple[torch.Tensor, ActivationReport]:
    """Run `loss_fn()` (forward) and its backward under one ruler; returns (loss, report)."""
    with ActivationRuler(model, strict=strict) as ruler:
        loss = loss_fn()
        loss.backward()
    return loss, ruler.report()
