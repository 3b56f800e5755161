"""The model profiler (paper: "Model profiler"): measures the user's model into ``ModelCosts``.

It runs a few instrumented steps of the real model on a real micro-batch; it measures and does not
decide. Everything is measured through the Adacc runtime itself, on the middle layer (all layers
have the same shape), so the numbers describe what the runtime will really do:

- bytes and dtype of each site: the ActivationRuler's attribution of an all-retain step, the ruler
  behind the trainer's ``activation_bytes``. Storage sharing counts as the ruler counts it.
  Megatron's cached causal mask is one storage for all layers: non-layer bytes.
- codecs: ``repeats`` steps per candidate round, in which the measured layer compresses every site
  with a candidate codec. Payload bytes are what the ruler counts. The encode is timed in forward,
  the decode when backward first reads the storage.
- rebuilds: steps in which the measured layer recomputes only that site, timed where backward asks
  for it. A site an operator rebuilds (sites.REBUILDS) times that operator, with all its products
  recomputed. Any other site times a segment re-run up to it: its ``rebuild_s``
  (docs/memory-model.md, "Time").

Times are medians over steps, taken in the step, since that is what training pays. There,
sources and payloads are read cold, and products go to memory the cache does not hold
(docs/decisions.md). Each timed step records its calls on one clock (clock.Spans) and reads
them after the step. On CUDA these are events between the step's own kernels, with no wait in
between; on a CPU, the host's counter. A CPU step in which a timed call grew the host heap is
run again; if every step grew it, those that grew it least are kept.
"""
from __future__ import annotations

import contextlib
import gc
import statistics
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
# megatron's own: saves and restores the CPU, default CUDA and tracker generators.
from megatron.core.tensor_parallel.random import _fork_rng

from megatron_adacc import codecs, planning
from megatron_adacc.codecs import backend as codec_backend
from megatron_adacc.codecs.native import host
from megatron_adacc.profiling import allocator, clock
from megatron_adacc.planning import analytic
from megatron_adacc.profiling import engine_memory
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
    """The default loss: megatron's GPT language-model loss over the loss mask.

    A pipeline stage (megatron's ``pre_process``/``post_process``) is profiled alone:
    - a stage without the embedding is fed stand-in hidden states from a fixed generator (only their
      shape matters there);
    - a stage without the output layer backpropagates the sum of its output.
    """
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
    """What the timings were measured on: a profile from one path misleads a plan for another.

    - a GPU: its name;
    - a CPU: its family and model numbers (a VM's model name can be the make alone, host.HostCpu),
      its thread count and PyTorch's vector path (ATEN_CPU_CAPABILITY can lower it);
    - the codec kernels (backend.describe; ADACC_CODEC_BACKEND and ADACC_NATIVE_CFLAGS choose them).
    """
    if device is not None and device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (codecs {codec_backend.describe(device)})"
    return (f"{host.host_cpu().describe()} ({torch.get_num_threads()} threads, "
            f"torch {torch.backends.cpu.get_cpu_capability()}, "
            f"codecs {codec_backend.describe(torch.device('cpu'))})")


# A timed call that first-touched more host pages than this (64 KiB: about 16 us on a VM)
# grew the heap. A page or two now and then are the interpreter's own.
HEAP_GROWTH_PAGES = 16


def timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """``fn()``'s result and the wall time of that one call.

    On CUDA it reads device events at once: use it for whole steps, not for calls inside one."""
    spans = clock.Spans(clock.for_device(device))
    result, _ = spans.time(fn)
    return result, spans.read()[0]


def _timed_on_the_heap(fn: Callable[[], object], spans: clock.Spans
                       ) -> tuple[object, int, int]:
    """``spans.time(fn)`` (the result and its span), and the host pages the call grew the heap by.

    Growing means first-touching more than HEAP_GROWTH_PAGES pages; fewer count as 0. On CUDA
    the host's pages are not on the clock."""
    if spans.clock.deferred:
        return (*spans.time(fn), 0)
    touched = allocator.host_pages_first_touched()
    result, span = spans.time(fn)
    grown = allocator.host_pages_first_touched() - touched
    return result, span, grown if grown > HEAP_GROWTH_PAGES else 0


