"""``make demo``: train configs/demo.yaml with auto at a budget where it mixes all three actions.

    python scripts/demo.py [--config configs/demo.yaml] [pretrain_gpt.py flags ...]

The budget makes the plan retain, compress and recompute, whatever this machine's costs are. The
model is profiled once; the ProfileDB keeps the profile, and the trainer reuses it. The demo walks
the plan frontier from the smallest feasible budget up to what no optimisation needs. It trains at
the largest budget whose plan uses all three actions. Where codecs are cheap, compression alone
covers most of that range; near the smallest budget recompute is needed too. One line says why each
action was chosen where it was; then pretrain_gpt.py trains.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from unittest import mock

from megatron_adacc.common.sites import ACTIONS, COMPRESS, RETAIN
from megatron_adacc.common.units import format_size

ROOT = Path(__file__).resolve().parents[1]

# Budgets tried between the smallest feasible one and no optimisation's peak.
FRONTIER_POINTS = 24
# As the trainer plans (policies.resolve): a recomputed site is never rebuilt from a
# compressed one.
TRAINER_OPTIONS = {"allow_lossy_sources": False}


def plan_costs(argv: list[str]):
    """The costs auto plans this run with: the trainer's model, first micro-batch and engine.

    They are measured once into the ProfileDB, by one iteration of pretrain_gpt.py."""
    from megatron_adacc import cli

    return cli.trainer_costs(argv)


def actions_of(result) -> set[str]:
    return {row.action for row in result.rows}


def choose_budget(costs):
    """(budget, its plan, smallest feasible budget, no optimisation's peak).

    The budget is the largest on a grid over the frontier whose plan retains, compresses and
    recomputes. If none does, it is the smallest feasible budget and its plan."""
    from megatron_adacc import planning, policies

    low = planning.minimum_feasible_budget(costs, **TRAINER_OPTIONS)
    high = policies.plan("auto", costs, low, **TRAINER_OPTIONS).references[
        "no optimisation"].peak_bytes
    budgets = sorted({low + (high - low) * k // FRONTIER_POINTS
                      for k in range(FRONTIER_POINTS + 1)}, reverse=True)
    for budget in budgets:
        result = policies.plan("auto", costs, budget, **TRAINER_OPTIONS)
        if actions_of(result) == set(ACTIONS):
            return budget, result, low, high
    return low, policies.plan("auto", costs, low, **TRAINER_OPTIONS), low, high


def reasons(costs, result, budget: int, low: int, high: int) -> list[str]:
    """One line per action: where the plan takes it and why."""
    full = {site.name: site.bytes for site in costs.sites}
    lines = [f"demo budget {format_size(budget)}: the largest budget on this model's plan "
             f"frontier (from the smallest feasible {format_size(low)} to no optimisation's "
             f"{format_size(high)}) whose fastest plan mixes retain, compress and recompute"]
    for action in ACTIONS:
        rows = [row for row in result.rows if row.action == action]
        if not rows:
            lines.append(f"{action:<9}: nowhere (no budget on the frontier needs all three)")
            continue
        where = ", ".join(f"{row.site} [{row.layers}]" for row in rows)
        whole = sum(full[row.site] * row.num_layers for row in rows)
        kept = sum(row.bytes_kept for row in rows)
        added = sum(row.time_added_s for row in rows) * 1e3
        if action == RETAIN:
            why = (f"{format_size(whole)} kept whole: they fit, and retaining costs no time, "
                   f"so nothing cheaper was needed there")
        elif action == COMPRESS:
            why = (f"{format_size(whole)} held as {format_size(kept)} of payloads for "
                   f"{added:.3f} ms/step: encoding frees these bytes for less time than "
                   f"rebuilding them would")
        else:
            sources = ", ".join(dict.fromkeys(row.rebuilt_from for row in rows if row.rebuilt_from))
            why = (f"{format_size(whole)} rebuilt in backward (from {sources}) for {added:.3f} "
                   f"ms/step: to fit {format_size(budget)} more had to go than compression "
                   f"frees as cheaply, and rebuilding these frees them for the least time")
        lines.append(f"{action:<9}: {where}: {why}")
    return lines


@contextlib.contextmanager
def arguments_in_one_line():
    """Megatron-LM's dump of its arguments (a line each) as one line: the plan stays in view."""
    from megatron.training import arguments

    def summary(title: str, args) -> None:
        print(f"Megatron-LM's {len(vars(args))} {title} are not listed here; pretrain_gpt.py "
              f"with the same flags lists them", flush=True)

    with mock.patch.object(arguments, "_print_args", summary):
        yield


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" not in argv:
        argv = ["--config", str(ROOT / "configs" / "demo.yaml"), *argv]
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    import pretrain_gpt
    from megatron_adacc import cli, megatron_compat
    from megatron_adacc.common.errors import InputError

    megatron_compat.quiet_missing_kernel_notices()
    try:
        costs = plan_costs(argv)
        budget, result, low, high = choose_budget(costs)
    except (cli.UsageError, InputError, ValueError) as exc:  # the trainer's one line, exit 2
        print(f"demo.py: error: {exc}", file=sys.stderr)
        return 2
    for line in reasons(costs, result, budget, low, high):
        print(line, flush=True)
    with arguments_in_one_line():
        return pretrain_gpt.main([*argv, "--adacc-policy", "auto", "--adacc-memory-budget",
                                  str(budget)])


if __name__ == "__main__":
    sys.exit(main())
