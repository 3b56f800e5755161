"""Run under torchrun (2 processes) by test_engine.py: trains on megatron's engine at DP=2
in several configurations and reports, per configuration, the losses, the gradient
buckets, and the bytes the engine holds against what Adacc planned with; then resumes a
checkpoint written at DP=2 with the distributed optimizer. Prints one JSON line on rank 0.

argv: CHECKPOINT_DIR, then the trainer's flags.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_adacc.training.arguments import parse_args
from megatron_adacc.training.trainer import Trainer

CONFIGS = {
    "ddp": [],
    "distributed": ["--use-distributed-optimizer"],
    "overlapped": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                   "--ddp-bucket-size", "20000"],
    "overlapped_bf16": ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
                        "--ddp-bucket-size", "20000"],
}


def main_params(trainer: Trainer) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Each model parameter's fp32 main parameter in megatron's mixed-precision optimizer."""
    pairs = {}
    for inner in trainer.optimizer.chained_optimizers:
        for models, mains in zip(inner.float16_groups, inner.fp32_from_float16_groups):
            pairs.update(zip(models, mains))
    return pairs


def held_bytes(trainer: Trainer) -> int:
    """Bytes of the distinct storages the engine holds after training: parameters,
    buffers, DDP's buffers, the optimizer's main parameters, their gradients and state."""
    chunk, storages = trainer.train_model, {}
    tensors = [*chunk.module.parameters(), *chunk.module.buffers()]
    for buffer in chunk.buffers:
        tensors += [buffer.grad_data] + ([buffer.param_data] if buffer.param_data is not None
                                         else [])
    for inner in trainer.optimizer.chained_optimizers:
        mains = [p for group in inner.optimizer.param_groups for p in group["params"]]
        tensors += mains + [p.grad for p in mains if p.grad is not None]
        tensors += [t for state in inner.optimizer.state.values() for t in state.values()
                    if torch.is_tensor(t)]
    for tensor in tensors:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def run(flags: list[str]) -> tuple[list[dict], Trainer]:
    trainer = Trainer(parse_args(flags, world_size=int(os.environ["WORLD_SIZE"])))
    return trainer.train(), trainer


def main() -> None:
    checkpoints, flags = sys.argv[1], sys.argv[2:]
    report = {}
    for name, extra in CONFIGS.items():
        records, trainer = run([*flags, *extra])
        report[name] = {"losses": [r["loss"] for r in records],
                        "buckets": sum(len(b.buckets) for b in trainer.train_model.buffers),
                        "predicted": trainer.static_bytes,
                        "planned_static": trainer.adacc.static_bytes,
                        "held": held_bytes(trainer)}
    overlapped = [*flags, *CONFIGS["overlapped"]]
    first, _ = run([*overlapped, "--save", checkpoints, "--exit-interval", "3"])
    rest, _ = run([*overlapped, "--load", checkpoints])
    report["resume"] = [r["loss"] for r in first + rest]
    # Adacc's budget with the distributed optimizer: static + the step's activation peak.
    records, trainer = run([*overlapped, "--adacc-policy", "auto", "--adacc-memory-budget",
                            "2MiB", "--adacc-tracking", "off", "--train-iters", "2"])
    report["budget"] = {"budget": trainer.adacc.budget_bytes,
                        "static": trainer.adacc.static_bytes,
                        "activation_peak": trainer.adacc.activation_peak_bytes,
                        "plan": records[-1]["plan_id"]}
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        print(json.dumps(reports))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
