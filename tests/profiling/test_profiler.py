"""The profiler: measured costs, counted the ruler's way, so the planner's prediction is what
the runtime then keeps."""
import pytest
import torch

from megatron_adacc import planning, policies
from megatron_adacc.common import costs as costs_lib
from megatron_adacc.models import build as model_lib
from megatron_adacc.common.plan import Decision, Plan
from megatron_adacc.profiling.profiler import profile
from megatron_adacc.runtime import apply_plan, measure_step
from megatron_adacc.common.sites import (COMPRESS, OUTLIER_CODEC, QUANTIZE_CODEC, REBUILDS,
                                         RECOMPUTE, SEGMENT_ANCHORS)

from helpers.runtime import batch, build, loss_of, planned_and_measured, touch_fresh_pages

MODELS = {
    "fp32-dropout": lambda: build(True, dropout=0.1),
    "bf16-no-dropout": lambda: build(True, torch.bfloat16, dropout=0.0),
    "fp16-no-dropout": lambda: build(True, torch.float16, dropout=0.0),
}


@pytest.fixture(scope="module", params=list(MODELS))
def profiled(request, distributed):
    model = MODELS[request.param]()
    return model, profile(model, batch(0), repeats=1, strict=True)


def test_a_cpu_profile_has_no_allocator_overhead(profiled):
    # No caching allocator stands between tensors and a CPU's memory.
    assert profiled[1].allocator_overhead_bytes == 0


def test_what_the_warm_up_leaves_allocated_is_kept_apart_from_the_step_excess(monkeypatch,
                                                                              distributed):
    """On a GPU: the buffers a first step makes, and those the codec trials leave, stay through
    the optimizer step; the excess over the all-retain step's prediction is the forward and
    backward's alone."""
    import contextlib
    from dataclasses import replace

    from megatron_adacc.profiling import allocator, profiler

    # The codec trials leave the Triton codecs' counters allocated (on the H200 channel_int4's
    # for a 3,072-channel site, 37,376 B): those stay through every step too.
    started, left, kept = 5_000_000, 201_000, 37_376
    allocated = [started]

    @contextlib.contextmanager
    def watch(device):
        peaks = allocator.Peaks(allocated_before=started + left)
        yield peaks
        peaks.max_allocated = started + left + 10**9      # read once the step has run

    def codec_costs(self, names, trials=profiler._Profiling.codec_costs):
        found = trials(self, names)
        allocated[0] += kept
        return found

    monkeypatch.setattr(profiler.allocator, "allocated", lambda device: allocated[0])
    monkeypatch.setattr(profiler.allocator, "watch", watch)
    monkeypatch.setattr(profiler._Profiling, "codec_costs", codec_costs)
    model = build(True, dropout=0.0)
    costs = profile(model, batch(0), repeats=1, strict=True)
    bare = replace(costs, allocator_overhead_bytes=0, persistent_overhead_bytes=0)
    retain_all = [planning.evaluate_layer(bare, {})] * bare.num_layers
    predicted = planning.peak_bytes(bare, retain_all) - bare.static_bytes
    assert costs.persistent_overhead_bytes == left + kept
    assert costs.allocator_overhead_bytes == 10**9 - predicted


def test_site_bytes_are_the_rulers_for_every_layer(profiled):
    model, costs = profiled
    report = measure_step(model, lambda: loss_of(model), strict=True)[1]
    for layer in range(costs.num_layers):
        got = {s: n for (lay, s), n in report.by_site.items() if lay == layer}
        got.pop("attn_mask", None)  # megatron's cached causal mask: one storage, non-layer
        assert got == {site.name: site.bytes for site in costs.sites}
    assert (costs.embedding_bytes + costs.non_layer_bytes
            + costs.num_layers * costs.layer_bytes) == report.after_forward_bytes
    # The embedding keeps the token ids (int64) and the position ids (one row, expanded).
    tokens = batch(0)[0]
    assert costs.embedding_bytes >= tokens.numel() * 8 + tokens.shape[1] * 8


