"""Run under torchrun (2 processes) by test_engine.py: trains with pretrain_gpt.py (in
this process, Megatron-LM's loop) at DP=2 in several configurations and reports, per
configuration, the losses, the gradient buckets, and the bytes the engine holds against what
Adacc planned with; then resumes a checkpoint written at DP=2 with the distributed
optimizer. Prints one JSON line on rank 0.

argv: CHECKPOINT_DIR, then pretrain_gpt.py's flags (after pretrain_helpers.TINY).
"""
import json
import sys

import torch
import torch.distributed as dist

from megatron_adacc.models import build as model_lib
from pretrain_helpers import pretrain

CONFIGS = {
    "ddp": [],
    "distributed": ["--use-distributed-optimizer"],
    "overlapped": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                   "--ddp-bucket-size", "20000"],
    "overlapped_bf16": ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
                        "--ddp-bucket-size", "20000"],
}


def inner_optimizers(optimizer) -> list:
    """Megatron's optimizers under a (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def main_params(optimizer) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Each model parameter's fp32 main parameter in megatron's mixed-precision optimizer."""
    pairs = {}
    for inner in inner_optimizers(optimizer):
        for models, mains in zip(inner.float16_groups, inner.fp32_from_float16_groups):
            pairs.update(zip(models, mains))
    return pairs


def held_bytes(session) -> int:
    """Bytes of the distinct storages the engine of a run holds after it: parameters,
    buffers, DDP's buffers, the optimizer's main parameters, their gradients and state."""
    (chunk,), storages = session.ddp_models, {}
    tensors = [*chunk.module.parameters(), *chunk.module.buffers()]
    for buffer in chunk.buffers:
        tensors += [buffer.grad_data] + ([buffer.param_data] if buffer.param_data is not None
                                         else [])
    for inner in inner_optimizers(session.optimizer):
        mains = [p for group in inner.optimizer.param_groups for p in group["params"]]
        tensors += mains + [p.grad for p in mains if p.grad is not None]
        tensors += [t for state in inner.optimizer.state.values() for t in state.values()
                    if torch.is_tensor(t)]
    for tensor in tensors:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def main() -> None:
    checkpoints, flags = sys.argv[1], sys.argv[2:]
    # The process group is this script's: the runs leave it (and its model-parallel state).
    model_lib.init_distributed(1)
    report = {}
    for name, extra in CONFIGS.items():
        session = pretrain(*flags, *extra)
        report[name] = {"losses": [r["loss"] for r in session.records],
                        "buckets": sum(len(b.buckets) for b in session.ddp_models[0].buffers),
                        "predicted": session.rank_static_bytes,
                        "planned_static": session.adacc.static_bytes,
                        "held": held_bytes(session)}
    overlapped = [*flags, *CONFIGS["overlapped"]]
    first = pretrain(*overlapped, "--save", checkpoints, "--save-interval", "3",
                     "--exit-interval", "3").records
    rest = pretrain(*overlapped, "--load", checkpoints).records
    report["resume"] = [r["loss"] for r in first + rest]
    # Adacc's budget with the distributed optimizer: static + the step's activation peak.
    session = pretrain(*overlapped, "--adacc-policy", "auto", "--adacc-memory-budget", "2MiB",
                       "--adacc-tracking", "off", "--train-iters", "2")
    report["budget"] = {"budget": session.adacc.budget_bytes,
                        "static": session.adacc.static_bytes,
                        "activation_peak": session.adacc.activation_peak_bytes,
                        "plan": session.records[-1]["plan_id"]}
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        print(json.dumps(reports))
    dist.barrier()
    model_lib.shutdown_distributed()


if __name__ == "__main__":
    main()
