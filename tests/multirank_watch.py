"""Run under torchrun by test_multirank.py: train with the step watch while each rank's steps
read slower than they ran, by a factor of its own (rank 0: 3x, others: 30x), so the ranks
disagree about every step; print every rank's plan at each iteration and its watch records.

Prints one JSON line on rank 0: {"plans": [[plan_id per iteration] per rank],
"watch": [[step_watch record or null per iteration] per rank]}.
"""
import json
import os
import sys

import torch.distributed as dist

from megatron_adacc.profiling import clock
from megatron_adacc.training.arguments import parse_args
from megatron_adacc.training.trainer import Trainer


class StretchedClock(clock.HostClock):
    """The host's clock, each span read ``factor`` times as long."""

    def __init__(self, factor: float):
        self.factor = factor

    def seconds(self, start, end) -> float:
        return self.factor * (end - start)


def main() -> None:
    args = parse_args(sys.argv[1:], world_size=int(os.environ["WORLD_SIZE"]))
    trainer = Trainer(args)
    # Only the clock Adacc times its steps with: the profile's timings stay as measured.
    trainer.adacc._clock = StretchedClock(3.0 if dist.get_rank() == 0 else 30.0)
    records = trainer.train()
    mine = ([r["plan_id"] for r in records], [r.get("step_watch") for r in records])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        print(json.dumps({"plans": [g[0] for g in gathered], "watch": [g[1] for g in gathered]}))
    # Leave together: a rank exiting while its peer still talks to it aborts in gloo's teardown.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