def test_every_site_has_a_cost_to_each_action(profiled):
    _, costs = profiled
    for site in costs.sites:
        assert site.codecs, site.name
        # The last resort (naive INT4, one scale per row) can outgrow a tensor of one value
        # per row, the LayerNorm statistics: auto offers it only where it keeps fewer bytes
        # than the designated codec (tests/adacc/test_last_resort.py).
        assert all(0 < c.payload_bytes < site.bytes for c in site.codecs
                   if c.codec != QUANTIZE_CODEC), site.name
        assert all(c.payload_bytes > 0 for c in site.codecs), site.name
        if site.name != "layer_in":
            rebuild_s = (costs.operator(site.operator).rebuild_s if site.operator
                         else site.rebuild_s)
            assert site.can_recompute and rebuild_s > 0, site.name
    # What an operator rebuilds, it rebuilds alone: from its sources, no segment re-run.
    assert {site.name: site.operator for site in costs.sites if site.operator} == {
        "ln1_stats": "input_layernorm", "ln1_out": "input_layernorm",
        "ln2_in": "attention_residual",
        "ln2_stats": "pre_mlp_layernorm", "ln2_out": "pre_mlp_layernorm",
        "gelu_out": "mlp.activation_func"}
    saved = {site.name for site in costs.sites}
    assert [(op.name, op.sources) for op in costs.operators] == [
        (edge.call, edge.sources_in(saved)) for edge in REBUILDS   # the GPT layer's edges
        if edge.used_by(saved)]
    # ln2_in from the layer input, the attention output and, with dropout, the kept mask
    assert costs.operator("attention_residual").sources == (
        "layer_in", "context", *(["bda1_mask"] if "bda1_mask" in saved else []))
    # Rebuild times from the segment start: a deeper save is never reached sooner.
    for segment in costs.segments:
        times = [site.rebuild_s for site in costs.sites if site.segment == segment.name]
        assert times and times == sorted(times), segment


def test_cost_segments_are_the_runtimes():
    # The costs describe re-runs starting where the runtime's start (its anchors, in order).
    assert [segment.start for segment in costs_lib.MEGATRON_SEGMENTS] == \
        sorted(SEGMENT_ANCHORS, key=SEGMENT_ANCHORS.get)


@pytest.mark.parametrize("fraction", [0.0, 0.15, 0.4, 0.7, 1.0])
def test_runtime_keeps_exactly_what_the_planner_predicts(profiled, fraction):
    model, costs = profiled
    result, predicted, measured = planned_and_measured(model, costs, fraction)
    print(f"budget {result.budget_bytes}: predicted {predicted}, measured "
          f"{measured.after_forward_bytes}, plan {result.plan.to_dict()}")
    assert measured.after_forward_bytes == predicted


def test_outlier_payloads_keep_exactly_the_planned_bytes(profiled):
    # auto's designated codecs, from their smallest budget up, compress outlier sites: every
    # layer keeps the planned capacity of exact channels, whatever its own outlier count.
    model, costs = profiled
    designated = policies.designated_codecs(costs)
    low = planning.minimum_budget(designated, allow_lossy_sources=False)
    low += costs.num_layers * planning.default_resolution(costs)
    high = planning.plan(designated, 10 * low).references["no optimisation"].peak_bytes
    with_outliers = 0
    for fraction in (0.0, 0.1, 0.2, 0.3, 0.5):
        result = planning.plan(designated, int(low + fraction * (high - low)),
                               allow_lossy_sources=False)
        if not any(decision.codec_for(name) == OUTLIER_CODEC
                   for layer in range(costs.num_layers)
                   for name, decision in result.plan.for_layer(layer).items()):
            continue
        with_outliers += 1
        apply_plan(model, result.plan, strict=True)
        try:
            measured = measure_step(model, lambda: loss_of(model), strict=True)[1]
        finally:
            apply_plan(model, None)
        assert measured.after_forward_bytes == policies.predicted_activation_bytes(costs, result)
    if not with_outliers:  # this profile's timings made recompute cheaper at every budget
        pytest.skip("no plan of these budgets compresses with outlier_int4")


def test_profiling_leaves_decisions_and_random_streams_as_they_were(distributed):
    plan_ = Plan.uniform({"gelu_in": "recompute", "qkv": "compress"})
    twins = [build(True, dropout=0.1) for _ in range(2)]
    for model in twins:
        apply_plan(model, plan_)
    model_lib.set_seed(7)
    expected = loss_of(twins[0])
    model_lib.set_seed(7)
    profile(twins[1], batch(1), repeats=1)
    assert all(p.grad is None for p in twins[1].parameters())
    assert torch.equal(loss_of(twins[1]), expected)
    layer_actions = [layer.actions for layer in twins[1].decoder.layers]
    assert all(a["gelu_in"][0] == RECOMPUTE and a["qkv"][0] == COMPRESS for a in layer_actions)


