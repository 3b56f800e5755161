"""``adacc``: command-line entry point.

    adacc plan --config configs/gpt-345m.yaml --micro-batch-size 8 --memory-budget 16GiB \
        --hardware v100-32gb [--json] [--uniform] [--exact]
    adacc plan --config configs/gpt-345m.yaml --micro-batch-size 8 --hardware v100-32gb \
        --pipeline-model-parallel-size 4 --num-micro-batches 8 --data-parallel-size 2 \
        --use-distributed-optimizer

With pipeline stages each stage gets its own plan (1F1B keeps more micro-batches in flight
on the first stages), each the fastest that fits the per-device budget. Plans are auto's:
designated codecs first, the quantize baseline's per-token INT4 only when those fit no plan
(the table marks its rows "last resort"; the analytic model prices designated codecs only).

Costs come from a source: the analytic model of a named accelerator (``--hardware``), or,
without it, this machine's ProfileDB (``--profile-db``, default in $ADACC_DATA_DIR), profiling
the model first, as the trainer would, when the database has no row for it. Exit codes:
0 planned, 2 a bad request or an infeasible budget (with a one-line reason on stderr).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml

from megatron_adacc.profiling import hardware
from megatron_adacc.training.arguments import read_config
from megatron_adacc.common.costs import ModelCosts
from megatron_adacc.common.errors import InputError
from megatron_adacc.planning import InfeasibleBudget, plan_stages
from megatron_adacc.planning import format_plan, format_stages
from megatron_adacc.common.units import parse_size

_SHAPE_FLAGS = ("num-layers", "hidden-size", "num-attention-heads", "ffn-hidden-size",
                "seq-length", "max-position-embeddings", "vocab-size", "tokenizer-type",
                "attention-dropout", "hidden-dropout", "attention-backend")


class UsageError(Exception):
    """A request the planner cannot serve; the message is the one line printed."""


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage too: one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="adacc", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="the fastest plan that fits a memory budget")
    p.add_argument("--config", help="YAML of Megatron-style flags (num-layers, hidden-size, ...)")
    for flag in _SHAPE_FLAGS:
        p.add_argument(f"--{flag}", default=None)
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"),
                   help="override the config's fp16/bf16 (a V100 has no bf16)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="default: the config's micro-batch-size")
    p.add_argument("--memory-budget", help="e.g. 30GiB; default: the accelerator's capacity "
                   f"minus {hardware.DEFAULT_RESERVED_BYTES >> 30} GiB reserved")
    p.add_argument("--hardware", choices=sorted(hardware.ACCELERATORS),
                   help="plan from the analytic model of this accelerator")
    p.add_argument("--profile-db", help="ProfileDB file for plans without --hardware "
                   "(default: $ADACC_DATA_DIR/profiles.sqlite)")
    p.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2, 3))
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's distributed optimizer: ZeRO stage 1 (optimizer states "
                   "sharded over the data-parallel group)")
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="plan one tensor-parallel rank: its shards of the layers")
    p.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="the norms and the residual stream sharded along the sequence")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=None,
                   help="pipeline stages (1F1B); each gets its own plan; default: the "
                   "config's, else 1")
    p.add_argument("--num-micro-batches", type=int, default=None,
                   help="micro-batches per step; default: the config's global-batch-size / "
                   "(micro-batch-size x data-parallel-size), else 1")
    p.add_argument("--uniform", dest="per_layer", action="store_false",
                   help="one policy for every layer (the paper's model)")
    p.add_argument("--per-layer", dest="per_layer", action="store_true", default=True)
    p.add_argument("--exact", dest="allow_lossy_sources", action="store_false", default=False,
                   help="never rebuild a recomputed site from a compressed one (the default: "
                   "the trainer plans so)")
    p.add_argument("--lossy-sources", dest="allow_lossy_sources", action="store_true",
                   help="let a recomputed site be rebuilt from a compressed one")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


def _config_flags(path: str | None) -> dict[str, Any]:
    """The config as pretrain_gpt.py reads it (arguments.read_config: the same keys and
    values accepted, the same refused), keyed by flag name."""
    if not path:
        return {}
    return {dest.replace("_", "-"): value for dest, value in read_config(path).items()}


def _settle_config_defaults(args: argparse.Namespace) -> None:
    """Flags left out take the config's value, as pretrain_gpt.py's do; what the planner
    cannot plan is refused before anything is measured."""
    config = _config_flags(args.config)
    if args.micro_batch_size is None:
        args.micro_batch_size = config.get("micro-batch-size")
    if args.micro_batch_size is None:
        raise UsageError("--micro-batch-size is needed (on the command line or in the config)")
    if args.pipeline_model_parallel_size is None:
        args.pipeline_model_parallel_size = config.get("pipeline-model-parallel-size", 1)
    args.use_distributed_optimizer |= bool(config.get("use-distributed-optimizer"))


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    flags: dict[str, Any] = _config_flags(args.config)
    for flag in _SHAPE_FLAGS:
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            flags[flag] = value
    if args.precision:
        flags.update({"fp16": args.precision == "fp16", "bf16": args.precision == "bf16"})
    for flag in ("tensor-model-parallel-size", "sequence-parallel"):
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            flags[flag] = value
    return flags


def _with_vocab_size(flags: dict[str, Any]) -> dict[str, Any]:
    """``flags`` with --vocab-size: its --tokenizer-type's vocabulary when not given."""
    if flags.get("vocab-size") is not None or flags.get("tokenizer-type") is None:
        return flags
    from megatron_adacc.training.tokenizers import build_tokenizer  # until plan moves over

    tokenizer = build_tokenizer(str(flags["tokenizer-type"]), flags.get("vocab-file"),
                                flags.get("merge-file"))
    return {**flags, "vocab-size": tokenizer.vocab_size}


