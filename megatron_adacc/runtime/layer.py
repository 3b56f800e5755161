"""The Adacc transformer layer: megatron-core's layer, its saved tensors following site decisions.

A layer-scoped pair of saved-tensor hooks retains, compresses or recomputes every tensor the layer
saves for backward. Nothing of megatron's forward is copied:

- Operator edges of ``sites.REBUILDS`` rebuild their site by calling that megatron submodule or
  function: a norm, the MLP's activation, linear_proj with the bias-dropout-add on the kept mask, or
  the gated MLP's forward between its two linear layers. They read their sources' backward values:
  retained, decoded or rebuilt before (chains).
- Every other recomputed site is rebuilt by re-running megatron's forward segments:
  ``_forward_attention`` from the layer input, ``_forward_mlp`` from ln2_in. A re-run stops as soon
  as the last of its sites is saved again. When ln2_in is recomputed and the attention re-runs too,
  that re-run goes on into the MLP.
- Segment re-runs come first, then the operators in the table's order. A re-run whose start an edge
  rebuilds runs right after that edge (the MLP's, after ln2_in's).
- A re-run restores the RNG states captured when its segment first ran, with megatron's own
  checkpointing helpers. They are the CPU generator, the default CUDA generator (bias-dropout-add's
  masks) and the tensor-parallel tracker's states (attention dropout).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.random import _fork_rng, _get_all_rng_states, _set_all_rng_states
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_adacc.models.attention import DEFAULT_SPEC_BACKEND, local_layer_spec
from megatron_adacc.common.plan import Decision, check_decision
from megatron_adacc.runtime.accounting import active_ruler
from megatron_adacc.runtime.attribution import SiteAttributor
from megatron_adacc.runtime.shared import RopeWindow
from megatron_adacc.runtime.storage import (
    CompressedStorage,
    Handle,
    LayerCall,
    RebuildComplete,
    unpack,
)
from megatron_adacc.common.sites import (COMPRESS, LAYER_INPUT,
                                  MLP_SEGMENT, REBUILDS, REBUILT_BY, RECOMPUTE,
                                  SEGMENT_ANCHORS, SEGMENT_NAMES, SEGMENTS, SITES, chain_reruns)

# Where the MLP segment's re-run starts: the residual stream after attention (ln2_in).
MLP_START = SEGMENTS[SEGMENT_NAMES[MLP_SEGMENT]]


class AdaccTransformerLayer(TransformerLayer):
    """megatron-core's TransformerLayer whose saved activations follow per-site decisions.

    ``set_decisions`` installs them; with no decisions it retains everything, like the stock
    layer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Plain attributes, not submodules: they hold hooks and decisions, no parameters.
        object.__setattr__(self, "attributor", SiteAttributor(self))
        # RoPE's cos and sin, one storage for every layer whatever the decisions: the window
        # is installed by the first forward given rotary embeddings (none on a GPT layer).
        self._rope_window: RopeWindow | None = None
        # Decisions live in `actions` (site -> (action, codec)); set_decisions fills it, and
        # instruments such as the profiler may swap it between steps.
        self.actions: dict[str, tuple[str, object]] = {}
        self.codec_backend: str | None = None  # None: the codecs' default
        # Run under the hooks even with nothing to act on: for instruments that time them.
        self.force_hooks = False
        self._call: LayerCall | None = None
        # The sites the last hooked forward saved: a plan that recomputes all of its own runs
        # as megatron's full recompute does (_checkpointed_forward).
        self._saved_sites: set[str | None] | None = None

    @property
    def layer_index(self) -> int:
        return self.layer_number - 1

    @property
    def strict(self) -> bool:
        return self.attributor.strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self.attributor.strict = value

    def set_decisions(self, decisions: dict[str, Decision]) -> None:
        """Install this layer's site decisions; they take effect at the next forward.

        Never call it between a forward and its backward."""
        actions = {}
        for site, decision in decisions.items():
            check_decision(f"layer {self.layer_index}", site, decision)
            if decision.action == COMPRESS:
                from megatron_adacc import codecs

                actions[site] = (COMPRESS, codecs.get(decision.codec_for(site),
                                                      backend=self.codec_backend,
                                                      **decision.codec_options()))
            elif decision.action == RECOMPUTE:
                actions[site] = (RECOMPUTE, None)
        self.actions = actions

    # --- forward -------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if (self._rope_window is None and kwargs.get("rotary_pos_emb") is not None
                and RopeWindow.applies_to(self.self_attention)):
            self._rope_window = RopeWindow(self.self_attention)
        if not self.actions and not self.force_hooks:
            # Retain everything: that is the stock layer, so run it as one. Nothing needs
            # attributing, so neither saved-tensor hooks nor submodule hooks run (together
            # they cost a few percent of a step) but the RoPE window's, which sees RoPE's
            # saves only; a ruler measures this layer through its own outer hook, exactly as
            # it measures a stock layer.
            self.attributor.detach()
            return super().forward(*args, **kwargs)
        if not torch.is_grad_enabled():
            return super().forward(*args, **kwargs)
        if self._recomputes_whole():
            self.attributor.detach()
            return self._checkpointed_forward(args, kwargs)
        self.attributor.attach()
        recomputes = any(action == RECOMPUTE for action, _ in self.actions.values())
        call = LayerCall(self.layer_index, self.attributor, self.actions, active_ruler(),
                         self._rebuild if recomputes else None)
        if recomputes:
            self._remember_call_inputs(call, args, kwargs)
        if call.has_segment_reruns:
            call.rng_states[0] = _get_all_rng_states()
        self._call = call
        self.attributor.begin()
        try:
            # The plain unpack unless a ruler watches: the hook runs for every saved tensor.
            unpack_hook = unpack if call.ruler is None else call.measured_unpack
            with torch.autograd.graph.saved_tensors_hooks(call.pack, unpack_hook):
                return super().forward(*args, **kwargs)
        finally:
            self.attributor.end()
            call.forward_done()
            self._call = None
            self._saved_sites = call.saved_sites  # the call is done with it

    def _recomputes_whole(self) -> bool:
        """Whether the decisions recompute every site of its own the layer saves, and compress none
        it saves (planning.model.recomputes_whole).

        Its own: recomputable and not shared (shared storages outlive the layer). What it saves
        is known from a forward under the hooks: until one ran, no."""
        saved = self._saved_sites
        if saved is None or self.force_hooks:
            return False
        actions = self.actions
        for site in saved:
            action = actions.get(site)
            if action is not None:
                if action[0] != RECOMPUTE:
                    return False
            elif site is None or (SITES[site].recomputable and not SITES[site].shared):
                return False
        return True

    def _checkpointed_forward(self, args, kwargs):
        """The layer under megatron-core's checkpoint: forward without a graph, its input kept.

        It is megatron's full recompute of one layer, and what the rebuilds would do, but cheaper
        on the host: the first forward builds no graph and packs nothing. The checkpoint saves
        the input outside the layer's hooks, so a ruler books it as the stock layer's."""
        kwargs = dict(kwargs)
        if "hidden_states" in kwargs:
            hidden_states = kwargs.pop("hidden_states")
        else:
            hidden_states, args = args[0], args[1:]
        forward = super().forward
        return tensor_parallel.checkpoint(
            lambda value: forward(value, *args, **kwargs), False, hidden_states)

    def _forward_mlp(self, hidden_states, *args, **kwargs):
        call = self._call
        if call is not None and call.has_segment_reruns:
            call.rng_states[MLP_SEGMENT] = _get_all_rng_states()
        return super()._forward_mlp(hidden_states, *args, **kwargs)

    @staticmethod
    def _remember_call_inputs(call: LayerCall, args, kwargs) -> None:
        # Keep every input but the hidden states: those are the layer_in site, whose saved
        # form (retained, compressed) replaces this provisional anchor once it is packed.
        kwargs = dict(kwargs)
        if "hidden_states" in kwargs:
            hidden_states = kwargs.pop("hidden_states")
        else:
            hidden_states, args = args[0], args[1:]
        call.sources[LAYER_INPUT] = hidden_states
        call.source_requires_grad[LAYER_INPUT] = hidden_states.requires_grad
        call.residual_dtype = hidden_states.dtype
        call.call_args, call.call_kwargs = tuple(args), kwargs

    # --- recompute -----------------------------------------------------------------------
    def _rebuild(self, call: LayerCall) -> None:
        """Rebuild every recomputed site of ``call`` into its cache, at the first unpack of any.

        Segment re-runs come first, then the operators in the table's order. A re-run from a
        recomputed start runs right after the edge that rebuilds it (the MLP's from a rebuilt
        ln2_in)."""
        # A later micro-batch's forward under the checkpoint detached the submodule hooks
        # that name what the rebuild saves.
        self.attributor.attach()
        reruns = self._segment_reruns(call)
        after_edge = {REBUILT_BY[start].output: (keys, start) for start, keys in reruns
                      if (start, 0) in call.wanted}
        # A segment re-run restores the RNG states forward drew with, so it forks them first
        # (training's streams continue as if nothing was drawn); operators alone draw nothing.
        rng = _fork_rng() if reruns else contextlib.nullcontext()
        try:
            with rng, torch.autograd.graph.saved_tensors_hooks(call.capture_pack, _discarded):
                for start, keys in reruns:
                    if (start, 0) not in call.wanted:
                        self._rerun_segments(call, keys, start)
                for edge in REBUILDS:
                    # An edge whose products a re-run already kept (ln2_in) is not run.
                    if any(key[0] in edge.products and key not in call.cache
                           for key in call.wanted):
                        self._run_operator(call, edge)
                    if edge.output in after_edge:
                        self._rerun_segments(call, *after_edge[edge.output])
        finally:
            self.attributor.end()
        missing = call.wanted - set(call.cache)
        if missing:
            raise RuntimeError(
                f"layer {self.layer_index}: rebuilding did not reproduce recomputed sites "
                f"{sorted(missing)}; the layer's forward is not deterministic in what it saves"
            )

    @staticmethod
    def _segment_reruns(call: LayerCall) -> list[tuple[str, set]]:
        """The segment re-runs: (start, the saves each is for), by sites.chain_reruns.

        A re-run passes through a start that is recomputed, or that the layer does not save. Each
        starts from its first segment's start (kept, decoded or rebuilt by its edge), else from
        the layer input."""
        def start_of(index: int) -> str:
            return SEGMENTS[SEGMENT_NAMES[index]]

        def recomputed(index: int) -> bool:
            return (start_of(index), 0) in call.wanted

        def passes_through(index: int) -> bool:
            return recomputed(index) or start_of(index) not in call.sources

        reruns: list[tuple[str, set]] = []
        for chain in chain_reruns(call.segments, passes_through):
            start = start_of(chain[0])
            usable = start in call.sources and (not recomputed(chain[0]) or start in REBUILT_BY)
            keys = {key for index in chain for key in call.segments.get(index, ())}
            reruns.append((start if usable else LAYER_INPUT, keys))
        return reruns

    def _rerun_segments(self, call: LayerCall, keys: set, start: str) -> None:
        """Re-run megatron's forward segments from ``start`` until all of ``keys`` are saved."""
        call.capture({site for site, _ in keys}, set(keys))
        try:
            with torch.enable_grad():
                if start != LAYER_INPUT:
                    hidden_states = self._source_value(call, start)
                else:
                    _set_all_rng_states(*call.rng_states[0])
                    self.attributor.begin(0)
                    hidden_states, _ = self._forward_attention(
                        self._source_value(call, LAYER_INPUT), *call.call_args,
                        **call.call_kwargs
                    )
                    # Reached only when the re-run goes on into the MLP: the attention ran
                    # whole, so its output is ln2_in, drawn with forward's RNG states, and
                    # its edge (linear_proj and the add once more) need not run.
                    self._keep_output(call, MLP_START, hidden_states)
                _set_all_rng_states(*call.rng_states[MLP_SEGMENT])
                self.attributor.begin(MLP_SEGMENT)
                self._forward_mlp(
                    hidden_states,
                    call.call_kwargs.get("inference_context"),
                    padding_mask=call.call_kwargs.get("padding_mask"),
                )
        except RebuildComplete:
            pass
        finally:
            # megatron-core >= 0.19 keeps the pre-MLP norm's input on the layer
            # (mlp_norm_manager) until _forward_mlp's end, which a halted re-run never
            # reaches: left there, it would hold ln2_in alive until the next forward.
            if getattr(self, "mlp_norm_manager", None) is not None:
                self.mlp_norm_manager = None

    def _run_operator(self, call: LayerCall, edge) -> None:
        """Call ``edge``'s megatron submodule or function on its sources and keep its output.

        It also keeps what the call saves that is wanted, captured as it runs. Nothing it
        computes needs a graph unless it saves a wanted site (a norm's statistics, glu's SiLU
        output)."""
        operator = functools.reduce(getattr, edge.call.split("."), self)
        saves = {site for site, _ in call.wanted if site in edge.saves}
        # What a call saves depends on what requires grad (torch's RMSNorm saves its
        # statistics only for its input's gradient): as in forward when it must save.
        sources = [None if name in edge.optional and name not in call.sources
                   else self._source_value(call, name, requires_grad=None if saves else False,
                                           whole=edge.between is not None)
                   for name in edge.sources]
        call.capture(saves)
        self.attributor.begin(SEGMENT_NAMES.index(SITES[edge.output].segment))
        with torch.set_grad_enabled(bool(saves)):
            if edge.between is None:
                output = operator(*sources)
            else:
                output = _run_between(operator, *edge.between, sources[0])
        self._keep_output(call, edge.output, output)

    @staticmethod
    def _keep_output(call: LayerCall, site: str, value: torch.Tensor) -> None:
        """Keep ``value`` for every wanted save of ``site``, in the dtype it was saved in.

        torch's RMSNorm saves its input twice, and in a 16-bit model as an fp32 copy (ln2_in)."""
        for key in sorted(key for key in call.wanted if key[0] == site):
            call.keep(key, value.to(call.saved_dtypes[site]))

    def attention_residual(self, residual: torch.Tensor, context: torch.Tensor,
                           mask: torch.Tensor | None) -> torch.Tensor:
        """The residual stream after attention (ln2_in), rebuilt from the layer input and output.

        It calls megatron's own linear_proj and self_attn_bda as its forward does
        (sites.REBUILDS). The dropout applies ``mask``, the hidden dropout's kept mask, instead
        of drawing one. None: the layer has no hidden dropout."""
        projected = self.self_attention.linear_proj(context)
        with contextlib.nullcontext() if mask is None else _DropoutApplying(mask):
            return self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
                projected, residual, self.hidden_dropout)

    @staticmethod
    def _source_value(call: LayerCall, name: str, requires_grad: bool | None = None,
                      whole: bool = False) -> torch.Tensor:
        """The backward value of a site a rebuild reads: retained, decoded or rebuilt before.

        A decoded value is read, not taken: autograd takes the same view afterwards. With
        ``whole``, it is the tensor the saved view is a view of. It requires grad as the
        forward's did, unless told."""
        saved = call.sources[name]
        if type(saved) is Handle and isinstance(saved.source, CompressedStorage):
            value = saved.source.read(None if whole else saved.key)
        else:
            value = call.cache[saved.key] if type(saved) is Handle else saved
            if whole and value._base is not None:
                value = value._base
        if name in SEGMENT_ANCHORS:
            value = value.to(call.residual_dtype)
        if requires_grad is None:
            requires_grad = call.source_requires_grad[name]
        return value.detach().requires_grad_(requires_grad)


