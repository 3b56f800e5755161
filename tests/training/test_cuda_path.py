"""Issue 14: the CUDA training path, reproduced on the CPU. Each test fakes the CUDA
behaviour it guards (a device, an NCCL group, the caching allocator)."""
import pytest
import torch
import torch.distributed as dist

from megatron_adacc import Adacc, megatron_lm
from megatron_adacc.models import build as model_lib
from helpers.pretrain import pretrain


def test_adaccs_batches_are_built_where_the_model_lives():
    # "meta" stands for the GPU: a batch left on the host would be on "cpu". Megatron-LM's
    # forward_step puts the loop's own batches on the GPU (get_batch_on_this_tp_rank);
    # Adacc's profiling and tracking batches follow the model.
    model = torch.nn.Linear(2, 2, device="meta")
    loader = {"tokens": torch.zeros(2, 8, dtype=torch.long),
              "labels": torch.zeros(2, 8, dtype=torch.long), "loss_mask": torch.ones(2, 8),
              "position_ids": torch.arange(8).repeat(2, 1),
              "attention_mask": torch.ones(2, 1, 8, 8, dtype=torch.bool)}
    batch = megatron_lm.batch_tuple(loader, model)
    assert [t.device.type for t in batch] == ["meta"] * 3
    session = megatron_lm.Session.__new__(megatron_lm.Session)
    session.step_batch = loader
    full = session.loader_batch(batch)
    assert {t.device.type for t in full.values()} == {"meta"}
    # The profiler's shorter batches get the loader's fields cut to their shape.
    short = session.loader_batch(tuple(t[:1, :4] for t in batch))
    assert full["attention_mask"].shape == (2, 1, 8, 8)
    assert short["attention_mask"].shape == (1, 1, 4, 4)
    assert short["position_ids"].shape == (1, 4)


@pytest.fixture
def nccl_group(distributed, monkeypatch):
    """The world group posing as NCCL: its collectives reject host tensors, as NCCL does."""
    reduced = []

    def all_reduce(tensor, *args, **kwargs):
        if tensor.device.type == "cpu":
            raise RuntimeError("No backend type associated with device type cpu")
        reduced.append(tensor)

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    return reduced


def test_collectives_on_an_nccl_group_use_the_current_cuda_device(nccl_group):
    assert model_lib.collective_device(dist.group.WORLD) == torch.device("cuda", 2)


def test_the_sessions_collectives_take_their_groups_devices(distributed, monkeypatch):
    # The set-up's all-reduce and the pipeline's loss broadcast once made host tensors, which
    # NCCL refuses: every multi-GPU run would have failed at its first step.
    from megatron.core import parallel_state

    asked, given = [], []
    monkeypatch.setattr(model_lib, "collective_device",
                        lambda group=None: asked.append(group) or torch.device("cpu"))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, **kwargs: given.append(
        (kwargs.get("group"), tensor.device)))
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src, group=None: given.append(
        (group, tensor.device)))
    assert model_lib.max_over([3, 4]) == [3, 4]
    pipeline = object()
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_last_rank", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_group", lambda: pipeline)
    assert megatron_lm._from_last_stage(torch.tensor(2.5)) == 2.5
    assert asked == [None, pipeline]
    assert given == [(None, torch.device("cpu")), (pipeline, torch.device("cpu"))]


def test_collectives_on_a_gloo_group_stay_on_the_host(distributed):
    assert model_lib.collective_device(dist.group.WORLD) == torch.device("cpu")


@pytest.fixture
def fake_allocator(monkeypatch):
    """torch.cuda's allocator readings, scripted: each reset of the peak statistics starts a
    new step whose peaks are 100 x its number (allocated) and 1000 x (reserved)."""
    state = {"resets": 0, "waits": 0}

    def reset(device=None):
        state["resets"] += 1

    def synchronize(device=None):
        state["waits"] += 1

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 7)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device=None: 100 * state["resets"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved",
                        lambda device=None: 1000 * state["resets"])
    return state


def test_metrics_carry_the_allocators_peaks_reset_every_step(fake_allocator, monkeypatch):
    real = Adacc.setup

    def setup(adacc, *args, **kwargs):
        result = real(adacc, *args, **kwargs)
        # Where the allocator is read; the model stays put.
        megatron_lm.session().device = torch.device("cuda", 0)
        fake_allocator["resets"] = 0
        return result

    monkeypatch.setattr(Adacc, "setup", setup)
    records = pretrain("--train-iters", "2").records
    assert [(r["max_memory_allocated"], r["max_memory_reserved"]) for r in records] == \
        [(100, 1000), (200, 2000)]
    assert [r["memory_allocated_before"] for r in records] == [7, 7]   # held as a step began
    assert fake_allocator["resets"] == 2
    assert fake_allocator["waits"] == 0   # the readings are the host's: no step waits on them


def test_no_allocator_numbers_on_a_cpu():
    (record,) = pretrain("--train-iters", "1").records
    assert "max_memory_allocated" not in record and "max_memory_reserved" not in record


