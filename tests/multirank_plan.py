"""Run under torchrun by test_multirank.py: train, then report every rank's plan.

Prints one JSON line on rank 0: {"plan_ids": [...one per rank...], "plans": [...YAML...]}.
"""
import json
import sys

import torch.distributed as dist

from megatron_adacc.training.arguments import parse_args
from megatron_adacc.training.trainer import Trainer


def main() -> None:
    args = parse_args(sys.argv[1:], world_size=int(__import__("os").environ["WORLD_SIZE"]))
    trainer = Trainer(args)
    trainer.train()
    plan = trainer.adacc.plan.to_yaml() if trainer.adacc.plan is not None else None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (trainer.adacc.plan_id, plan))
    if dist.get_rank() == 0:
        print(json.dumps({"plan_ids": [g[0] for g in gathered], "plans": [g[1] for g in gathered]}))
    # Leave together: a rank exiting while its peer still talks to it aborts in gloo's teardown.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
