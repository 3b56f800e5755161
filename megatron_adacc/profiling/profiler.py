"""The model profiler (paper: "Model profiler"): a few instrumented steps of the user's real
model on a real micro-batch, written down as ``ModelCosts`` for the planner. It measures; it
does not decide.

Everything is measured through the Adacc runtime itself, on one layer (the middle one: every
layer has the same shape), so the numbers describe what the runtime will really do:

- bytes and dtype of each site: the ActivationRuler's attribution of a retain-everything
  step, the very ruler behind the trainer's ``activation_bytes``. Storage sharing is counted
  as the ruler counts it (Q, K and V are one storage; with dropout off the softmax output is
  the attention probabilities). Megatron's cached causal mask is one storage for all layers,
  so it belongs to the non-layer bytes, never to a layer's sites.
- codecs: ``repeats`` steps per candidate round in which the measured layer compresses
  every site with a candidate codec. Payload bytes are what the ruler counts in that step;
  encode and decode times are the medians over the steps of each call timed where the
  runtime makes it (the encode in forward, the decode when backward first reads it).
- rebuild: steps in which the measured layer recomputes only that site; the runtime's
  rebuild is timed where backward asks for it, once per step (the median of ``repeats``
  steps). A site an operator rebuilds (sites.REBUILDS) runs only that operator: steps with
  every product of the operator recomputed (as plans recompute them: an operator that must
  save a wanted site runs with grad and its sources requiring it) give the operator's own
  time. Any other site's rebuild re-runs Megatron's forward segment (attention from
  layer_in, MLP from ln2_in) from its start up to the site, so the measurement is the
  site's ``rebuild_s``: what rebuilding costs when it is the deepest recomputed site of its
  segment (the planner combines these into a layer's rebuild time as the runtime does: a
  maximum per segment, not a sum). Along a segment the times are fitted to be
  non-decreasing: a deeper save cannot be reached sooner, and noise that says otherwise is
  spread over its neighbours.

Times are taken in the step because that is what training pays: a rebuild's sources and a
payload were saved in forward and are read cold, and what they make is written to memory
the cache does not hold. Re-run warm on the spot, the operators measured 0.5-0.85 of their
in-step time on this CPU (issue 26: SwiGLU's 2.9 ms warm, 5.2 ms in the step) and the
outlier codec's decode about half; the planner charged that.

Each timed step records its calls on one clock (clock.Spans) and reads them once it is over:
on CUDA, events recorded around each call between the step's own kernels, with no wait in
between (a synchronisation per call would time each call on an idle stream, which is not
what the step pays); on a CPU, the host's counter. The median over steps is taken. A CPU step
in which a timed call grew the host heap (first touches of fresh pages, a cost paid once) is
run again.
"""
from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
# megatron's own: saves and restores the CPU, default CUDA and tracker generators.
from megatron.core.tensor_parallel.random import _fork_rng

from megatron_adacc import codecs, planning
from megatron_adacc.codecs import backend as codec_backend
from megatron_adacc.codecs.native import host
from megatron_adacc.profiling import allocator, clock
from megatron_adacc.profiling import hardware
from megatron_adacc.models import build as model_lib
from megatron_adacc.models.attention import backend_of
from megatron_adacc.common import sites as site_table
from megatron_adacc.common.costs import MEGATRON_SEGMENTS, CodecCost, ModelCosts, Operator, SiteCost
from megatron_adacc.common.plan import Decision, Plan
from megatron_adacc.runtime import ActivationRuler, adacc_layers, apply_plan
from megatron_adacc.runtime import attribution
from megatron_adacc.runtime.accounting import NON_LAYER, UNATTRIBUTED
from megatron_adacc.common.sites import COMPRESS, RECOMPUTE

DEFAULT_REPEATS = 5

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # tokens, labels, loss mask
# A micro-batch's scalar loss (one forward); the profiler runs its backward.
LossFn = Callable[[torch.nn.Module, Batch], torch.Tensor]


