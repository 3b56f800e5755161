"""Run under torchrun by test_pipeline.py: several trainings in one launch (process start-up
is most of a small run's time), one per JSON object on argv[1]: {"name": ..., "flags": [...]},
each with the flags after it. Prints one JSON line on rank 0: {name: [loss per iteration]}."""
import json
import os
import sys

import torch.distributed as dist

from megatron_adacc.training.arguments import parse_args
from megatron_adacc.training.trainer import Trainer


def main() -> None:
    runs, common = json.loads(sys.argv[1]), sys.argv[2:]
    world = int(os.environ["WORLD_SIZE"])
    losses = {}
    for run in runs:
        records = Trainer(parse_args(common + run["flags"], world_size=world)).train()
        losses[run["name"]] = [record["loss"] for record in records]
    if dist.get_rank() == 0:
        print(json.dumps(losses))
    # Leave together: a rank exiting while its peer still talks to it aborts in gloo's teardown.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
