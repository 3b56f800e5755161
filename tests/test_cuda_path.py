"""Issue 14: the CUDA training path, reproduced on the CPU. Each test fakes the CUDA
behaviour it guards (a device, an NCCL group, the caching allocator)."""
import pytest
import torch
import torch.distributed as dist

from megatron_adacc import data, model as model_lib, trainer
from megatron_adacc.arguments import parse_args
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


def test_the_loss_average_is_reduced_on_the_gpu_for_nccl(nccl_group):
    # This torch has no CUDA: asking for a CUDA tensor is as far as the CPU can follow.
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        trainer._average_over(dist.group.WORLD, 1.5)
    assert nccl_group == []


def test_collectives_on_a_gloo_group_stay_on_the_host(distributed):
    assert model_lib.collective_device(dist.group.WORLD) == torch.device("cpu")