class _DropoutApplying(torch.overrides.TorchFunctionMode):
    """Within it, this thread's first drawing dropout call applies ``mask`` instead of drawing one.

    megatron's bias-dropout-add calls ``torch.nn.functional.dropout``, fused or not; ``mask`` is a
    mask a dropout saved. Every other call, that function's included, runs as without the mode. It
    is a mode, not a substitute for the function: other threads, and code that bound the function by
    name, keep torch's own.

    The product is the one dropout's forward computes:
    - CPU dropout saves its keep-mask divided by 1 - p and returns input * mask.
    - CUDA's native_dropout saves a bool mask and returns input * mask * (1 / (1 - p)), the product
      its backward computes.
    Only the CPU's native_dropout is checked bitwise.
    """

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.mask = mask
        # The function as megatron will look it up (a stand-in where one is installed).
        self.dropout = torch.nn.functional.dropout
        self.applied = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not self.dropout or self.applied:
            return func(*args, **kwargs)
        input, p, training = _dropout_arguments(*args, **kwargs)
        if p == 0 or not training:  # draws nothing: the input, as torch returns it
            return func(*args, **kwargs)
        if self.mask.shape != input.shape:
            raise RuntimeError(
                f"the kept dropout mask has shape {tuple(self.mask.shape)}, the input it "
                f"should apply to {tuple(input.shape)}: not the mask of this dropout")
        self.applied = True
        if self.mask.dtype == torch.bool:
            return torch.ops.aten.native_dropout_backward(input, self.mask, 1.0 / (1.0 - p))
        return input * self.mask