def test_the_runtime_reruns_what_the_planner_charges(distributed, monkeypatch):
    """The planner charges each re-run from its first segment's start to its deepest
    recomputed site, its earlier segments whole (planning.rerun_chains), and an operator's own
    call for what an operator rebuilds (planning.rebuild_charges): the runtime re-saves
    exactly those sites."""
    from megatron_adacc.runtime.storage import LayerCall

    model = build(True, dropout=0.1)
    resaved = []
    capture = LayerCall.capture_pack

    def spy(call, tensor):
        if call.layer_index == 0 and not isinstance(tensor, torch.nn.Parameter):
            resaved.append(call.attributor.site_of(tensor))
        return capture(call, tensor)

    monkeypatch.setattr(LayerCall, "capture_pack", spy)
    forward = measure_step(model, lambda: loss_of(model), strict=True)[1]
    order = list(dict.fromkeys(s for (layer, s), _ in forward.by_site.items() if layer == 0))

    def run(first, last):
        return order[order.index(first):order.index(last) + 1]

    # (recomputed, what the runtime re-saves, the re-runs the planner charges)
    segment_runs = [(["context"], run("layer_in", "context"), [[0]]),
                    (["gelu_in"], run("ln2_in", "gelu_in"), [[1]]),
                    # two re-runs: the attention's stops at the context, the MLP's starts
                    # from the ln2_in kept
                    (["context", "gelu_in"], run("layer_in", "context") + run("ln2_in", "gelu_in"),
                     [[0], [1]]),
                    # one: ln2_in recomputed too, the attention runs whole into the MLP
                    (["context", "ln2_in", "gelu_in"], run("layer_in", "gelu_in"), [[0, 1]])]
    operators = [(["gelu_out"], [], []),                        # the activation saves nothing
                 (["ln1_out"], [], []),
                 (["ln1_stats"], ["layer_in", "ln1_stats"], []),  # the norm, for its statistics
                 (["gelu_out", "gelu_in"], run("ln2_in", "gelu_in"), [[1]])]
    costs = profile(model, batch(0), repeats=1, strict=True)
    for recomputed, expected, chains in segment_runs + operators:
        resaved.clear()
        apply_plan(model, Plan(layers={(0, 0): {s: Decision(RECOMPUTE) for s in recomputed}}))
        try:
            loss_of(model).backward()
        finally:
            apply_plan(model, None)
        assert list(dict.fromkeys(resaved)) == expected, recomputed
        assert planning.rerun_chains(costs, set(recomputed)) == chains, recomputed


def test_a_rebuild_is_timed_where_backward_asks_once_a_step(distributed, monkeypatch):
    """The profiler times the rebuild training pays for (its sources read cold), not repeats
    of it on the spot: each timed step's layer call rebuilds once, for ``repeats`` steps,
    and an operator's steps recompute every product of it (the norm saves its statistics
    as it runs, so it runs with grad, as the plans that recompute them run it)."""
    from megatron_adacc.runtime.storage import LayerCall

    kept: list[tuple[LayerCall, tuple]] = []
    keep = LayerCall.keep

    def spy(call, key, tensor):
        kept.append((call, key))
        return keep(call, key, tensor)

    monkeypatch.setattr(LayerCall, "keep", spy)
    profile(build(True, dropout=0.1), batch(0), repeats=3, strict=True)
    for product in ("ln1_out", "ln1_stats"):  # LayerNorm saves two statistics (two keys)
        rebuilt = [(id(call), key) for call, key in kept if key[0] == product]
        assert len(rebuilt) == len(set(rebuilt)), product  # no key rebuilt twice in a call
        assert len({call for call, _ in rebuilt}) == 3, product


def test_codecs_are_timed_on_the_calls_the_step_makes(distributed, monkeypatch):
    """Every encode and decode the profiler makes is one the runtime's step makes (the encode
    in forward, the decode when backward reads the storage), never a re-run of it on the
    spot, whose warm caches made decodes look about twice as fast as training pays."""
    from megatron_adacc.codecs.codec import Codec
    from megatron_adacc.runtime.storage import CompressedStorage

    inside = [False]
    calls = {"in the step": 0, "re-run": 0}

    def spy_codec(method):
        def call(self, *args):
            calls["in the step" if inside[0] else "re-run"] += 1
            return method(self, *args)
        return call

    def spy_storage(method):
        def call(self, *args):
            inside[0] = True
            try:
                return method(self, *args)
            finally:
                inside[0] = False
        return call

    for cls, name, spy in ((Codec, "encode", spy_codec), (Codec, "decode", spy_codec),
                           (CompressedStorage, "__init__", spy_storage),
                           (CompressedStorage, "read", spy_storage)):
        monkeypatch.setattr(cls, name, spy(getattr(cls, name)))
    costs = profile(build(True, dropout=0.1), batch(0), repeats=2, strict=True)
    assert calls["re-run"] == 0 and calls["in the step"] > 0
    assert all(codec.decode_s > 0 for site in costs.sites for codec in site.codecs)


