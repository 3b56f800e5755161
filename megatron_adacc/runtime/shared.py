"""One storage for values every layer saves anew: RoPE's cos and sin (shared site rope_cos_sin).

megatron-core 0.19.2's ``apply_rotary_pos_emb`` computes ``(cos(freqs) * mscale).to(dtype)`` and the
same of sin in every call, for Q and K in every layer. The two products with Q and K save them, so
each layer keeps four new [s, 1, 1, rotary dim] storages of two values. (The precomputed
``rotary_pos_cos``/``rotary_pos_sin`` reach attention only at inference.) A ``RopeWindow`` packs
each such save as the first live tensor made the same way. The call's own copy dies with forward's
temporaries; backward reads identical bits, so gradients are the same.

"Made the same way" is known without reading the values, which would sync the host at every save:
- the same frequency tensor (megatron's ``RotaryEmbedding`` caches one per length);
- the same of cos and sin (each call saves cos, then sin);
- the same layer config (mscale), dtype and layout.
The debug switch ``SharedValues.check_bits`` compares the bits too; a difference is an error. It is
off by default, since comparing is a host sync in every step.

``SharedValues`` keeps weak references only, so a shared value lives as long as a saved slot holds
it. Once every graph that saved it is freed, it is gone and the next step starts anew. Another
sequence length, rotary base or rotary fraction means another frequency tensor: never shared.
"""
from __future__ import annotations

import weakref

import torch

from megatron_adacc.runtime.attribution import is_rope_cos_sin
from megatron_adacc.runtime.storage import detached


class SharedValues:
    """The one live tensor of each value, by what made it (weak references only)."""

    def __init__(self, check_bits: bool = False):
        self._live: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}
        # Compare a shared value's bits with each new one made the same way (a host read).
        self.check_bits = check_bits

    def canonical(self, key: tuple, source: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """The live tensor made from ``source`` as ``key`` says, else ``tensor``, now remembered.

        Only a tensor that is its whole storage is shared: handing out a view would pin its base,
        and dropping one would free nothing."""
        if (tensor._base is not None or not tensor.is_contiguous()
                or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()):
            return tensor
        key = (id(source), tuple(tensor.shape), tensor.dtype, tensor.device, *key)
        entry = self._live.get(key)
        # The source itself, not a later tensor at its freed address.
        if entry is not None and entry[1]() is source:
            known = entry[0]()
            if known is not None:
                if self.check_bits and not _same_bits(known, tensor):
                    raise RuntimeError(
                        f"a RoPE save {tuple(tensor.shape)} {tensor.dtype} differs from the "
                        "one shared for it: megatron's rotation no longer saves cos, then sin, "
                        "per call")
                return known
        self._live[key] = (weakref.ref(tensor, lambda ref: self._forget(key, ref)),
                           weakref.ref(source))
        return tensor

    def _forget(self, key: tuple, ref: weakref.ref) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[0] is ref:
            del self._live[key]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bits, not values: 0.0 == -0.0, and a product with either differs.
    return torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


# One table for the process: a value is shared by every layer and every micro-batch in flight.
SHARED = SharedValues()


class RopeWindow:
    """Shares RoPE's cos and sin in one attention module: one storage for attribution and ruler.

    It is a saved-tensor hook open from linear_qkv's return to the core attention's call. There
    megatron applies RoPE, and the attention module itself saves nothing else (attribution's
    ``self_attention`` role). It hands each RoPE save, as its shared tensor, to the hook around
    it: the Adacc layer's, the ruler's or none."""

    def __init__(self, attention):
        self._config = attention.config  # mscale, and every other input of the rotation
        self._rotations: list[torch.Tensor] = []  # the frequencies of Q's call, of K's
        self._saves = 0
        self._hooks = None
        attention.register_forward_pre_hook(self._enter, with_kwargs=True)
        attention.linear_qkv.register_forward_hook(self._open)
        attention.core_attention.register_forward_pre_hook(self._close)
        # always: an exception between linear_qkv and the core attention still closes it
        attention.register_forward_hook(self._exit, always_call=True)

    @staticmethod
    def applies_to(attention) -> bool:
        # megatron's activation offloading pushes saved-tensor hooks around linear_qkv: a
        # window opened inside them would be popped by theirs.
        return (getattr(attention, "linear_qkv", None) is not None
                and not getattr(attention, "offload_qkv_linear", False))

    def _enter(self, module, args, kwargs) -> None:
        emb = kwargs.get("rotary_pos_emb")
        # self-attention rotates Q and K with one tensor, or with a (Q's, K's) pair
        pair = emb if isinstance(emb, tuple) else (emb, emb)
        self._rotations = [freqs for freqs in pair if isinstance(freqs, torch.Tensor)]
        self._saves = 0

    def _open(self, module, args, output) -> None:
        if self._hooks is not None or not self._rotations or not torch.is_grad_enabled():
            return
        # The hook this window stands inside: saved-tensor hooks nest and the innermost wins,
        # so the window passes every save on to it.
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, _identity)

        def pack(tensor):
            if is_rope_cos_sin(tensor):
                tensor = self._shared(tensor)
            return detached(tensor) if outer_pack is None else outer_pack(tensor)

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack)
        self._hooks.__enter__()

    def _shared(self, tensor: torch.Tensor) -> torch.Tensor:
        call, which = divmod(self._saves, 2)  # each call saves cos (0), then sin (1)
        self._saves += 1
        if call >= len(self._rotations):
            return tensor
        return SHARED.canonical((which, id(self._config)), self._rotations[call], tensor)

    def _close(self, module, args) -> None:
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    def _exit(self, module, args, output) -> None:
        self._close(module, args)
        self._rotations = []


def _identity(saved):
    return saved