def test_the_profiled_allocator_overhead_is_what_the_all_retain_peak_exceeds(fake_allocator):
    from megatron_adacc import planning
    from megatron_adacc.profiling import allocator
    from megatron_adacc.planning import analytic
    from megatron_adacc.profiling import profiler

    costs = analytic.analytic_costs(analytic.ModelShape(2, 64, 4, 32, 256), 2, "a100-80gb")
    retain_all = [planning.evaluate_layer(costs, {})] * costs.num_layers
    predicted = planning.peak_bytes(costs, retain_all) - costs.static_bytes
    with allocator.watch(torch.device("cuda", 0)) as peaks:
        pass
    assert peaks == allocator.Peaks(allocated_before=7, max_allocated=100, max_reserved=1000)
    # The allocated peak, the ruler every method is held to; cached blocks do not count.
    cached = 10 * predicted
    over = allocator.Peaks(allocated_before=5000, max_allocated=5000 + predicted + 777,
                           max_reserved=5000 + predicted + cached)
    assert profiler.allocator_overhead(costs, over) == 777
    under = allocator.Peaks(allocated_before=5000, max_allocated=5000 + predicted - 1,
                            max_reserved=5000 + predicted + cached)
    assert profiler.allocator_overhead(costs, under) == 0
    assert profiler.allocator_overhead(costs, allocator.Peaks()) == 0  # a CPU


@pytest.mark.parametrize("term", ["allocator_overhead_bytes", "persistent_overhead_bytes"])
def test_plans_carry_the_allocator_overhead(distributed, term):
    from dataclasses import replace

    from megatron_adacc import planning
    from megatron_adacc.common import costs as costs_lib
    from megatron_adacc.planning import analytic

    costs = analytic.analytic_costs(analytic.ModelShape(2, 64, 4, 32, 256), 2, "a100-80gb")
    costs = replace(costs, optimizer_step_bytes=0)   # the forward and backward set the peak
    padded = replace(costs, **{term: 777})
    assert costs_lib.ModelCosts.from_json(padded.to_json()) == padded
    retain_all = [planning.evaluate_layer(costs, {})] * costs.num_layers
    assert planning.peak_bytes(padded, retain_all) == planning.peak_bytes(costs, retain_all) + 777
    assert planning.minimum_budget(padded) == planning.minimum_budget(costs) + 777
    budget = planning.minimum_budget(padded)
    with pytest.raises(planning.InfeasibleBudget):
        planning.plan(padded, budget - 1)
    assert planning.plan(padded, budget).peak_bytes <= budget


def test_the_optimizer_step_holds_what_the_first_step_left_not_the_backward_excess(distributed):
    """On the H200, GPT-345M's full recompute peaked in its optimizer step at static + the
    step's bytes + what its first step left (cuBLAS's workspaces, megatron's baddbmm buffer),
    without the forward and backward's excess: Adacc refused that budget when it charged both."""
    from dataclasses import replace

    from megatron_adacc import planning
    from megatron_adacc.planning import analytic

    costs = analytic.analytic_costs(analytic.ModelShape(2, 64, 4, 32, 256), 2, "a100-80gb")
    least = planning.minimum_budget(replace(costs, optimizer_step_bytes=0))
    step = 10 * (least - costs.static_bytes)     # well above any plan's forward and backward
    costs = replace(costs, optimizer_step_bytes=step, allocator_overhead_bytes=999,
                    persistent_overhead_bytes=777)
    retain_all = [planning.evaluate_layer(costs, {})] * costs.num_layers
    expected = costs.static_bytes + 777 + step + costs.held_non_layer_bytes
    assert planning.peak_bytes(costs, retain_all) == expected
    assert planning.minimum_budget(costs) == expected
    assert planning.plan(costs, expected).peak_bytes == expected


def test_the_default_budget_is_what_the_process_may_still_use(monkeypatch):
    from megatron_adacc import policies
    from megatron_adacc.profiling import allocator

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * gib)
    assert allocator.BUDGET_MARGIN_BYTES == gib
    assert policies.default_budget() == 12 * gib


def test_release_frees_the_last_runs_model_for_the_next_run_in_the_process():
    # gpu_check trains many runs in one process; each run's peak must not carry the last
    # run's model and optimizer (on the H200 they added 7 GiB to every GPT-345M run after
    # the first).
    import gc
    import weakref

    from megatron.training import training

    session = pretrain("--train-iters", "1")
    model = weakref.ref(session.adacc.model)
    del session
    gc.collect()
    assert model() is not None        # the session keeps it for whoever asks
    megatron_lm.release()
    gc.collect()
    assert model() is None
    assert megatron_lm.session() is None
    assert not hasattr(training.train_step, "__wrapped_by_adacc__")


def test_a_run_gives_megatron_lms_loop_its_own_functions_back():
    # A later caller of Megatron-LM's loop in the process met the last run's wrappers: a test
    # that patched train_step after another run called into that run's finished session
    # ("Adacc.measure(): call setup() first").
    from megatron.training import training

    own = {name: getattr(training, name) for name in megatron_lm._WRAPPED}
    session = pretrain("--train-iters", "1", "--adacc-policy", "full-recompute")
    assert {name: getattr(training, name) for name in megatron_lm._WRAPPED} == own
    assert megatron_lm.session() is session and len(session.records) == 1
