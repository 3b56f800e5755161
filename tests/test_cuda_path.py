"""Issue 14: the CUDA training path, reproduced on the CPU. Each test fakes the CUDA
behaviour it guards (a device, an NCCL group, the caching allocator)."""
import pytest
import torch
import torch.distributed as dist

from megatron_adacc.training import data
from megatron_adacc.models import build as model_lib
from megatron_adacc.training import trainer
from megatron_adacc.training.arguments import parse_args
from test_trainer import TINY


def test_batches_are_built_where_the_model_lives(distributed, monkeypatch):
    # "meta" stands for the GPU: a batch left on the host would be on "cpu".
    real_build = trainer.build_model
    monkeypatch.setattr(trainer, "build_model", lambda *a: real_build(*a).to("meta"))
    args = parse_args(TINY + ["--train-iters", "1", "--eval-interval", "1",
                              "--eval-iters", "1"])
    _, train, valid = trainer.build_model_and_data(args)
    assert [t.device.type for t in trainer.first_micro_batch(train)] == ["meta"] * 3
    assert {t.device.type for t in next(valid.micro_batches(0)).values()} == {"meta"}


def test_a_batch_reaches_a_gpu_through_pinned_memory_without_blocking(monkeypatch):
    copies = []

    class Pinned:
        def to(self, device, non_blocking=False):
            copies.append((device, non_blocking))
            return "on the device"

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: Pinned())
    assert data.to_device(torch.zeros(2), torch.device("cuda", 3)) == "on the device"
    assert copies == [(torch.device("cuda", 3), True)]


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only torch: follows the NCCL path "
                    "up to the CUDA allocation")
def test_the_loss_average_is_reduced_on_the_gpu_for_nccl(nccl_group):
    # This torch has no CUDA: asking for a CUDA tensor is as far as the CPU can follow.
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        trainer._average_over(dist.group.WORLD, 1.5)
    assert nccl_group == []


def test_collectives_on_a_gloo_group_stay_on_the_host(distributed):
    assert model_lib.collective_device(dist.group.WORLD) == torch.device("cpu")


@pytest.fixture
def fake_allocator(monkeypatch):
    """torch.cuda's allocator readings, scripted: each reset of the peak statistics starts a
    new step whose peaks are 100 x its number (allocated) and 1000 x (reserved)."""
    state = {"resets": 0}

    def reset(device=None):
        state["resets"] += 1

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 7)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device=None: 100 * state["resets"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved",
                        lambda device=None: 1000 * state["resets"])
    return state


def test_metrics_carry_the_allocators_peaks_reset_every_step(distributed, fake_allocator):
    t = trainer.Trainer(parse_args(TINY + ["--train-iters", "2"]))
    t.device = torch.device("cuda", 0)  # where the allocator is read; the model stays put
    records = t.train()
    assert [(r["max_memory_allocated"], r["max_memory_reserved"]) for r in records] == \
        [(100, 1000), (200, 2000)]
    assert fake_allocator["resets"] == 2


def test_no_allocator_numbers_on_a_cpu(distributed):
    (record,) = trainer.Trainer(parse_args(TINY + ["--train-iters", "1"])).train()
    assert "max_memory_allocated" not in record and "max_memory_reserved" not in record


def test_the_profiled_allocator_overhead_is_what_the_all_retain_peak_exceeds(fake_allocator):
    from megatron_adacc import planning
    from megatron_adacc.profiling import allocator
    from megatron_adacc.profiling import hardware
    from megatron_adacc.profiling import profiler

    costs = hardware.analytic_costs(hardware.ModelShape(2, 64, 4, 32, 256), 2, "a100-80gb")
    retain_all = [planning.evaluate_layer(costs, {})] * costs.num_layers
    predicted = planning.peak_bytes(costs, retain_all) - costs.static_bytes
    with allocator.watch(torch.device("cuda", 0)) as peaks:
        pass
    assert peaks == allocator.Peaks(allocated_before=7, max_allocated=100, max_reserved=1000)
    over = allocator.Peaks(allocated_before=5000, max_reserved=5000 + predicted + 777)
    assert profiler.allocator_overhead(costs, over) == 777
    under = allocator.Peaks(allocated_before=5000, max_reserved=5000 + predicted - 1)
    assert profiler.allocator_overhead(costs, under) == 0
    assert profiler.allocator_overhead(costs, allocator.Peaks()) == 0  # a CPU


def test_plans_carry_the_allocator_overhead(distributed):
    from dataclasses import replace

    from megatron_adacc import planning
    from megatron_adacc.common import costs as costs_lib
    from megatron_adacc.profiling import hardware

    costs = hardware.analytic_costs(hardware.ModelShape(2, 64, 4, 32, 256), 2, "a100-80gb")
    padded = replace(costs, allocator_overhead_bytes=777)
    assert costs_lib.ModelCosts.from_json(padded.to_json()) == padded
    retain_all = [planning.evaluate_layer(costs, {})] * costs.num_layers
    assert planning.peak_bytes(padded, retain_all) == planning.peak_bytes(costs, retain_all) + 777
    assert planning.minimum_budget(padded) == planning.minimum_budget(costs) + 777
    budget = planning.minimum_budget(padded)
    with pytest.raises(planning.InfeasibleBudget):
        planning.plan(padded, budget - 1)
    assert planning.plan(padded, budget).peak_bytes <= budget


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
