"""One storage for values every layer saves anew: RoPE's cos and sin (the shared site
`rope_cos_sin`, like megatron's cached causal mask).

megatron-core 0.16.1's `apply_rotary_pos_emb` computes `(cos(freqs) * mscale).to(dtype)` and
the same of sin in every call, Q's and K's in every layer, and the two products with Q and K
save them: each layer keeps four new [s, 1, 1, rotary dim] storages of two values. (Its
precomputed `rotary_pos_cos`/`rotary_pos_sin` reach attention only at inference:
`Attention.forward` asserts they are None on the training path.) The forward stays
megatron's; what backward keeps is the runtime's to choose. A `RopeWindow` packs each such
save as the first live tensor holding the same bits (same shape, strides, dtype and device,
bytes equal): the call's own copy dies with forward's temporaries, and backward reads the
identical bits, so gradients are unchanged.

What is shared lives exactly as long as a saved slot holds it: `SharedValues` keeps weak
references only, so once every graph that saved a value is freed (the step's backward, or a
forward without one) the value is gone and the next step starts anew. Micro-batches in flight
at one sequence length share one storage; another length is another shape, another rotary
base or percent other bits or another width: never shared.
"""
from __future__ import annotations

import weakref

import torch

from megatron_adacc.runtime.attribution import is_rope_cos_sin


class SharedValues:
    """Live tensors by layout, each the one storage of its bits."""

    def __init__(self):
        self._by_layout: dict[tuple, list[weakref.ref]] = {}

    def canonical(self, tensor: torch.Tensor) -> torch.Tensor:
        """The live tensor with ``tensor``'s layout and bits, ``tensor`` itself (now
        remembered) if there is none. Only a tensor that is its whole storage is shared:
        handing out a view would pin its base, and dropping one would free nothing."""
        if (tensor._base is not None or not tensor.is_contiguous()
                or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()):
            return tensor
        layout = (tensor.shape, tensor.dtype, tensor.device)
        held = self._by_layout.setdefault(layout, [])
        bits = tensor.view(-1).view(torch.uint8)
        for ref in held:
            known = ref()
            # Bitwise, not numerically equal: 0.0 == -0.0, and a product with either differs.
            if known is not None and torch.equal(known.view(-1).view(torch.uint8), bits):
                return known
        held.append(weakref.ref(tensor, lambda ref, layout=layout: self._forget(layout, ref)))
        return tensor

    def _forget(self, layout, ref) -> None:
        held = self._by_layout.get(layout)
        if held is not None:
            held.remove(ref)
            if not held:
                del self._by_layout[layout]


# One table for the process: a value is shared by every layer and every micro-batch in flight.
SHARED = SharedValues()


class RopeWindow:
    """Shares RoPE's cos and sin in one attention module: a saved-tensor hook open from
    linear_qkv's return to the core attention's call, where megatron applies RoPE and nothing
    else is saved by the attention module itself (attribution's `self_attention` role). It
    hands each RoPE save to the hook around it (the Adacc layer's, the ruler's or none) as its
    shared tensor, so attribution and the ruler see one storage."""

    def __init__(self, attention):
        self._hooks = None
        attention.linear_qkv.register_forward_hook(self._open)
        attention.core_attention.register_forward_pre_hook(self._close)
        # always: an exception between the two still closes it
        attention.register_forward_hook(self._close_after, always_call=True)

    @staticmethod
    def applies_to(attention) -> bool:
        # megatron's activation offloading pushes saved-tensor hooks around linear_qkv: a
        # window opened inside them would be popped by theirs.
        return (getattr(attention, "linear_qkv", None) is not None
                and not getattr(attention, "offload_qkv_linear", False))

    def _open(self, module, args, output) -> None:
        if self._hooks is not None or not torch.is_grad_enabled():
            return
        # The hook this window stands inside: saved-tensor hooks nest and the innermost wins,
        # so the window passes every save on to it.
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, _identity)

        def pack(tensor):
            if is_rope_cos_sin(tensor):
                tensor = SHARED.canonical(tensor)
            return tensor if outer_pack is None else outer_pack(tensor)

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack)
        self._hooks.__enter__()

    def _close(self, module, args) -> None:
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    def _close_after(self, module, args, output) -> None:
        self._close(module, args)


def _identity(saved):
    return saved