# --- instruments ------------------------------------------------------------------------------
class _RetainedRuler(ActivationRuler):
    """The ruler of an all-retain step; it also notes each site's dtype and the embedding's bytes.

    The dtype is that of the first tensor it counts for the site. The embedding's saves are the
    step's first, so the bytes alive when it returns are its own."""

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
        """What the model holds besides its layers' activations, by this step.

        That is the activations kept when forward ended, less the layers' and the embedding's. The
        layers' shared sites count as non-layer bytes: one storage for every layer.

        A data loader's attention mask is one micro-batch's, held until its backward ends. So the
        first stage (several micro-batches in flight) counts it with the embedding's. Later stages
        get none (Megatron-LM's get_batch) or are the last (one in flight).
        """
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
            engine_memory.model_static_bytes(model), embedding,
            report.after_forward_bytes - layers - embedding, shared,
            engine_memory.model_step_bytes(model))


class _Unencodable:
    """Stands in for a payload when a candidate codec rejects a tensor, keeping the tensor whole."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.nbytes = tensor.untyped_storage().nbytes()


class _CodecProbe:
    """Sits in the runtime where a codec goes: runs the real codec and times its calls.

    Each call is timed on ``spans`` (unless None) where the step makes it: the encode in forward,
    the decode when backward first reads the storage. It keeps what it was given. The times are
    read after the step (``read_times``): on CUDA nothing waits for the calls' events until the
    step is over."""

    def __init__(self, codec, spans: clock.Spans | None):
        self.codec = codec
        self.spans = spans
        self.inputs: list[torch.Tensor] = []
        self.failed = False
        self.encode_s = 0.0
        self.decode_s = 0.0
        self.grown_pages = 0
        self._calls: list[tuple[str, int]] = []     # (encode or decode, span)

    def _run(self, kind: str, fn: Callable[[], object]) -> object:
        # Untimed where only the inputs are wanted.
        if self.spans is None:
            return fn()
        result, span, grown = _timed_on_the_heap(fn, self.spans)
        self.grown_pages += grown
        self._calls.append((kind, span))
        return result

    def encode(self, tensor):
        # Where only the inputs are wanted (the rectifier's samples), a copy: forward-only, the
        # storage of what Megatron's selective recompute checkpoints is freed after forward.
        self.inputs.append(tensor.detach() if self.spans is not None else tensor.detach().clone())
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
        """Sum this probe's calls into ``encode_s`` and ``decode_s`` from the step's spans."""
        for kind, span in self._calls:
            setattr(self, f"{kind}_s", getattr(self, f"{kind}_s") + seconds[span])


class _OutlierCounter:
    """Sits in the runtime where an outlier-separating codec goes, and counts outlier channels.

    It encodes and decodes with the codec, and keeps each given tensor's outlier count. That is a
    device count, read once the step is done, never inside it."""

    def __init__(self, codec, counts: list[torch.Tensor]):
        self.codec = codec
        self.counts = counts

    def encode(self, tensor):
        self.counts.append(self.codec.outlier_count(tensor))
        return self.codec.encode(tensor)

    def decode(self, payload):
        return self.codec.decode(payload)


class MeasuredLayerDone(Exception):
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
        """Forward and backward of the micro-batch with ``decisions``; returns the ruler.

        Args:
            decisions: on the measured layer only, or on each with ``every_layer``. ``install`` may
                then adjust the measured layer's actions.
            backward: False stops the forward once the measured layer is done; nothing after it is
                looked at.
            ruler_type: None means no ruler watches, for steps that only time. Its hooks and counts
                are none of training's.
        Gradients are dropped."""
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
            raise MeasuredLayerDone

        handle = self.layer.register_forward_hook(done)
        try:
            self.loss_fn(self.model, self.batch)
        except MeasuredLayerDone:
            pass
        finally:
            handle.remove()

    def layer_sites(self, ruler: ActivationRuler) -> dict[str, int]:
        return {site: n for (layer, site), n in ruler.report().by_site.items()
                if layer == self.index and site not in site_table.SHARED_SITES}

    # --- codecs ------------------------------------------------------------------------------
    def probed_step(self, decisions: dict[str, Decision], backward: bool = True,
                    timing: bool = True) -> tuple[dict[str, int], dict[str, "_CodecProbe"]]:
        """A step with ``decisions`` on the measured layer, its codecs probed.

        Returns:
            (the layer's bytes per site, a probe per compressed site). The probes time their calls
            if ``timing``."""
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
        """One step with ``decisions`` on every layer; returns outlier counts and payloads.

        Returns:
            (the largest outlier count over the layers of each site whose codec separates outliers,
            the largest payload of each site).
        The counts are read after the step. Tensor- and context-parallel peers get the same,
        their largest."""
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
        return {name: _largest_on_peers(max(int(n) for n in found))
                for name, found in counts.items() if found}, largest

    def codec_costs(self, names: Iterable[str] | Mapping[str, Sequence[str]]
                    ) -> dict[str, list[CodecCost]]:
        """Every candidate codec of each named site, timed in the step on its real tensors.

        - ``names``: sites, or a mapping of each site to the codecs to time (a round each).
        - Times: the median over ``repeats`` steps of a candidate round, after two untimed.
        - Payloads: each at its largest over the layers. An outlier-separating codec's is at the
          capacity of the largest outlier count over the layers (CodecCost.capacity)."""
        candidates = (dict(names) if isinstance(names, Mapping) else
                      {name: site_table.get(name).candidate_codecs for name in names})
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
                        sum(probe.grown_pages for probe in usable.values()))

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
        """The runtime's rebuild when ``names`` are the only recomputed sites, timed in the step.

        It is timed where backward asks for it: the median over ``repeats`` steps."""
        original = self.layer._rebuild
        spans: clock.Spans | None = None
        grown: list[int] = []

        def timed_rebuild(call):
            grown.append(_timed_on_the_heap(lambda: original(call), spans)[2])

        def timed_step():
            nonlocal spans
            spans = clock.Spans(clock.for_device(self.device))
            grown.clear()
            self.step({name: Decision(RECOMPUTE) for name in names}, ruler_type=None)
            return spans.read(), sum(grown)

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
        """What the runtime's hooks add to a step for one layer, with nothing to act on.

        Every layer runs under its hooks, and the step's difference is shared among them: the
        median difference over pairs of steps, stock and hooked in turn, after one pair untimed.
        On a CPU, the steps run on a short slice of the batch (``hook_timing_batch``), so the
        difference is not lost in the noise of the step's arithmetic: 10 x ``repeats`` pairs.
        On a GPU they run on the batch itself, whole steps, and steadier: 2 x ``repeats``."""
        # The hooks are host code run per save and per submodule call. Beside full-size
        # tensors the same code runs on colder caches, so the CPU figure is a lower bound
        # there (about half on the Llama bench shape, docs/decisions.md). On a GPU the host code
        # overlaps the kernels of a large enough layer and hides behind them. One layer's share
        # is too small to time against a whole GPU step: timed on one layer, the H200's
        # Llama-1B profile charged 1.85 ms a layer, and a plan hooking ten layers ran 18.7 ms
        # under its prediction. Hooking them all multiplies the signal, not the step's noise.
        on_gpu = self.device.type == "cuda"
        batch = self.batch if on_gpu else hook_timing_batch(self.batch, self.model.config)
        apply_plan(self.model, Plan(), strict=self.strict)

        def timed_step(hooked: bool) -> float:
            for layer in self.layers:
                layer.force_hooks = hooked
                # Outside the clock: training attaches a hooked layer's submodule hooks once.
                (layer.attributor.attach if hooked else layer.attributor.detach)()
            return self._timed_step(batch)

        differences = []
        try:
            for pair in range(1 + (2 if on_gpu else 10) * max(1, self.repeats)):
                stock = timed_step(False)
                difference = timed_step(True) - stock
                if pair:
                    differences.append(difference)
        finally:
            for layer in self.layers:
                layer.force_hooks = False
            self.model.zero_grad(set_to_none=True)
        return max(0.0, statistics.median(differences) / len(self.layers))

    def _timed_step(self, batch: Batch) -> float:
        """One forward and backward of ``batch`` as the layers are set, timed whole.

        The gradients are dropped before it."""
        self.model.zero_grad(set_to_none=True)
        return timed(lambda: self.loss_fn(self.model, batch).backward(), self.device)[1]

    def step_seconds(self) -> float:
        """A step of the micro-batch with every layer keeping everything (megatron's stock layer).

        It is the median of ``repeats`` steps after one untimed. A plan's step time is predicted
        as this plus the plan's added time."""
        apply_plan(self.model, Plan(), strict=self.strict)
        try:
            times = [self._timed_step(self.batch) for _ in range(1 + max(1, self.repeats))]
        finally:
            self.model.zero_grad(set_to_none=True)
        return statistics.median(times[1:])

    def _steady_steps(self, timed_step: Callable[[], tuple[object, int]]) -> list[object]:
        """The results of ``repeats`` timed steps whose timed calls did not grow the host heap.

        ``timed_step()`` runs one step and returns its result and the pages its calls grew the
        heap by. Such a step runs again, up to ``repeats`` more steps. If fewer than ``repeats``
        steps were steady, it returns those few; if none, the ``repeats`` that grew it least."""
        # A call that grew the heap paid for pages that steps on recycled memory touch once
        # only: one decode of Llama's 32 MiB swiglu_in took 6.5 ms against 1.3. Without
        # recycle_freed_host_memory a call may map fresh pages in every step (36 a step seen in
        # the test suite); the least grown steps then still leave out one that grew more.
        wanted = max(1, self.repeats)
        steady, every = [], []
        for _ in range(2 * wanted):
            result, grown = timed_step()
            grown = self._most_on_any_peer(grown)
            every.append((grown, result))
            if not grown:
                steady.append(result)
                if len(steady) == wanted:
                    break
        if steady:
            return steady
        return [result for _, result in sorted(every, key=lambda step: step[0])[:wanted]]

    def _most_on_any_peer(self, pages: int) -> int:
        """The largest ``pages`` over this rank and its tensor- and context-parallel peers.

        Peers' layers exchange activations in every step, so they must all run the same steps.
        Only CPU steps can grow the host heap, so a CUDA step asks no peer."""
        if self.device.type != "cpu":
            return pages
        # A rank that ran one step more than its peers would wait on them for good.
        return _largest_on_peers(pages)


def hook_timing_batch(batch: Batch, config) -> Batch:
    """One sequence of ``batch``, halved to the shortest prefix that keeps at least 16 tokens.

    The prefix is still split evenly by the model's parallelism: sequence parallelism over the
    tensor-parallel ranks, context parallelism in chunks of 2 x its size."""
    unit = config.tensor_model_parallel_size if config.sequence_parallel else 1
    if config.context_parallel_size > 1:
        unit *= 2 * config.context_parallel_size
    length = batch[0].shape[1]
    while length % 2 == 0 and length // 2 >= 16 and (length // 2) % unit == 0:
        length //= 2
    return tuple(tensor[:1, :length] for tensor in batch)


def _nondecreasing(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence (least squares, pool adjacent violators).

    Prefix times cannot shrink along a segment. Noise that says otherwise is spread over its
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
    """site -> its rebuild time from its segment's start, fitted along the segment in save order."""
    fitted = {}
    for segment in MEGATRON_SEGMENTS:
        measured = [name for name in order
                    if name in prefix_s and site_table.get(name).segment == segment.name]
        fitted.update(zip(measured, _nondecreasing([prefix_s[name] for name in measured])))
    return fitted


@contextlib.contextmanager
def _left_as_found(model: torch.nn.Module):
    """Put back the layers' decisions and dropout RNG streams that profiling steps changed.

    Training then computes exactly what it would have computed without the profiling steps."""
    actions = {layer: layer.actions for layer in adacc_layers(model)}
    try:
        with _fork_rng():
            yield
    finally:
        for layer, saved in actions.items():
            layer.actions = saved


def profile(model: torch.nn.Module, batch: Batch, *, repeats: int = DEFAULT_REPEATS,
            strict: bool = False, loss_fn: LossFn | None = None) -> ModelCosts:
    """Measure ``model`` (built with the Adacc layer spec) on one micro-batch ``batch``.

    Args:
        batch: tokens, labels, loss mask.
        loss_fn: its loss; default ``gpt_loss``.
    The model's decisions, gradients (none) and RNG streams are left as before."""
    with _left_as_found(model):
        return _profile(_Profiling(model, batch, strict, repeats, loss_fn))


def _profile(run: _Profiling) -> ModelCosts:
    model, config = run.model, run.model.config
    started = allocator.allocated(run.device)
    run.step({})  # warm-up: megatron's cached mask, allocator, codec kernels
    with allocator.watch(run.device) as peaks:
        retained = run.step({}, _RetainedRuler)
    memory = retained.stage_memory(model)
    sizes = run.layer_sites(retained)
    order = list(sizes)
    known = [name for name in order if name in site_table.SITES]
    before_codecs = _allocated_live(run.device)
    codec_costs = run.codec_costs(known)
    # What the codec trials leave allocated stays through every step too: the Triton codecs'
    # ticket counters and folded extremes (launch.counters), made once per device and stream.
    # On the H200 channel_int4's for GPT-345M's qkv (3,072 channels) put plans 37,888 B over.
    codecs_kept = max(0, _allocated_live(run.device) - before_codecs)
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
        backward_workspace_bytes=analytic.backward_workspace_bytes(shape, micro_batch),
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
            # the all-retain step's allocator readings (zeros on a CPU), which
            # allocator_overhead_bytes rests on
            "profile_peaks": {"allocated_at_start": started,
                              "allocated_before": peaks.allocated_before,
                              "max_allocated": peaks.max_allocated},
        },
    )
    # What the warm-up left stays through every later step, the optimizer step's too: on the
    # H200, GPT-345M's full recompute peaked in its optimizer step 201 MB over static and the
    # step's own bytes, cuBLAS's two 32 MiB workspaces and megatron's 128 MiB baddbmm buffer.
    return replace(costs, allocator_overhead_bytes=allocator_overhead(costs, peaks),
                   persistent_overhead_bytes=(max(0, peaks.allocated_before - started)
                                              + codecs_kept))


def _allocated_live(device: torch.device) -> int:
    """The bytes in tensors on ``device`` once garbage in reference cycles is collected."""
    if device.type == "cuda":   # a CPU reads zero either way
        gc.collect()
    return allocator.allocated(device)


def stage_memory(model: torch.nn.Module, batch: Batch, *, strict: bool = False,
                 loss_fn: LossFn | None = None) -> planning.StageMemory:
    """What ``model`` holds besides its layers' activations, measured in one all-retain step.

    ``model`` is a pipeline stage built with the Adacc layer spec. Every stage measures its own:
    the embedding is the first stage's, the output layer and loss the last's. One profile of a
    layer serves every stage. Decisions and RNG streams are left as found."""
    with _left_as_found(model):
        run = _Profiling(model, batch, strict, 1, loss_fn)
        return run.step({}, _RetainedRuler).stage_memory(model)


def _largest_on_peers(value: int) -> int:
    """``value``'s largest over this rank and its tensor- and context-parallel peers."""
    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return value
    return model_lib.max_over([value], parallel_state.get_tensor_and_context_parallel_group())[0]


def allocator_overhead(costs: ModelCosts, peaks: allocator.Peaks) -> int:
    """How far the allocator's allocated peak over an all-retain step exceeded the prediction.

    The prediction is the bytes already in tensors when the step began (parameters, buffers, and
    what the warm-up step left: ``persistent_overhead_bytes``) plus the predicted activation peak.
    0 on a CPU (no allocator readings)."""
    # Allocated, not reserved: the budget is held to max_memory_allocated, as every peer
    # method is measured. The caching allocator frees its cached blocks and retries before
    # it fails an allocation, and a reserved peak bounds no plan: on the H200, auto reserved
    # 6.6 GiB past a budget its allocated peak kept.
    if not peaks.max_allocated:
        return 0
    retain_all = [planning.evaluate_layer(costs, {})] * costs.num_layers
    predicted = planning.peak_bytes(costs, retain_all) - costs.static_bytes
    return max(0, peaks.max_allocated - peaks.allocated_before - predicted)


def refresh_action_costs(costs: ModelCosts, model: torch.nn.Module, batch: Batch,
                         layer_decisions: Iterable[dict[str, Decision]], *,
                         repeats: int = DEFAULT_REPEATS, strict: bool = False,
                         loss_fn: LossFn | None = None, step: bool = True) -> ModelCosts:
    """``costs`` with the actions a plan uses re-timed in steps on ``batch``.

    The step watch uses it to correct a plan that ran slower than predicted. It re-times:
    - the encode and decode of each codec the plan compresses a site with. Payloads and
      capacities stay as the costs say: the rectifier follows those, and plans name the capacity.
    - the rebuild of each site the plan recomputes (its segment fitted again with the other sites'
      profiled times), and each operator it runs;
    - with ``step``, ``meta["step_s"]``, the step the plan's added time is predicted on top of.
    Decisions and RNG streams are left as found."""
    decisions = [decision for layer in layer_decisions for decision in layer.items()]
    compressed: dict[str, list[str]] = {}   # site -> the codecs the plan uses there
    for name, decision in sorted(decisions, key=lambda item: item[0]):
        codec = decision.codec_for(name)    # None unless compressing
        if codec is not None and name in site_table.SITES and codec not in compressed.get(name, ()):
            compressed.setdefault(name, []).append(codec)
    recomputed = {name for name, d in decisions if d.action == RECOMPUTE}
    with _left_as_found(model):
        run = _Profiling(model, batch, strict, repeats, loss_fn)
        fresh_codecs = run.codec_costs(compressed)
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
        timed = {"step_s": run.step_seconds()} if step else {}
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
                   meta={**costs.meta, "rebuild_prefix_s": prefix_s, **timed})


