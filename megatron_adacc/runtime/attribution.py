"""Which site a tensor saved for backward inside one transformer layer belongs to.

Forward pre/post hooks on the layer's submodules say which one is running (its *role*). A per-call
map from storage to site says what a storage already is. So views of one storage share one site: Q,
K and V, or the softmax output reused as attention probabilities when dropout is off. Only
submodules that name a site are hooked: IdentityOp pass-throughs cannot steal attribution, and a
call costs a few dict lookups.

The rules come from what megatron-core 0.19.2's local layer saves, GPT's and Llama's (sites.py,
models/). A role names the site of what it saves, except where one role saves several kinds:

- a norm saves its input, one statistic per row, and (RMSNorm) x * rstd. In a 16-bit model torch's
  RMSNorm saves an fp32 copy of the input, made before its statistics.
- core attention saves its inputs: Q, K, V, as views of linear_qkv's output or as RoPE's rotated Q
  and K. It saves what it makes of them (grouped-query attention repeats K and V), and the
  probabilities of the softmax and the dropout.
- the attention module itself saves RoPE's cos and sin (computed, never requiring grad);
- the MLP's activation saves per its model family's part (models.MlpPart);
- the layer itself saves the bias-dropout-add masks: drawn, shaped like the residual stream.

Mask sites (bitmask codec) are named only for tensors that are masks by how they were made: drawn by
a dropout, or the attention mask by identity. The attention mask is one tensor for every layer, so
it is recognised by its storage, never by its dtype: on CUDA, dropout masks are bool too.
"""
from __future__ import annotations

import torch

from megatron_adacc.models import mlp_part
from megatron_adacc.common.sites import MLP_SEGMENT
from megatron_adacc.runtime.storage import LiveStorageMap


class UnknownSiteError(RuntimeError):
    """Strict mode: a layer saved a tensor no rule attributes to a site."""


# role -> site of every non-parameter tensor saved while that role is innermost, unless the
# storage is already known (a producer output or an earlier save in this call).
_ROLE_SITE = {
    "linear_qkv": "ln1_out",
    "linear_proj": "context",
    "linear_fc1": "ln2_out",
    # what core attention makes of Q, K and V that is no probability: grouped-query
    # attention's repeated K and V
    "core_attention": "qkv",
}
# role -> site of its output storage, for saves that reach it from elsewhere (megatron's own
# checkpoint functions save module outputs at the layer level; the matmul with V saves the
# probabilities the softmax or, with attention dropout, the dropout produced).
_PRODUCED_SITE = {"input_layernorm": "ln1_out", "linear_qkv": "qkv", "pre_mlp_layernorm": "ln2_out",
                  "softmax": "attn_probs", "attention_dropout": "attn_probs"}
# norm role -> (site of its saved input, of its statistics, of its normalised input)
_NORM_SITES = {"input_layernorm": ("layer_in", "ln1_stats", "ln1_normed"),
               "pre_mlp_layernorm": ("ln2_in", "ln2_stats", "ln2_normed")}
_LAYER_LEVEL_SITE = ("bda1_mask", "bda2_mask")  # by segment


def _layer_roles(layer) -> dict[torch.nn.Module, str]:
    from megatron_adacc.models.flash_attention import FlashDotProductAttention

    attention, mlp = layer.self_attention, layer.mlp
    core = attention.core_attention
    flash = isinstance(core, FlashDotProductAttention)
    candidates = {
        "input_layernorm": layer.input_layernorm,
        "self_attention": attention,
        "linear_qkv": getattr(attention, "linear_qkv", None),
        "flash_attention" if flash else "core_attention": core,
        "softmax": getattr(core, "scale_mask_softmax", None),
        "attention_dropout": getattr(core, "attention_dropout", None),
        "linear_proj": attention.linear_proj,
        "pre_mlp_layernorm": layer.pre_mlp_layernorm,
        "mlp": mlp,
        "linear_fc1": getattr(mlp, "linear_fc1", None),
        "linear_fc2": getattr(mlp, "linear_fc2", None),
    }
    from megatron.core.transformer.identity_op import IdentityOp

    return {
        module: role for role, module in candidates.items()
        if module is not None and not isinstance(module, IdentityOp)
    }


