"""What the runtime meets on CUDA and not in a plain CPU run, emulated on the CPU.

- Megatron's bias-dropout-add draws its masks from the default CUDA generator; attention
  dropout draws from it too, but inside the tensor-parallel tracker's fork, which swaps the
  tracker's state into it. On the CPU both draw from the CPU generator, so a recompute that
  forgot the CUDA generator would still pass every other test.
- CUDA dropout is `torch.native_dropout`, whose backward saves a bool mask (CPU dropout saves
  a float mask of 0 and 1/(1-p)).
- NVIDIA's images ship apex, and megatron's local spec then uses apex's FusedLayerNorm, which
  saves its statistics as 1-D [s*b] fp32 tensors.
"""
import pytest
import torch

from megatron_adacc import model as model_lib
from megatron_adacc.runtime import apply_plan

from runtime_helpers import build, loss_of, train
from test_runtime import PLANS, assert_same_training



@pytest.fixture
def cuda_dropout(monkeypatch):
    """Dropout as on CUDA: `native_dropout` (bool masks) drawing from a generator that stands
    for the default CUDA generator, which megatron's tracker forks exactly as it forks the
    real one (through `_get_cuda_rng_state`/`_set_cuda_rng_state`). Seeding seeds it too, as
    `torch.manual_seed` seeds the CUDA generators."""
    from megatron.core.tensor_parallel import random as mrandom

    cuda_generator = torch.Generator()
    monkeypatch.setattr(mrandom, "_get_cuda_rng_state",
                        lambda *args, **kwargs: cuda_generator.get_state())
    monkeypatch.setattr(mrandom, "_set_cuda_rng_state",
                        lambda state, *args, **kwargs: cuda_generator.set_state(state))

    set_seed = model_lib.set_seed

    def seed_every_generator(seed):
        set_seed(seed)
        cuda_generator.manual_seed(seed)

    monkeypatch.setattr(model_lib, "set_seed", seed_every_generator)

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        # native_dropout takes no generator: lend it the stand-in's state for this one draw.
        cpu_state = torch.get_rng_state()
        torch.set_rng_state(cuda_generator.get_state())
        try:
            return torch.native_dropout(input, p, True)[0]
        finally:
            cuda_generator.set_state(torch.get_rng_state())
            torch.set_rng_state(cpu_state)

    monkeypatch.setattr(torch.nn.functional, "dropout", dropout)
    return cuda_generator


# --- 1. recompute restores the default CUDA generator ---------------------------------------

@pytest.mark.parametrize("plan", ["mixed", "recompute_all", "mlp_only"])
def test_recompute_with_cuda_dropout_matches_stock_layer_bitwise(distributed, cuda_dropout, plan):
    stock = train(build(False, dropout=0.1), steps=2)
    model = build(True, dropout=0.1)
    apply_plan(model, PLANS[plan], strict=True)
    assert_same_training(stock, train(model, steps=2))


def test_recompute_leaves_the_generators_where_backward_found_them(distributed, cuda_dropout):
    model = build(True, dropout=0.1)
    apply_plan(model, PLANS["recompute_all"], strict=True)
    loss = loss_of(model)
    before = cuda_dropout.get_state(), torch.get_rng_state()
    loss.backward()
    assert torch.equal(cuda_dropout.get_state(), before[0])
    assert torch.equal(torch.get_rng_state(), before[1])