def _dropout_arguments(input, p=0.5, training=True, inplace=False):
    """(input, p, training) of a ``torch.nn.functional.dropout`` call, whose signature this is.

    It binds without ``inspect``, which torch.compile cannot trace."""
    return input, p, training


def _discarded(_saved):
    raise AssertionError("the rebuild graph is never backpropagated")


class _Halted(Exception):
    def __init__(self, value):
        super().__init__()
        self.value = value


class _Emits(torch.nn.Module):
    """Stands in for a megatron linear layer: returns (the given value, no bias)."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, *_args, **_kwargs):
        return self.value, None


class _Halts(torch.nn.Module):
    """Stands in for the linear layer a rebuild stops at: returns what it is called with."""

    def forward(self, value, *_args, **_kwargs):
        raise _Halted(value)


def _run_between(module, enter: str, exit_: str, value: torch.Tensor) -> torch.Tensor:
    """Run ``module``'s forward between two submodules and return ``exit_``'s input.

    ``value`` stands in for the output of submodule ``enter``; the run stops at the call of
    submodule ``exit_`` (sites.Rebuild.between). Both submodules are swapped for stand-ins for
    the call only."""
    originals = {name: module._modules[name] for name in (enter, exit_)}
    module._modules[enter], module._modules[exit_] = _Emits(value), _Halts()
    try:
        module(value)
    except _Halted as halted:
        return halted.value
    finally:
        module._modules.update(originals)
    raise RuntimeError(f"{type(module).__name__} returned without calling its {exit_}")


def get_adacc_layer_spec(attention_backend: str = DEFAULT_SPEC_BACKEND, **local_spec_kwargs):
    """megatron-core's local GPT layer spec, with AdaccTransformerLayer as the layer.

    Its core attention is ``attention_backend``'s (attention_backend.ATTENTION_BACKENDS)."""
    spec = local_layer_spec(attention_backend, **local_spec_kwargs)
    return dataclasses.replace(spec, module=AdaccTransformerLayer)
