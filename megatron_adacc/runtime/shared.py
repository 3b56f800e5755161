"""One storage for values every layer saves anew: RoPE's cos and sin (the shared site
`rope_cos_sin`, like megatron's cached causal mask).

megatron-core 0.16.1's `apply_rotary_pos_emb` computes `(cos(freqs) * mscale).to(dtype)` and
the same of sin in every call, Q's and K's in every layer, and the two products with Q and K
save them, cos first: each layer keeps four new [s, 1, 1, rotary dim] storages of two values.
(Its precomputed `rotary_pos_cos`/`rotary_pos_sin` reach attention only at inference:
`Attention.forward` asserts they are None on the training path.) The forward stays
megatron's; what backward keeps is the runtime's to choose. A `RopeWindow` packs each such
save as the first live tensor made the same way, and the call's own copy dies with forward's
temporaries: backward reads the identical bits, so gradients are unchanged.

"Made the same way" is known without reading the values (comparing them would synchronise
the host with the device at every save): the same frequency tensor (megatron's
`RotaryEmbedding` caches it per length, so every layer and micro-batch of one length is
given the same tensor), the same of cos and sin (each call saves cos, then sin), the same
layer config (mscale) and the same dtype and layout. Under the debug switch
`SharedValues.check_bits` (off: comparing reads the data on the host, a sync in every step;
the tests turn it on where they hold megatron to that order) the bits are compared too, and
a difference is an error.

What is shared lives exactly as long as a saved slot holds it: `SharedValues` keeps weak
references only, so once every graph that saved a value is freed (the step's backward, or a
forward without one) the value is gone and the next step starts anew. Another sequence length,
rotary base or rotary fraction is another frequency tensor: never shared.
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
        """The live tensor made from ``source`` as ``key`` says, or ``tensor`` itself (now
        remembered) if there is none. Only a tensor that is its whole storage is shared:
        handing out a view would pin its base, and dropping one would free nothing."""
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
    """Shares RoPE's cos and sin in one attention module: a saved-tensor hook open from
    linear_qkv's return to the core attention's call, where megatron applies RoPE and nothing
    else is saved by the attention module itself (attribution's `self_attention` role). It
    hands each RoPE save to the hook around it (the Adacc layer's, the ruler's or none) as its
    shared tensor, so attribution and the ruler see one storage."""

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