def gpt_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The default loss: megatron's GPT language-model loss over the loss mask. A pipeline
    stage (megatron's ``pre_process``/``post_process``) is profiled alone, without its
    neighbours: a stage without the embedding is fed stand-in hidden states (drawn from a
    fixed generator: only their shape matters to what is measured there), and a stage
    without the output layer backpropagates the sum of its output."""
    tokens, labels, loss_mask = batch
    if not getattr(model, "pre_process", True):
        model.set_input_tensor(stand_in_input(model, tokens))
    if getattr(model, "post_process", True):
        return model_lib.gpt_loss(model, tokens, labels, loss_mask)
    return model_lib.gpt_forward(model, tokens, None).float().sum()


def stand_in_input(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Hidden states for a stage without the embedding, drawn from a fixed generator."""
    config = model.config
    hidden = torch.randn(tokens.shape[1], tokens.shape[0], config.hidden_size,
                         generator=torch.Generator(tokens.device).manual_seed(0),
                         dtype=config.params_dtype, device=tokens.device)
    return hidden.requires_grad_()


def device_name(device: torch.device | None = None) -> str:
    """What the timings were measured on: the GPU's name, or the CPU (with its family and model
    numbers: a VM's model name can be the make alone, host.HostCpu) with its thread count and
    PyTorch's vector path (ATEN_CPU_CAPABILITY can lower it), and the codec kernels
    (backend.describe: ADACC_CODEC_BACKEND and ADACC_NATIVE_CFLAGS choose them): a profile
    measured on one path misleads a plan for another."""
    if device is not None and device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (codecs {codec_backend.describe(device)})"
    return (f"{host.host_cpu().describe()} ({torch.get_num_threads()} threads, "
            f"torch {torch.backends.cpu.get_cpu_capability()}, "
            f"codecs {codec_backend.describe(torch.device('cpu'))})")


# A timed call that first-touched more host pages than this (64 KiB: about 16 us on a VM)
# grew the heap. A page or two now and then are the interpreter's own.
HEAP_GROWTH_PAGES = 16


def timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """``fn()``'s result and the wall time of that one call (CUDA: device events, read at
    once: for whole steps, not the calls inside one)."""
    spans = clock.Spans(clock.for_device(device))
    result, _ = spans.time(fn)
    return result, spans.read()[0]


def _timed_on_the_heap(fn: Callable[[], object], spans: clock.Spans
                       ) -> tuple[object, int, bool]:
    """``spans.time(fn)`` (the result and its span), and whether the call grew the host heap
    (first-touched more than HEAP_GROWTH_PAGES pages). On CUDA the host's pages are not on
    the clock."""
    if spans.clock.deferred:
        return (*spans.time(fn), False)
    touched = allocator.host_pages_first_touched()
    result, span = spans.time(fn)
    return result, span, allocator.host_pages_first_touched() - touched > HEAP_GROWTH_PAGES


# --- instruments ------------------------------------------------------------------------------
class _RetainedRuler(ActivationRuler):
    """The ruler of an all-retain step, also noting the dtype of the first tensor it counts
    for each site and what the embedding keeps: its saves are the step's first, so the
    bytes alive when it returns are its own."""

    def __init__(self, model: torch.nn.Module, **kwargs):
        super().__init__(model, **kwargs)
        self.dtypes: dict[tuple[int, str], torch.dtype] = {}
        self.embedding_bytes = 0
        # The data loader's attention masks (Megatron-LM's --create-attention-mask-in-
        # dataloader): one per micro-batch, unlike megatron's cached causal mask.
        self._loader_masks: dict[int, int] = {}
        # megatron's GPTModel has an embedding on the first pipeline stage only.
        self._embedding = getattr(model, "embedding", None)

    def __enter__(self) -> "_RetainedRuler":
        super().__enter__()
        if self._embedding is not None:
            self._module_hooks.append(self._embedding.register_forward_hook(self._embedded))
        return self

    def _embedded(self, module, args, output) -> None:
        self.embedding_bytes = self.live_bytes

    def keep_tensor(self, layer, site, tensor):
        self.dtypes.setdefault((layer, site or UNATTRIBUTED), tensor.dtype)
        if site == "attn_mask" and not attribution.is_cached_causal_mask(tensor):
            storage = tensor.untyped_storage()
            self._loader_masks[id(storage)] = storage.nbytes()
        super().keep_tensor(layer, site, tensor)

    def stage_memory(self, model: torch.nn.Module) -> planning.StageMemory:
        """What the model holds besides its layers' activations, by this step: the
        activations kept when forward ended less the layers' (their shared sites are
        non-layer bytes: one storage for every layer) and the embedding's.

        A data loader's attention mask is one micro-batch's, held until its backward ends,
        so the first stage (several micro-batches in flight) counts it with the embedding's;
        later stages get none (Megatron-LM's get_batch) or are the last (one in flight)."""
        report = self.report()
        layers = sum(nbytes for (layer, site), nbytes in report.by_site.items()
                     if layer != NON_LAYER and site not in site_table.SHARED_SITES)
        shared = sum(nbytes for (layer, site), nbytes in report.by_site.items()
                     if layer != NON_LAYER and site in site_table.SHARED_SITES)
        embedding = self.embedding_bytes
        if self._embedding is not None:
            masks = sum(self._loader_masks.values())
            embedding, shared = embedding + masks, shared - masks
        return planning.StageMemory(
            hardware.model_static_bytes(model), embedding,
            report.after_forward_bytes - layers - embedding, shared,
            hardware.model_step_bytes(model))


class _Unencodable:
    """Stands in for a payload when a candidate codec rejects a tensor: keeps it whole."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.nbytes = tensor.untyped_storage().nbytes()


class _CodecProbe:
    """Sits in the runtime where a codec goes: encodes and decodes with the real codec, timing
    each call where the step makes it (the encode in forward, the decode when backward first
    reads the storage) on ``spans`` unless it is None, and keeps what it was given. The
    times are read after the step (``read_times``): on CUDA the calls' events are recorded
    in the step and nothing waits for them until it is over."""

    def __init__(self, codec, spans: clock.Spans | None):
        self.codec = codec
        self.spans = spans
        self.inputs: list[torch.Tensor] = []
        self.failed = False
        self.encode_s = 0.0
        self.decode_s = 0.0
        self.grew_heap = False
        self._calls: list[tuple[str, int]] = []     # (encode or decode, span)

    def _run(self, kind: str, fn: Callable[[], object]) -> object:
        # Untimed where only the inputs are wanted.
        if self.spans is None:
            return fn()
        result, span, grew = _timed_on_the_heap(fn, self.spans)
        self.grew_heap |= grew
        self._calls.append((kind, span))
        return result

    def encode(self, tensor):
        self.inputs.append(tensor.detach())
        try:
            return self._run("encode", lambda: self.codec.encode(tensor))
        except (ValueError, TypeError, RuntimeError):
            self.failed = True
            return _Unencodable(tensor)

    def decode(self, payload):
        if isinstance(payload, _Unencodable):
            return payload.tensor
        return self._run("decode", lambda: self.codec.decode(payload))

    def read_times(self, seconds: Sequence[float]) -> None:
        """Sum this probe's calls into ``encode_s`` and ``decode_s`` from the step's span
        readings (``Spans.read()``)."""
        for kind, span in self._calls:
            setattr(self, f"{kind}_s", getattr(self, f"{kind}_s") + seconds[span])


class _OutlierCounter:
    """Sits in the runtime where an outlier-separating codec goes: encodes and decodes with
    it, and keeps how many channels of each tensor it was given are outliers (a device
    count, read once the step is done: never inside it)."""

    def __init__(self, codec, counts: list[torch.Tensor]):
        self.codec = codec
        self.counts = counts

    def encode(self, tensor):
        self.counts.append(self.codec.outlier_count(tensor))
        return self.codec.encode(tensor)

    def decode(self, payload):
        return self.codec.decode(payload)


class _MeasuredLayerDone(Exception):
    """Ends a forward-only profiling step after the measured layer."""


class _Profiling:
    """One model, one micro-batch, one measured layer: the steps the profiler runs."""

    def __init__(self, model: torch.nn.Module, batch: Batch, strict: bool, repeats: int,
                 loss_fn: LossFn | None = None):
        self.model = model
        self.batch = batch
        self.loss_fn = loss_fn or gpt_loss
        self.strict = strict
        self.repeats = repeats
        self.layers = adacc_layers(model)
        if not self.layers:
            raise ValueError("profiling needs a model built with runtime.get_adacc_layer_spec()")
        self.layer = self.layers[len(self.layers) // 2]
        self.index = self.layer.layer_index
        self.device = batch[0].device

    def step(self, decisions: dict[str, Decision], ruler_type=ActivationRuler,
             install: Callable[[], None] | None = None, backward: bool = True,
             every_layer: bool = False):
        """Forward and backward of the micro-batch with ``decisions`` on the measured layer
        only, or on each (``every_layer``; ``install`` may then adjust the measured layer's
        actions); gradients are dropped.
        ``backward=False``: the forward stops once the measured layer is done, since nothing
        after it is looked at. ``ruler_type=None``: no ruler watches (its hooks and counts
        are none of training's), for steps that only time. Returns the ruler."""
        first, last = ((self.layers[0].layer_index, self.layers[-1].layer_index) if every_layer
                       else (self.index, self.index))
        apply_plan(self.model, Plan(layers={(first, last): decisions}), strict=self.strict)
        if install is not None:
            install()
        ruler = ruler_type(self.model, strict=self.strict) if ruler_type else None
        with ruler if ruler is not None else contextlib.nullcontext():
            if backward:
                loss = self.loss_fn(self.model, self.batch)
                if ruler is not None:
                    ruler.forward_done()
                loss.backward()
            else:
                self._forward_through_measured_layer(ruler)
        if backward:
            self.model.zero_grad(set_to_none=True)
        return ruler

    def _forward_through_measured_layer(self, ruler: ActivationRuler) -> None:
        def done(module, args, output):
            # Read the ruler now: unwinding the forward frees what this layer saved.
            ruler.forward_done()
            raise _MeasuredLayerDone

        handle = self.layer.register_forward_hook(done)
        try:
            self.loss_fn(self.model, self.batch)
        except _MeasuredLayerDone:
            pass
        finally:
            handle.remove()

    def layer_sites(self, ruler: ActivationRuler) -> dict[str, int]:
        return {site: n for (layer, site), n in ruler.report().by_site.items()
                if layer == self.index and site not in site_table.SHARED_SITES}

    # --- codecs ------------------------------------------------------------------------------
    def probed_step(self, decisions: dict[str, Decision], backward: bool = True,
                    timing: bool = True) -> tuple[dict[str, int], dict[str, "_CodecProbe"]]:
        """A step with ``decisions`` on the measured layer whose codecs are probed: (the
        layer's bytes per site, a probe per compressed site, timing its calls if ``timing``)."""
        probes: dict[str, _CodecProbe] = {}
        spans = clock.Spans(clock.for_device(self.device)) if timing else None

        def install(layer=self.layer):
            for name, (action, codec) in list(layer.actions.items()):
                if action == COMPRESS:
                    probes[name] = _CodecProbe(codec, spans)
                    layer.actions[name] = (COMPRESS, probes[name])

        sizes = self.layer_sites(self.step(decisions, install=install, backward=backward))
        if spans is not None:
            seconds = spans.read()      # once, after the step
            for probe in probes.values():
                probe.read_times(seconds)
        return sizes, probes

    def outlier_capacities(self, decisions: dict[str, Decision]
                           ) -> tuple[dict[str, int], dict[str, int]]:
        """One step with ``decisions`` on every layer: (the largest outlier count over the
        layers of each site whose codec separates outliers, the largest payload of each
        site). The counts are read after the step, the same on every tensor- and
        context-parallel peer (their largest)."""
        counts: dict[str, list[torch.Tensor]] = {}

        def count():
            for layer in self.layers:
                for name, (action, codec) in list(layer.actions.items()):
                    if action == COMPRESS and getattr(codec, "separates_outliers", False):
                        layer.actions[name] = (COMPRESS,
                                               _OutlierCounter(codec, counts.setdefault(name, [])))

        largest: dict[str, int] = {}
        for (_, name), size in self.step(decisions, every_layer=True,
                                         install=count).report().by_site.items():
            if name in decisions:
                largest[name] = max(largest.get(name, 0), size)
        return {name: self._largest_on_peers(max(int(n) for n in found))
                for name, found in counts.items() if found}, largest

    def _largest_on_peers(self, value: int) -> int:
        if (not dist.is_initialized() or not parallel_state.model_parallel_is_initialized()):
            return value
        group = parallel_state.get_tensor_and_context_parallel_group()
        if dist.get_world_size(group) == 1:
            return value
        box = torch.tensor([value], device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
        return int(box.item())

    def codec_costs(self, names: Iterable[str]) -> dict[str, list[CodecCost]]:
        """Every candidate codec of each named site, timed in the step on its real tensors
        (the median over ``repeats`` steps of a candidate round, after two untimed), each
        payload at its largest over the layers; an outlier-separating codec's at the
        capacity of the largest outlier count over the layers (CodecCost.capacity)."""
        candidates = {name: site_table.get(name).candidate_codecs for name in names}
        found: dict[str, list[CodecCost]] = {name: [] for name in candidates}
        for round_ in range(max((len(c) for c in candidates.values()), default=0)):
            chosen = {name: c[round_] for name, c in candidates.items() if round_ < len(c)}
            # Two untimed steps first. One compresses the sites of every layer and counts
            # their outlier channels: an outlier site's capacity is the largest count over
            # the layers, which differ (in a 3-layer GPT of 64 channels, 0 to 3 of them, and a
            # plan at the profiled layer's count overran its budget); every payload is then
            # fixed by its shape and that capacity. The other, as the timed steps, grows
            # the host heap to their payloads and decoded values beside the rest, and on a
            # CPU each new page faults on first touch (in a fresh process the decode of
            # Llama's 32 MiB swiglu_in took 6.1-6.3 ms in each round's first step against
            # 1.1-1.7 in the next two, and a median of three took 12 ms once).
            capacities, largest = self.outlier_capacities(
                {name: Decision(COMPRESS, codec) for name, codec in chosen.items()})
            decisions = {name: Decision(COMPRESS, codec, capacities.get(name))
                         for name, codec in chosen.items()}
            self.probed_step(decisions)

            def timed_step():
                # Each usable probe's times only: the probes and the tensors they were given
                # go with their step.
                sizes, probes = self.probed_step(decisions)
                usable = {name: probe for name, probe in probes.items()
                          if not probe.failed and probe.inputs}
                return ((sizes, {name: (probe.encode_s, probe.decode_s)
                                 for name, probe in usable.items()}),
                        any(probe.grew_heap for probe in usable.values()))

            steps = self._steady_steps(timed_step)
            for name, codec in chosen.items():
                times = [step_times.get(name) for _, step_times in steps]
                if None in times:
                    continue
                payload = int(steps[0][0][name])  # at the capacity: the same in every layer
                found[name].append(CodecCost(
                    codec=codec, payload_bytes=(payload if name in capacities
                                                else max(payload, largest.get(name, 0))),
                    encode_s=statistics.median(encode_s for encode_s, _ in times),
                    decode_s=statistics.median(decode_s for _, decode_s in times),
                    capacity=capacities.get(name)))
        return found

    def rebuild_seconds(self, names: Sequence[str]) -> float:
        """The runtime's rebuild when ``names`` are the only recomputed sites, timed in the
        step where backward asks for it: the median over ``repeats`` steps."""
        original = self.layer._rebuild
        spans: clock.Spans | None = None
        grew: list[bool] = []

        def timed_rebuild(call):
            grew.append(_timed_on_the_heap(lambda: original(call), spans)[2])

        def timed_step():
            nonlocal spans
            spans = clock.Spans(clock.for_device(self.device))
            grew.clear()
            self.step({name: Decision(RECOMPUTE) for name in names}, ruler_type=None)
            return spans.read(), any(grew)

        # The layer hands its bound `_rebuild` to each forward call; an instance attribute
        # shadows it for the steps measured here.
        self.layer._rebuild = timed_rebuild
        try:
            times = [seconds for step in self._steady_steps(timed_step) for seconds in step]
        finally:
            del self.layer._rebuild
        if not times:
            raise RuntimeError(f"sites {', '.join(names)}: backward never asked for the "
                               "rebuilt values")
        return statistics.median(times)

    # --- the runtime's hooks ------------------------------------------------------------
    def hooked_layer_seconds(self) -> float:
        """What running the measured layer under the runtime's hooks, with nothing to act
        on, adds to a step: the median over 10 x ``repeats`` steps of each, stock and hooked
        alternately, of the differences, after a pair untimed. The hooks are host code run
        per save and per submodule call; on a CPU the steps run on a short slice of the
        batch (``hook_timing_batch``), where the difference is not lost in the noise of the
        step's arithmetic. Beside full-size tensors the same code runs on colder caches, so
        this is a lower bound there (about half on the Llama bench shape, docs/decisions.md).
        On a GPU the steps run on the batch itself: there the host code overlaps the kernels
        of a layer large enough, and hides behind them."""
        batch = self.batch if self.device.type == "cuda" else hook_timing_batch(
            self.batch, self.model.config)
        apply_plan(self.model, Plan(), strict=self.strict)

        def timed_step(hooked: bool) -> float:
            self.layer.force_hooks = hooked
            # Outside the clock: training attaches a hooked layer's submodule hooks once.
            (self.layer.attributor.attach if hooked else self.layer.attributor.detach)()
            return self._timed_step(batch)

        differences = []
        try:
            for pair in range(1 + 10 * max(1, self.repeats)):
                stock = timed_step(False)
                difference = timed_step(True) - stock
                if pair:
                    differences.append(difference)
        finally:
            self.layer.force_hooks = False
            self.model.zero_grad(set_to_none=True)
        return max(0.0, statistics.median(differences))

    def _timed_step(self, batch: Batch) -> float:
        """One forward and backward of ``batch`` as the layers are set, timed whole; the
        gradients are dropped before it."""
        self.model.zero_grad(set_to_none=True)
        return timed(lambda: self.loss_fn(self.model, batch).backward(), self.device)[1]

    def step_seconds(self) -> float:
        """A step of the micro-batch with every layer keeping everything (megatron's stock
        layer, no hooks): the median of ``repeats`` steps after one untimed. The step time
        of a plan is predicted as this plus the plan's added time."""
        apply_plan(self.model, Plan(), strict=self.strict)
        try:
            times = [self._timed_step(self.batch) for _ in range(1 + max(1, self.repeats))]
        finally:
            self.model.zero_grad(set_to_none=True)
        return statistics.median(times[1:])

    def _steady_steps(self, timed_step: Callable[[], tuple[object, bool]]) -> list[object]:
        """The results of ``repeats`` timed steps whose timed calls did not grow the host heap
        (``timed_step()`` runs one: its result, and whether one did). Such a call paid for
        pages that steps on recycled memory touch once only (one decode of Llama's 32 MiB
        swiglu_in took 6.5 ms against 1.3, and a profile's median of three 5.2 ms), so its
        step runs again, up to ``repeats`` more steps; if fewer than ``repeats`` did not,
        those few, or if none, all."""
        wanted = max(1, self.repeats)
        steady, every = [], []
        for _ in range(2 * wanted):
            result, grew = timed_step()
            grew = self._on_any_peer(grew)
            every.append(result)
            if not grew:
                steady.append(result)
                if len(steady) == wanted:
                    break
        return steady or every

    def _on_any_peer(self, flag: bool) -> bool:
        """Whether ``flag`` holds on this rank or on any tensor- or context-parallel peer: the
        peers' layers exchange activations in every step, so they must all run the same
        steps (a rank that ran one more waited on its peers for good). Only CPU steps can
        grow the host heap, so a CUDA step asks no peer."""
        if (self.device.type != "cpu" or not dist.is_initialized()
                or not parallel_state.model_parallel_is_initialized()):
            return flag
        group = parallel_state.get_tensor_and_context_parallel_group()
        if dist.get_world_size(group) == 1:
            return flag
        flags = torch.tensor([int(flag)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return bool(flags.item())


def hook_timing_batch(batch: Batch, config) -> Batch:
    """One sequence of ``batch``, cut to its shortest prefix, by halving, that keeps at least
    16 tokens and is still split evenly by the model's parallelism (sequence parallelism over
    the tensor-parallel ranks, context parallelism in 2 x its size chunks)."""
    unit = config.tensor_model_parallel_size if config.sequence_parallel else 1
    if config.context_parallel_size > 1:
        unit *= 2 * config.context_parallel_size
    length = batch[0].shape[1]
    while length % 2 == 0 and length // 2 >= 16 and (length // 2) % unit == 0:
        length //= 2
    return tuple(tensor[:1, :length] for tensor in batch)


def _nondecreasing(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence (least squares, pool adjacent violators). Prefix
    times cannot shrink along a segment; noise that says otherwise is spread over its
    neighbours instead of making a deeper site look cheaper to rebuild."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            blocks[-1] = [(blocks[-1][0] * blocks[-1][1] + mean * count) / (blocks[-1][1] + count),
                          blocks[-1][1] + count]
    return [mean for mean, count in blocks for _ in range(count)]


def _rebuild_times(order: Sequence[str], prefix_s: dict[str, float]) -> dict[str, float]:
    """site -> its rebuild time from its segment's start, fitted along the segment in the
    order the sites are saved."""
    fitted = {}
    for segment in MEGATRON_SEGMENTS:
        measured = [name for name in order
                    if name in prefix_s and site_table.get(name).segment == segment.name]
        fitted.update(zip(measured, _nondecreasing([prefix_s[name] for name in measured])))
    return fitted


@contextlib.contextmanager
def _left_as_found(model: torch.nn.Module):
    """Profiling steps change the layers' decisions and draw dropout masks; put both back so
    training computes afterwards exactly what it would have computed without them."""
    actions = {layer: layer.actions for layer in adacc_layers(model)}
    try:
        with _fork_rng():
            yield
    finally:
        for layer, saved in actions.items():
            layer.actions = saved


def profile(model: torch.nn.Module, batch: Batch, *, repeats: int = DEFAULT_REPEATS,
            strict: bool = False, loss_fn: LossFn | None = None) -> ModelCosts:
    """Measure ``model`` (built with the Adacc layer spec) on one micro-batch ``batch``
    (tokens, labels, loss mask; ``loss_fn`` its loss, default ``gpt_loss``). The model's
    decisions, gradients (none) and RNG streams are as before."""
    with _left_as_found(model):
        return _profile(_Profiling(model, batch, strict, repeats, loss_fn))


def _profile(run: _Profiling) -> ModelCosts:
    model, config = run.model, run.model.config
    run.step({})  # warm-up: megatron's cached mask, allocator, codec kernels
    with allocator.watch(run.device) as peaks:
        retained = run.step({}, _RetainedRuler)
    memory = retained.stage_memory(model)
    sizes = run.layer_sites(retained)
    order = list(sizes)
    known = [name for name in order if name in site_table.SITES]
    codec_costs = run.codec_costs(known)
    recomputable = [name for name in known if site_table.get(name).recomputable]
    prefix_s = {name: run.rebuild_seconds([name]) for name in recomputable
                if name not in site_table.REBUILT_BY}
    # Each operator this layer offers, timed with every product of it this layer saves
    # recomputed, reading the sources this layer saves (no mask without dropout).
    operators = tuple(
        Operator(edge.call, edge.sources_in(sizes), run.rebuild_seconds(products))
        for edge in site_table.REBUILDS if edge.used_by(sizes)
        for products in [[name for name in edge.products if name in recomputable]]
        if products)
    operator_of = {name: edge.call for edge in site_table.REBUILDS for name in edge.products
                   if edge.call in {operator.name for operator in operators}}

    rebuild_s = _rebuild_times(order, prefix_s)
    hooked_layer_s = run.hooked_layer_seconds()
    step_s = run.step_seconds()
    sites = []
    for name in order:
        sites.append(SiteCost(
            name=name,
            bytes=sizes[name],
            dtype=str(retained.dtypes[(run.index, name)]).removeprefix("torch."),
            rebuild_s=rebuild_s.get(name, 0.0),
            segment=site_table.get(name).segment if name in rebuild_s else None,
            codecs=tuple(codec_costs.get(name, ())),
            operator=operator_of.get(name) if name in recomputable else None,
        ))
    num_layers = len(run.layers)
    seq_length, micro_batch = run.batch[0].shape[1], run.batch[0].shape[0]
    shape = model_shape(config, model.vocab_size, seq_length, backend_of(model),
                        getattr(model, "position_embedding_type", "learned_absolute"))
    costs = ModelCosts(
        sites=sites,
        num_layers=num_layers,
        static_bytes=memory.static_bytes,
        optimizer_step_bytes=memory.optimizer_step_bytes,
        non_layer_bytes=memory.non_layer_bytes,
        held_non_layer_bytes=memory.held_non_layer_bytes,
        embedding_bytes=memory.embedding_bytes,
        backward_workspace_bytes=hardware.backward_workspace_bytes(shape, micro_batch),
        micro_batch_size=micro_batch,
        operators=operators,
        hooked_layer_s=hooked_layer_s,
        meta={
            "source": "profile",
            "device": device_name(run.device),
            "shape": shape.__dict__,
            "measured_layer": run.index,
            "repeats": run.repeats,
            "rebuild_prefix_s": prefix_s,
            "step_s": step_s,
        },
    )
    return replace(costs, allocator_overhead_bytes=allocator_overhead(costs, peaks))


def stage_memory(model: torch.nn.Module, batch: Batch, *, strict: bool = False,
                 loss_fn: LossFn | None = None) -> planning.StageMemory:
    """What ``model`` (a pipeline stage, built with the Adacc layer spec) holds besides its
    layers' activations, measured in one all-retain step on ``batch``: every stage measures
    its own (the embedding is the first stage's, the output layer and loss the last's),
    while one profile of a layer serves every stage. Decisions and RNG streams are left as
    found."""
    with _left_as_found(model):
        run = _Profiling(model, batch, strict, 1, loss_fn)
        return run.step({}, _RetainedRuler).stage_memory(model)


def allocator_overhead(costs: ModelCosts, peaks: allocator.Peaks) -> int:
    """How far the allocator's reserved peak over an all-retain step exceeded what the
    planner predicts for it: the bytes already in tensors when the step began (parameters,
    buffers) plus its predicted activation peak. 0 on a CPU (no allocator readings)."""
    if not peaks.max_reserved:
        return 0
    retain_all = [planning.evaluate_layer(costs, {})] * costs.num_layers
    predicted = planning.peak_bytes(costs, retain_all) - costs.static_bytes
    return max(0, peaks.max_reserved - peaks.allocated_before - predicted)


def refresh_codec_costs(costs: ModelCosts, model: torch.nn.Module, batch: Batch,
                        names: Iterable[str], *, repeats: int = DEFAULT_REPEATS,
                        strict: bool = False) -> ModelCosts:
    """``costs`` with the codec entries of ``names`` re-measured on ``batch``'s real tensors
    (one forward and backward; the rectifier's way to follow activation statistics, e.g. the
    outlier sites' compression rates, as training moves them)."""
    with _left_as_found(model):
        fresh = _Profiling(model, batch, strict, repeats).codec_costs(list(names))
    sites = [replace(site, codecs=tuple(fresh[site.name])) if site.name in fresh else site
             for site in costs.sites]
    return replace(costs, sites=sites)


def refresh_action_costs(costs: ModelCosts, model: torch.nn.Module, batch: Batch,
                         layer_decisions: Iterable[dict[str, Decision]], *,
                         repeats: int = DEFAULT_REPEATS, strict: bool = False,
                         loss_fn: LossFn | None = None) -> ModelCosts:
    """``costs`` with the actions a plan uses re-timed in steps on ``batch`` (the step
    watch's way to correct a plan that ran slower than predicted): the encode and decode
    times of every codec entry of each site the plan compresses (payloads and capacities
    stay what the costs say: the rectifier follows those, and plans name the capacity), the
    rebuild of each site it recomputes (its segment's times fitted again with the other
    sites' profiled ones) and each operator it runs, and ``meta["step_s"]``, the step its
    added time is predicted on top of. Decisions and RNG streams are left as found."""
    decisions = [decision for layer in layer_decisions for decision in layer.items()]
    compressed = sorted({name for name, d in decisions if d.action == COMPRESS})
    recomputed = {name for name, d in decisions if d.action == RECOMPUTE}
    with _left_as_found(model):
        run = _Profiling(model, batch, strict, repeats, loss_fn)
        fresh_codecs = run.codec_costs([name for name in compressed if name in site_table.SITES])
        on_segments = [site.name for site in costs.sites
                       if site.name in recomputed and site.segment is not None]
        prefix_s = {**costs.meta.get("rebuild_prefix_s",
                                     {site.name: site.rebuild_s for site in costs.sites
                                      if site.segment is not None}),
                    **{name: run.rebuild_seconds([name]) for name in on_segments}}
        # An operator is timed as the profile timed it: with every product it rebuilds here
        # recomputed.
        operators = tuple(
            replace(operator, rebuild_s=run.rebuild_seconds(products))
            if recomputed & set(products) else operator
            for operator in costs.operators
            for products in [[site.name for site in costs.sites
                              if site.operator == operator.name and site.can_recompute]])
        step_s = run.step_seconds()
    rebuild_s = _rebuild_times([site.name for site in costs.sites], prefix_s)

    def retimed(site: SiteCost) -> tuple[CodecCost, ...]:
        fresh = {codec.codec: codec for codec in fresh_codecs.get(site.name, ())}
        return tuple(replace(codec, encode_s=fresh[codec.codec].encode_s,
                             decode_s=fresh[codec.codec].decode_s)
                     if codec.codec in fresh else codec for codec in site.codecs)

    sites = [replace(site, codecs=retimed(site),
                     rebuild_s=rebuild_s.get(site.name, site.rebuild_s))
             if site.segment is not None or site.name in fresh_codecs else site
             for site in costs.sites]
    return replace(costs, sites=sites, operators=operators,
                   meta={**costs.meta, "rebuild_prefix_s": prefix_s, "step_s": step_s})


@dataclass
class SiteSample:
    """One site of the measured layer compressed in one real step: the codec, the tensors
    the runtime handed it and the payload bytes the ruler counted."""

    codec: codecs.Codec
    tensors: list[torch.Tensor]
    payload_bytes: int


def sample_sites(model: torch.nn.Module, batch: Batch, names: Iterable[str], *,
                 strict: bool = False, loss_fn: LossFn | None = None
                 ) -> dict[str, SiteSample]:
    """One forward of ``batch``, up to the measured layer, with ``names`` compressed by
    their designated codecs there, keeping what each codec was given (the rectifier's view
    of the activations as training moves them). Forward only: the payloads are what forward
    keeps, and no backward means no gradient (nor data-parallel reduction) is touched.
    Decisions and RNG streams are left as found."""
    with _left_as_found(model):
        sizes, probes = _Profiling(model, batch, strict, 1, loss_fn).probed_step(
            {name: Decision(COMPRESS) for name in names}, backward=False, timing=False)
    return {name: SiteSample(probe.codec, probe.inputs, sizes[name])
            for name, probe in probes.items()
            if not probe.failed and probe.inputs and name in sizes}


def model_shape(config, vocab_size: int, seq_length: int, attention_backend: str = "unfused",
                position_embedding_type: str = "learned_absolute") -> hardware.ModelShape:
    """The planner's description of a megatron TransformerConfig, the model's resolved
    attention backend and its positions (for the analytic parts and the ProfileDB key: a
    Llama layer is never served a GPT layer's profile)."""
    precision = "bf16" if config.bf16 else "fp16" if config.fp16 else "fp32"
    return hardware.ModelShape(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        seq_length=seq_length,
        vocab_size=vocab_size,
        ffn_hidden_size=config.ffn_hidden_size,
        precision=precision,
        attention_dropout=config.attention_dropout,
        hidden_dropout=config.hidden_dropout,
        softmax_in_fp32=config.attention_softmax_in_fp32,
        attention_backend=attention_backend,
        make_vocab_size_divisible_by=1,
        normalization=config.normalization,
        swiglu=bool(config.gated_linear_unit),
        position_embedding_type=position_embedding_type,
        num_query_groups=config.num_query_groups,
        add_bias_linear=config.add_bias_linear,
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        sequence_parallel=config.sequence_parallel,
    )