@dataclass
class SiteSample:
    """One site of the measured layer compressed in one real step.

    It holds the codec, the tensors the runtime handed it and the payload bytes the ruler
    counted."""

    codec: codecs.Codec
    tensors: list[torch.Tensor]
    payload_bytes: int


def sample_sites(model: torch.nn.Module, batch: Batch, names: Iterable[str], *,
                 strict: bool = False, loss_fn: LossFn | None = None
                 ) -> dict[str, SiteSample]:
    """One forward of ``batch`` up to the measured layer, with ``names`` compressed there.

    Each site uses its designated codec and keeps what the codec was given: the rectifier's view
    of the activations as training moves them. Forward only: the payloads are what forward keeps,
    and without a backward no gradient (nor data-parallel reduction) is touched. Decisions and
    RNG streams are left as found."""
    with _left_as_found(model):
        sizes, probes = _Profiling(model, batch, strict, 1, loss_fn).probed_step(
            {name: Decision(COMPRESS) for name in names}, backward=False, timing=False)
    return {name: SiteSample(probe.codec, probe.inputs, sizes[name])
            for name, probe in probes.items()
            if not probe.failed and probe.inputs and name in sizes}


def model_shape(config, vocab_size: int, seq_length: int, attention_backend: str = "unfused",
                position_embedding_type: str = "learned_absolute") -> analytic.ModelShape:
    """The planner's description of a megatron TransformerConfig (analytic model, ProfileDB key).

    It includes the model's resolved attention backend and its positions, so a Llama layer is
    never served a GPT layer's profile."""
    precision = "bf16" if config.bf16 else "fp16" if config.fp16 else "fp32"
    return analytic.ModelShape(
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
