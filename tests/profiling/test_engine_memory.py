"""The optimizer step's workspace: torch's Adam(W) makes one on its foreach path alone."""
import pytest
import torch

from helpers.storages import LiveBytes
from megatron_adacc.profiling import engine_memory


def _adamw(**path) -> torch.optim.AdamW:
    torch.manual_seed(0)
    groups = [[torch.nn.Parameter(torch.randn(100, 30)), torch.nn.Parameter(torch.randn(7))],
              [torch.nn.Parameter(torch.randn(40, 30))]]
    for param in (p for group in groups for p in group):
        param.grad = torch.randn_like(param)
    return torch.optim.AdamW([{"params": group, "weight_decay": decay}
                              for group, decay in zip(groups, (0.1, 0.0))], lr=1e-3, **path)


@pytest.mark.parametrize("path, workspace", [({"foreach": True}, (100 * 30 + 7) * 4),
                                             ({"foreach": False}, 0), ({"fused": True}, 0),
                                             ({}, 0)])  # a CPU's default: single-tensor
def test_adams_workspace_is_its_largest_foreach_groups_second_moments(path, workspace):
    optimizer = _adamw(**path)
    optimizer.step()  # Adam makes its state in the first step
    assert engine_memory.adam_workspace_bytes(optimizer) == workspace
    with LiveBytes() as live:
        optimizer.step()
    if workspace:
        assert live.peak == workspace
    else:  # the single-tensor path's temporaries are a parameter or two, not a group
        assert live.peak <= 2 * 100 * 30 * 4


def test_an_optimizer_that_is_not_adam_has_no_workspace():
    param = torch.nn.Parameter(torch.randn(10))
    assert engine_memory.adam_workspace_bytes(torch.optim.SGD([param], lr=0.1,
                                                              foreach=True)) == 0


def test_a_wrapper_other_than_megatrons_ddp_is_read_for_parameters_and_state_alone():
    # An FSDP wrapper is a Module without DistributedDataParallel's buffer lists: reading them
    # failed (``chunk.buffers`` is Module.buffers there). Policy none still reads the engine.
    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    linear = torch.nn.Linear(4, 4)
    optimizer = type("Megatron", (), {"optimizer": torch.optim.Adam(linear.parameters())})()
    params = (16 + 4) * 4                   # the weight and bias, the optimizer's main params
    adam = 2 * (16 + 4) * 4 + 2 * 4         # two moments and a step count each
    assert engine_memory.engine_static_bytes([Wrapper(linear)], optimizer) == params + adam
    # Before the first step Adam's state is still to come; after it, held.
    assert engine_memory.engine_bytes([Wrapper(linear)], optimizer)[0] == params
    linear(torch.randn(2, 4)).sum().backward()
    optimizer.optimizer.step()
    assert engine_memory.engine_bytes([Wrapper(linear)], optimizer)[0] == params + adam
    assert engine_memory.engine_static_bytes([Wrapper(linear)], optimizer) == params + adam
