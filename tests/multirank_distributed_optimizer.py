"""Run under torchrun (2 processes) by test_distributed_optimizer.py: for each precision,
trains with the optimizer held whole and sharded (--use-distributed-optimizer), measures
what every rank holds, then resumes a sharded run from a checkpoint.

argv: CHECKPOINT_DIR, then the trainer's flags. Prints one JSON line on rank 0.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_adacc import optimizer as optimizer_lib
from megatron_adacc.arguments import parse_args
from megatron_adacc.errors import InputError
from megatron_adacc.trainer import Trainer

PRECISIONS = {"fp32": [], "bf16": ["--bf16"]}


def held_bytes(trainer: Trainer) -> dict[str, int]:
    """Bytes of the distinct storages of what the run keeps between steps: parameters,
    buffers, gradients, the optimizer's main params and its state tensors (all of them,
    the 0-dim step counts too); and of the optimizer's own state alone."""
    model, optimizer = trainer.model, trainer.optimizer
    kept = [*model.parameters(), *model.buffers(), *optimizer.main_params]
    kept += [t.grad for t in [*model.parameters(), *optimizer.main_params] if t.grad is not None]
    state = [t for s in optimizer.optimizer.state.values() for t in s.values()
             if torch.is_tensor(t)]
    storages = {}
    for t in kept + state:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    params = {t.untyped_storage().data_ptr() for t in model.parameters()}
    own = {}
    for t in state + optimizer.main_params:
        if t.untyped_storage().data_ptr() not in params:
            own[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return {"held": sum(storages.values()), "optimizer_state": sum(own.values())}


def weights_agree_across_ranks(model: torch.nn.Module) -> bool:
    flat = torch.cat([p.detach().float().view(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    return all(torch.equal(copies[0], c) for c in copies)


def run(flags: list[str]) -> tuple[list[float], Trainer]:
    args = parse_args(flags, world_size=int(os.environ["WORLD_SIZE"]))
    trainer = Trainer(args)
    return [r["loss"] for r in trainer.train()], trainer


def main() -> None:
    checkpoints, flags = sys.argv[1], sys.argv[2:]
    report = {}
    for name, precision in PRECISIONS.items():
        whole, unsharded = run([*flags, *precision])
        sharded_losses, sharded = run([*flags, *precision, "--use-distributed-optimizer"])
        report[name] = {
            "whole": whole, "sharded": sharded_losses,
            "weights_equal": all(torch.equal(a, b) for a, b in
                                 zip(unsharded.model.parameters(), sharded.model.parameters())),
            "ranks_agree": weights_agree_across_ranks(sharded.model),
            "held_whole": held_bytes(unsharded),
            "predicted_whole": optimizer_lib.static_bytes(unsharded.model),
            "held_sharded": held_bytes(sharded),
            "predicted_sharded": optimizer_lib.static_bytes(
                sharded.model, dist.get_world_size(), dist.get_rank()),
            "adacc_static_bytes": sharded.adacc.static_bytes,
        }
    # Resume: a sharded bf16 run stopped at iteration 2 and resumed goes on as the
    # uninterrupted one did; the sharded checkpoint refuses a run that holds it whole.
    sharded = [*flags, "--bf16", "--use-distributed-optimizer", "--save", checkpoints]
    first, _ = run([*sharded, "--exit-interval", "2"])
    resumed, _ = run([*sharded, "--load", checkpoints])
    report["resume"] = {"straight": report["bf16"]["sharded"], "resumed": first + resumed}
    try:
        run([*flags, "--bf16", "--load", checkpoints])
        report["resume"]["unsharded_load"] = None
    except InputError as exc:
        report["resume"]["unsharded_load"] = str(exc)
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        print(json.dumps(reports))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
