"""Run under torchrun (2 processes) by test_engine.py: trains with pretrain_gpt.py (in
this process, Megatron-LM's loop) at DP=2 in several configurations and reports, per
configuration, the losses, the gradient buckets, and the bytes the engine holds against what
Adacc planned with; then resumes a checkpoint written at DP=2 with the distributed
optimizer. Prints one JSON line on rank 0.

argv: CHECKPOINT_DIR, then pretrain_gpt.py's flags (after helpers.pretrain.TINY).
"""
import json
import sys

import torch.distributed as dist

from megatron_adacc.models import build as model_lib
from helpers.engine import held_bytes
from helpers.pretrain import pretrain

CONFIGS = {
    "ddp": [],
    "distributed": ["--use-distributed-optimizer"],
    "overlapped": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                   "--ddp-bucket-size", "20000"],
    "overlapped_bf16": ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
                        "--ddp-bucket-size", "20000"],
}


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
