"""Run under torchrun by the multi-process tests: pretrain_gpt.py in this process, once per
run (process start-up is most of a small run's time), then one JSON line on rank 0.

    torchrun --nproc_per_node N tests/multirank/multirank.py RUNS FLAGS...

RUNS is JSON, a list of {"name": ..., "flags": [...]} (each run's flags follow the common
FLAGS), optionally with "stretch": [factor of rank 0, factor of the other ranks], which
makes Adacc's step clock read each span that many times as long on that rank. The line
printed is "MULTIRANK " + {name: [report of rank 0, report of rank 1, ...]} (``report()``).
Other scripts import ``start``, ``train``, ``gather`` and ``leave``.
"""
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

MARK = "MULTIRANK "   # the line's prefix: the ranks' own output shares stdout
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def start() -> None:
    """The process group every run in this process shares (gloo, torchrun's environment)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))


def train(flags: list[str], stretch: list[float] | None = None):
    """One pretrain_gpt.py run on ``flags`` (in this process); returns its Adacc session."""
    from megatron.core import parallel_state

    import pretrain_gpt
    from megatron_adacc import adacc as adacc_lib
    from megatron_adacc import megatron_lm

    setup = adacc_lib.Adacc.setup
    if stretch:
        factor = stretch[0] if dist.get_rank() == 0 else stretch[-1]

        def stretched_setup(self, *args, **kwargs):
            # Only the clock Adacc times its steps with: the profile's timings stay as measured.
            result = setup(self, *args, **kwargs)
            self._clock = StretchedClock(factor)
            return result

        adacc_lib.Adacc.setup = stretched_setup
    try:
        status = pretrain_gpt.main(flags)
    except SystemExit as exc:  # Megatron-LM's loop ends an --exit-interval run with sys.exit
        status = exc.code or 0
    finally:
        adacc_lib.Adacc.setup = setup
    if status != 0:
        raise SystemExit(f"pretrain_gpt.py exited {status} on {flags}")
    # The next run may split the world differently.
    parallel_state.destroy_model_parallel()
    return megatron_lm.session()


def report(session) -> dict:
    """What a rank tells about one run: its metrics records and its plan (YAML)."""
    plan = session.adacc.plan if session.ready else None
    return {"records": session.records,
            "plan": plan.to_yaml() if plan is not None else None}


def gather(mine) -> list | None:
    """Every rank's ``mine``, in rank order, on rank 0 (None elsewhere)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered if dist.get_rank() == 0 else None


def leave() -> None:
    """Leave together: a rank exiting while its peer still talks to it aborts gloo's teardown."""
    dist.barrier()
    dist.destroy_process_group()


def StretchedClock(factor: float):
    """The host's clock, each span read ``factor`` times as long."""
    from megatron_adacc.profiling import clock

    class Stretched(clock.HostClock):
        def seconds(self, start, end) -> float:
            return factor * (end - start)

    return Stretched()


def main() -> None:
    runs, common = json.loads(sys.argv[1]), sys.argv[2:]
    start()
    reports = {}
    for run in runs:
        session = train(common + run["flags"], run.get("stretch"))
        reports[run["name"]] = gather(report(session))
    if dist.get_rank() == 0:
        print(MARK + json.dumps(reports), flush=True)
    leave()


if __name__ == "__main__":
    main()