def test_a_codec_rounds_first_step_is_not_timed(distributed, monkeypatch):
    """Each candidate round runs its first steps untimed: in a fresh process they grow the
    host heap, and their page faults are not what training pays."""
    import time
    from megatron_adacc.codecs.codec import Codec

    slowed: set[str] = set()
    decode = Codec.decode

    def first_decode_of_each_codec_slow(self, payload):
        if self.name not in slowed:  # a round's first step is the first to use its codec
            slowed.add(self.name)
            time.sleep(0.05)
        return decode(self, payload)

    monkeypatch.setattr(Codec, "decode", first_decode_of_each_codec_slow)
    costs = profile(build(True, dropout=0.1), batch(0), repeats=1, strict=True)
    timed = [codec for site in costs.sites for codec in site.codecs]
    assert slowed and {codec.codec for codec in timed} >= slowed
    assert all(codec.decode_s < 0.05 for codec in timed)


def test_an_outlier_sites_capacity_is_its_largest_outlier_count_over_the_layers(distributed):
    """Outlier channels differ from layer to layer: the profile makes each outlier site's
    capacity the largest count any layer has (read after the step), and every payload is
    then fixed by its shape and that capacity, so every layer of a plan keeps exactly what
    the planner counts."""
    model = build(True, dropout=0.0, layers=3)
    # outlier channels in the first layer's MLP only; the profile measures the second
    with torch.no_grad():
        model.decoder.layers[0].mlp.linear_fc1.weight[:3] *= 50
    costs = profile(model, batch(0), repeats=1, strict=True)
    capacities = {site.name: cost.capacity for site in costs.sites for cost in site.codecs
                  if cost.codec == "outlier_int4"}
    assert capacities and all(isinstance(c, int) for c in capacities.values())
    assert capacities["gelu_in"] >= 3  # the first layer's planted channels, not the second's
    assert all(cost.capacity is None for site in costs.sites for cost in site.codecs
               if cost.codec != "outlier_int4")
    for codec in ("outlier_int4", "sym_int4"):
        charged = {site.name: cost for site in costs.sites for cost in site.codecs
                   if cost.codec == codec}
        apply_plan(model, Plan(layers={(0, 2): {name: Decision(COMPRESS, codec, cost.capacity)
                                                for name, cost in charged.items()}}), strict=True)
        kept = measure_step(model, lambda: loss_of(model, 0), strict=True)[1].by_site
        model.zero_grad(set_to_none=True)
        for name, cost in charged.items():
            per_layer = [kept[(layer, name)] for layer in range(3)]
            assert per_layer == [cost.payload_bytes] * 3, (codec, name, per_layer)
    apply_plan(model, None)


@pytest.mark.parametrize("every_step_pages", [0, 24], ids=["recycled", "mapped-each-step"])
def test_a_timed_step_that_grew_the_heap_is_run_again(distributed, monkeypatch,
                                                      every_step_pages):
    """A timed call that first-touched fresh host pages paid for heap growth that steps on
    recycled memory pay once only: its step is run again. Here every other step is slow in
    each decode and each rebuilt value, and first-touches 256 fresh pages there; with two
    timed steps wanted, two steps in a row would put the median half way to slow. Where every
    step grows the heap (memory mapped afresh each step), the least grown steps are kept."""
    import time
    import types

    from megatron_adacc.codecs.codec import Codec
    from megatron_adacc.profiling import clock
    from megatron_adacc.profiling.profiler import gpt_loss
    from megatron_adacc.runtime.storage import LayerCall

    # A slow call moves the profiler's clock on instead of sleeping: its steps are slow by
    # exactly slow_s, however busy the cores are. Real decodes and rebuilds take milliseconds.
    slow_s, pages = 0.15, 256
    steps, skipped = [0], [0.0]
    monkeypatch.setattr(clock, "time", types.SimpleNamespace(
        perf_counter=lambda: time.perf_counter() + skipped[0]))

    def counting_loss(model, micro_batch):
        steps[0] += 1
        return gpt_loss(model, micro_batch)

    def slow_and_growing_in_odd_steps(method):
        def call(*args):
            if every_step_pages:
                touch_fresh_pages(every_step_pages)
            if steps[0] % 2:
                touch_fresh_pages(pages)
                skipped[0] += slow_s
            return method(*args)
        return call

    monkeypatch.setattr(Codec, "decode", slow_and_growing_in_odd_steps(Codec.decode))
    monkeypatch.setattr(LayerCall, "keep", slow_and_growing_in_odd_steps(LayerCall.keep))
    costs = profile(build(True, dropout=0.1), batch(0), repeats=2, strict=True,
                    loss_fn=counting_loss)
    decodes = [codec.decode_s for site in costs.sites for codec in site.codecs]
    rebuilds = ([site.rebuild_s for site in costs.sites if site.segment]
                + [op.rebuild_s for op in costs.operators])
    assert decodes and rebuilds
    assert max(decodes) < slow_s / 2 and max(rebuilds) < slow_s / 2, (decodes, rebuilds)