class SiteAttributor:
    """Names the site of each tensor a layer saves during one forward call."""

    def __init__(self, layer, strict: bool = False):
        self.strict = strict
        self.layer_number = layer.layer_number
        self._roles: list[str] = []
        self._storage_site = LiveStorageMap()  # storage -> the site this call gave it
        self._mlp = mlp_part(layer.config)
        self._norm_rows = 0  # rows the running norm normalises: one statistic each
        self._norm_statistics_saved = False  # the running norm saved its statistics already
        self._stream_shape = None  # the residual stream's shape: a bias-dropout-add mask's
        self.segment = 0
        self.active = False
        self._hooks = [(module, self._enter_hook(role), self._exit_hook(role))
                       for module, role in _layer_roles(layer).items()]
        self._handles = []

    # A submodule with any forward hook leaves nn.Module's fast call path, so the hooks are
    # only installed while someone attributes this layer's saves.
    def attach(self) -> None:
        if not self._handles:
            for module, enter, exit_ in self._hooks:
                self._handles.append(module.register_forward_pre_hook(enter))
                self._handles.append(module.register_forward_hook(exit_, always_call=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # --- one forward call ----------------------------------------------------------------
    def begin(self, segment: int = 0) -> None:
        self._roles.clear()
        self._storage_site.clear()
        self.segment = segment
        self.active = True

    def end(self) -> None:
        self._roles.clear()
        self._storage_site.clear()
        self.active = False

    # --- hooks ---------------------------------------------------------------------------
    def _remember(self, tensor, site: str) -> None:
        storage = tensor.untyped_storage()
        if self._storage_site.get(storage) is None:
            self._storage_site.put(storage, site)

    def _enter_hook(self, role):
        norm_sites = _NORM_SITES.get(role)

        def enter(module, args):
            if self.active:
                self._roles.append(role)
                if role == "pre_mlp_layernorm":
                    self.segment = MLP_SEGMENT
                if norm_sites is not None and args and isinstance(args[0], torch.Tensor):
                    self._remember(args[0], norm_sites[0])
                    self._norm_rows = args[0].numel() // args[0].shape[-1]
                    self._norm_statistics_saved = False
                    self._stream_shape = args[0].shape
                elif role in ("core_attention", "flash_attention"):
                    for tensor in args[:3]:
                        if isinstance(tensor, torch.Tensor):
                            self._remember(tensor, "qkv")
                    # The mask the model was called with: the softmax's masked fill saves it,
                    # and megatron's core-attention checkpoint saves it at the layer level.
                    mask = args[3] if len(args) > 3 else None
                    if isinstance(mask, torch.Tensor):
                        self._remember(mask, "attn_mask")

        return enter

    def _exit_hook(self, role):
        produced = _PRODUCED_SITE.get(role)

        def exit_(module, args, output):
            if self.active and self._roles and self._roles[-1] == role:
                self._roles.pop()
                if produced is not None:
                    out = output[0] if isinstance(output, (tuple, list)) else output
                    if isinstance(out, torch.Tensor):
                        self._remember(out, produced)

        return exit_

    # --- the question --------------------------------------------------------------------
    def site_of(self, tensor: torch.Tensor) -> str | None:
        """The site of a saved tensor; None if no rule names it (strict mode: UnknownSiteError)."""
        storage = tensor.untyped_storage()
        known = self._storage_site.get(storage)
        if known is not None:
            return known
        role = self._roles[-1] if self._roles else None
        if role is None:
            if not _drawn(tensor):
                site = None
            elif tensor.is_floating_point() or tensor.dtype == torch.bool:  # CPU or CUDA dropout
                site = (_LAYER_LEVEL_SITE[self.segment] if tensor.shape == self._stream_shape
                        else None)
            else:  # megatron's core-attention checkpoint saves the mask type as an int tensor
                site = "attn_mask"
        elif role in _NORM_SITES:
            site = self._norm_site(role, tensor)
        elif role == "self_attention":
            if not tensor.is_floating_point():
                # megatron's core-attention checkpoint saves the mask type as an int tensor
                site = "attn_mask" if _drawn(tensor) else None
            else:
                site = "rope_cos_sin" if is_rope_cos_sin(tensor) else None
        elif role == "mlp":
            site = self._mlp.activation_site(tensor)
        elif role == "linear_fc2":
            site = self._mlp.fc2_in
        elif role == "softmax":
            if tensor.dtype != torch.bool:
                site = "softmax_out"
            else:
                site = "attn_mask" if is_cached_causal_mask(tensor) else None
        elif role == "flash_attention":
            site = _flash_site(tensor)
        elif role == "attention_dropout":
            site = "attn_dropout_mask" if _drawn(tensor) else None
        else:
            site = _ROLE_SITE.get(role)
        if site is None:
            if self.strict and not _of_weights_alone(tensor):
                raise UnknownSiteError(
                    f"layer {self.layer_number - 1}: a tensor {tuple(tensor.shape)} "
                    f"{tensor.dtype} saved inside {role!r} matches no site rule"
                )
            return None
        self._storage_site.put(storage, site)
        return site

    def _norm_site(self, role: str, tensor: torch.Tensor) -> str | None:
        input_site, statistics_site, normed_site = _NORM_SITES[role]
        # Statistics hold one value per row: [s, b, 1] from torch, [s*b] from apex.
        if tensor.numel() == self._norm_rows:
            self._norm_statistics_saved = True
            return statistics_site
        if tensor.numel() != self._norm_rows * self._stream_shape[-1]:
            return None
        # A new row-sized tensor: before the statistics, the input's fp32 copy torch's
        # RMSNorm computes in (16-bit models); after them, RMSNorm's x * rstd.
        return normed_site if self._norm_statistics_saved else input_site


def is_rope_cos_sin(tensor: torch.Tensor) -> bool:
    """Whether a tensor the attention module saves itself (outside submodules) is RoPE's cos or sin.

    RoPE's are computed from the frequencies, floating-point and need no gradient."""
    return tensor.is_floating_point() and not tensor.requires_grad


def is_cached_causal_mask(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is megatron's cached causal mask (one for every micro-batch)."""
    # megatron_compat caches the causal mask per length, so the mask the softmax just saved
    # is the cached tensor itself and this lookup is a cache hit. The binding is read at call
    # time because that patch replaces it.
    from megatron.core.fusions import fused_softmax

    if tensor.dim() != 2 or tensor.shape[0] != tensor.shape[1]:
        return False
    cached = fused_softmax.get_default_causal_mask(tensor.shape[0])
    return tensor.untyped_storage().data_ptr() == cached.untyped_storage().data_ptr()


def _of_weights_alone(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a vector computed from parameters alone, no activation.

    A zero-centred norm (--apply-layernorm-1p) saves its weight + 1 so: strict mode lets it
    pass unattributed, counted as such."""
    node = tensor.grad_fn
    return (tensor.dim() == 1 and node is not None
            and all(after is None or type(after).__name__ == "AccumulateGrad"
                    for after, _ in node.next_functions))


def _drawn(tensor: torch.Tensor) -> bool:
    # A dropout mask is drawn, not computed from anything that needs a gradient. (Asked only
    # where a rule needs it: reading grad_fn builds a Python object on every save.)
    return tensor.grad_fn is None and not tensor.requires_grad


def _flash_site(tensor: torch.Tensor) -> str:
    # SDPA's flash and memory-efficient kernels save Q, K and V (what core attention was
    # called with, already known, or V's own copy beside RoPE's Q and K), their output [b,
    # heads, s, dim] (the storage linear_proj saves next), the log-sum-exp [b, heads, s]
    # and, on CUDA with dropout, integer philox seed and offset.
    if not tensor.is_floating_point():
        return "attn_rng_state"
    if tensor.dim() != 4:
        return "attn_lse"
    return ("context" if type(tensor.grad_fn).__name__.startswith("ScaledDotProduct")
            else "qkv")