def _profiled_costs(args: argparse.Namespace, budget: int | None
                    ) -> tuple[ModelCosts, int | None]:
    """This machine's measured costs from the ProfileDB, profiled first (on the model and
    first micro-batch the trainer would build from this config) when it has none; and the
    default budget (a GPU's usable memory, None on a CPU)."""
    from megatron_adacc import policies
    from megatron_adacc.training import trainer
    from megatron_adacc.training.arguments import ConfigError, parse_args
    from megatron_adacc.profiling.profile_db import ProfileDB
    from megatron_adacc.runtime import get_adacc_layer_spec

    if args.vocab_size is not None:
        raise UsageError("--vocab-size describes a model for --hardware; a profile measures "
                         "the trainer's model, whose vocabulary is its --tokenizer-type's")
    tensor_parallel = _flags(args).get("tensor-model-parallel-size", 1)
    if tensor_parallel != 1:
        raise UsageError(f"tensor-model-parallel-size {tensor_parallel}: a profile on this "
                         "machine measures one process; plan it with --hardware, or train "
                         "it under torchrun, which profiles every rank")
    with tempfile.TemporaryDirectory() as scratch:
        config = args.config
        if config and args.precision:
            # --precision replaces the config's fp16/bf16: a trainer flag could switch one
            # on, never the config's other one off.
            config = str(Path(scratch) / "config.yaml")
            Path(config).write_text(yaml.safe_dump(
                {k: v for k, v in _config_flags(args.config).items()
                 if k not in ("fp16", "bf16")}))
        argv = ["--config", config] if config else []
        for flag in _SHAPE_FLAGS:
            value = getattr(args, flag.replace("-", "_"))
            if value is not None:
                argv += [f"--{flag}", str(value)]
        argv += {"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(args.precision, [])
        argv += ["--micro-batch-size", str(args.micro_batch_size), "--global-batch-size",
                 str(args.micro_batch_size), "--train-iters", "1", "--lr-warmup-iters", "0",
                 "--eval-interval", "0", "--adacc-policy", "auto"]
        # The trainer's auto run this plans for (whatever policy the config names).
        argv += ["--adacc-memory-budget", str(budget)] if budget is not None else []
        try:
            with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the table / JSON
                model, batches, _ = trainer.build_model_and_data(parse_args(argv),
                                                                 get_adacc_layer_spec())
        except (ConfigError, ValueError) as exc:
            raise UsageError(str(exc)) from None
    costs, _ = policies.measured_costs(model, trainer.first_micro_batch(batches),
                                       ProfileDB(args.profile_db))
    return costs, policies.default_budget()


def _zero_stage(args: argparse.Namespace) -> int:
    if not args.use_distributed_optimizer:
        return args.zero_stage or 0
    if args.zero_stage not in (None, 1):
        raise UsageError(f"--use-distributed-optimizer is ZeRO stage 1, not --zero-stage "
                         f"{args.zero_stage}")
    return 1


def _num_micro_batches(args: argparse.Namespace, flags: dict[str, Any]) -> int:
    if args.num_micro_batches is not None:
        if args.num_micro_batches < 1:
            raise UsageError(f"--num-micro-batches must be >= 1, got {args.num_micro_batches}")
        return args.num_micro_batches
    global_batch = flags.get("global-batch-size")
    if global_batch is None or args.pipeline_model_parallel_size == 1:
        return 1        # one stage holds one micro-batch whatever their number
    per_step = args.micro_batch_size * args.data_parallel_size
    if int(global_batch) % per_step:
        raise UsageError(f"global-batch-size {global_batch} is not a multiple of micro-batch "
                         f"size x data-parallel size = {per_step}")
    return int(global_batch) // per_step


def _costs(args: argparse.Namespace, budget: int | None
           ) -> tuple[list[ModelCosts], int | None]:
    """The costs of each pipeline stage to plan from and the default budget (the device's
    usable memory)."""
    if args.data_parallel_size < 1 or args.pipeline_model_parallel_size < 1:
        raise UsageError("--data-parallel-size and --pipeline-model-parallel-size must be >= 1")
    zero_stage = _zero_stage(args)
    if not args.hardware:
        if args.pipeline_model_parallel_size > 1 or zero_stage:
            raise UsageError("pipeline stages and ZeRO are planned with --hardware: a profile "
                             "measures the whole model on this machine")
        costs, default_budget = _profiled_costs(args, budget)
        return [costs], default_budget
    try:
        flags = _flags(args)
        shape = hardware.ModelShape.from_flags(_with_vocab_size(flags))
        stages = hardware.pipeline_costs(
            shape, args.micro_batch_size, args.hardware, args.pipeline_model_parallel_size,
            _num_micro_batches(args, flags), zero_stage, args.data_parallel_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    device = hardware.get_accelerator(args.hardware)
    return stages, device.capacity_bytes - hardware.DEFAULT_RESERVED_BYTES


def _plan_command(args: argparse.Namespace) -> int:
    _settle_config_defaults(args)
    if args.micro_batch_size < 1:
        raise UsageError(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    budget = None
    if args.memory_budget is not None:
        try:
            budget = parse_size(args.memory_budget)
        except ValueError as exc:
            raise UsageError(f"--memory-budget: {exc}") from None
    if budget is None and not args.hardware and not torch.cuda.is_available():
        # Before profiling: a CPU has no capacity to default to.
        raise UsageError("--memory-budget SIZE is needed to plan for a CPU (no device capacity "
                         "to default to)")
    stages, default_budget = _costs(args, budget)
    budget = default_budget if budget is None else budget
    try:
        plans = plan_stages(stages, budget, per_layer=args.per_layer,
                            allow_lossy_sources=args.allow_lossy_sources)
    except InfeasibleBudget as exc:
        if args.json:
            infeasible = {"feasible": False, "budget_bytes": budget,
                          "minimum_feasible_budget": exc.minimum_budget,
                          "static_bytes": exc.static_bytes}
            print(json.dumps(infeasible if len(stages) == 1
                             else {**infeasible, "stage": exc.stage}))
        print(f"adacc plan: {exc}", file=sys.stderr)
        return 2
    if len(plans) == 1:     # no pipeline: the one plan, as it always was
        result = plans[0].result
        print(json.dumps(result.to_dict(), indent=1) if args.json else format_plan(result))
    elif args.json:
        print(json.dumps({"feasible": True, "budget_bytes": budget,
                          "pipeline_model_parallel_size": len(plans),
                          "num_micro_batches": stages[0].meta["num_micro_batches"],
                          "stages": [stage.to_dict() for stage in plans]}, indent=1))
    else:
        print(format_stages(plans))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        return _plan_command(args)
    except (UsageError, InputError) as exc:
        print(f"adacc {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