def test_the_hooks_are_timed_on_every_layer_keeping_everything(distributed, monkeypatch):
    """hooked_layer_s: one untimed and 10 x ``repeats`` timed steps run every layer under its
    hooks with nothing to act on (the same number stock), each on one short sequence."""
    from megatron_adacc.runtime.storage import LayerCall

    idle_calls: list[tuple[int, tuple]] = []
    step_tokens = []
    init = LayerCall.__init__

    def spy(call, layer_index, attributor, actions, ruler, rebuild):
        init(call, layer_index, attributor, actions, ruler, rebuild)
        if not actions:
            idle_calls.append((layer_index, step_tokens[-1]))

    def recording_loss(model, micro_batch):
        step_tokens.append(tuple(micro_batch[0].shape))
        return model_lib.gpt_loss(model, *micro_batch)

    monkeypatch.setattr(LayerCall, "__init__", spy)
    model = build(True, dropout=0.1)
    profile(model, batch(0), repeats=2, strict=True, loss_fn=recording_loss)
    layers = len(model.decoder.layers)
    assert len(idle_calls) == (1 + 10 * 2) * layers
    assert set(idle_calls) == {(index, (1, 16)) for index in range(layers)}
    assert step_tokens.count((1, 16)) == 2 * (1 + 10 * 2)
    assert not any(layer.force_hooks for layer in model.decoder.layers)


def test_a_layers_hook_time_is_the_hooked_steps_excess_shared_among_its_layers(distributed):
    """Each layer under its hooks adds 0.5 ms to a stand-in step clock: hooked_layer_seconds
    finds 0.5 ms, not the excess of the whole step (every layer hooked)."""
    from megatron_adacc.profiling import profiler

    model = build(True, layers=4)
    run = profiler._Profiling(model, batch(0), True, repeats=1)
    run._timed_step = lambda _batch: 1.0 + 5e-4 * sum(
        layer.force_hooks for layer in model.decoder.layers)
    assert run.hooked_layer_seconds() == pytest.approx(5e-4)


def test_on_a_gpu_the_hooks_are_timed_on_whole_steps_in_fewer_pairs(distributed):
    """A GPU times the hooks on the batch itself, each step a whole one: 1 + 2 x repeats pairs
    (a CPU's short slices take 1 + 10 x repeats)."""
    from megatron_adacc.profiling import profiler

    model = build(True, layers=2)
    run = profiler._Profiling(model, batch(0), True, repeats=3)
    run.device = torch.device("cuda")  # only its type is read: nothing runs on it
    steps = []
    run._timed_step = lambda step_batch: steps.append(step_batch[0].shape) or 1.0
    run.hooked_layer_seconds()
    assert steps == [batch(0)[0].shape] * 2 * (1 + 2 * 3)


@pytest.mark.parametrize("seq, tp, sp, cp, expected", [
    (32, 1, False, 1, 16),      # halved down to 16 tokens
    (96, 1, False, 1, 24),      # 12 would be under 16
    (100, 1, False, 1, 25),     # odd: no further halving
    (256, 4, True, 1, 16),      # sequence parallel over 4 ranks: 16 splits evenly
    (256, 4, True, 4, 32),      # and context parallel in 8 chunks: 32 tokens at least
    (256, 4, False, 1, 16),     # without sequence parallelism the ranks share the sequence
])
def test_the_hooks_are_timed_on_the_shortest_sequence_the_parallelism_splits(seq, tp, sp, cp,
                                                                              expected):
    from types import SimpleNamespace

    from megatron_adacc.profiling.profiler import hook_timing_batch

    config = SimpleNamespace(tensor_model_parallel_size=tp, sequence_parallel=sp,
                             context_parallel_size=cp)
    tokens = torch.arange(3 * seq).view(3, seq)
    short = hook_timing_batch((tokens, tokens + 1, torch.ones(3, seq)), config)
    assert [tuple(tensor.shape) for tensor in short] == [(1, expected)] * 3
    assert torch.equal(short[0], tokens[:1, :expected])
    assert torch.equal(short[1], tokens[:1, :expected] + 1)
