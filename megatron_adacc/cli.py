"""The adacc command: plan a pretrain_gpt.py model's activation memory for a budget.

    adacc plan --config configs/gpt-345m.yaml --micro-batch-size 8 --memory-budget 16GiB \
        --hardware v100-32gb [--json] [--uniform] [--exact]
    adacc plan --config configs/gpt-345m.yaml --micro-batch-size 8 --hardware v100-32gb \
        --pipeline-model-parallel-size 4 --num-micro-batches 8 --data-parallel-size 2 \
        --use-distributed-optimizer

- With pipeline stages, each stage gets its own plan, the fastest that fits the per-device budget.
  1F1B keeps more micro-batches in flight on the first stages.
- Plans are auto's: designated codecs first, and the quantize baseline's per-token INT4 only when
  those fit no plan. The table marks those rows "last resort". The analytic model prices designated
  codecs only.
- The model is pretrain_gpt.py's. Every flag but ``adacc``'s own (``_build_parser``) is one of
  pretrain_gpt.py's, and ``--config`` is read as pretrain_gpt.py reads it. Its ``--adacc-*``
  flags count as the trainer reads them: ``--adacc-memory-budget``, ``--adacc-lossy-sources``,
  ``--adacc-profile-db`` as ``adacc``'s own, ``--adacc-policy auto-no-outlier`` for its codecs.
- Costs come from the analytic model of a named accelerator (``--hardware``). Without it, they come
  from this machine's ProfileDB (``--profile-db``, default in $ADACC_DATA_DIR). A model without a
  row there is profiled first, by one iteration of pretrain_gpt.py in this process.

Exit codes: 0 planned, 2 a bad request or an infeasible budget (with a one-line reason).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
from typing import Any, Sequence

import torch

from megatron_adacc import launch, megatron_compat
from megatron_adacc.planning import analytic
from megatron_adacc.common.costs import ModelCosts
from megatron_adacc.common.errors import InputError
from megatron_adacc.planning import InfeasibleBudget, plan_stages, with_lossy_hint
from megatron_adacc.planning import format_plan, format_stages
from megatron_adacc.profiling import engine_memory
from megatron_adacc.common.units import parse_size

# Data flags: with none of them pretrain_gpt.py trains on the built-in corpus.
_DATA_FLAGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path",
               "mock_data", "data_args_path", "per_split_data_args_path")
# What a profiling run writes or reads that a plan must not: output and checkpoint folders.
_OUTPUT_FLAGS = ("--metrics-file", "--tensorboard-dir", "--save", "--load", "--wandb-project",
                 "--wandb-save-dir")
# A budget no model reaches: the profiling run plans at it, the plan here at the user's.
_NO_LIMIT = 1 << 60


class UsageError(Exception):
    """A request the planner cannot serve; the message is the one line printed."""


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage too: one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _build_parser() -> argparse.ArgumentParser:
    """``adacc``'s own flags; every other flag of ``adacc plan`` is pretrain_gpt.py's."""
    parser = _OneLineParser(prog="adacc", description=__doc__.split("\n")[0],
                            allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="the fastest plan that fits a memory budget",
                            allow_abbrev=False)
    p.add_argument("--config", help="YAML of pretrain_gpt.py's flags (num-layers, ...), read "
                   "as pretrain_gpt.py reads it")
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"),
                   help="override the config's fp16/bf16 (a V100 has no bf16)")
    p.add_argument("--memory-budget", help="e.g. 30GiB; default: the accelerator's capacity "
                   f"minus {analytic.DEFAULT_RESERVED_BYTES >> 30} GiB reserved")
    p.add_argument("--hardware", choices=sorted(analytic.ACCELERATORS),
                   help="plan from the analytic model of this accelerator")
    p.add_argument("--profile-db", help="ProfileDB file for plans without --hardware "
                   "(default: $ADACC_DATA_DIR/profiles.sqlite)")
    p.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2, 3),
                   help="with --hardware: shard the optimizer state (1), gradients (2) and "
                   "parameters (3) over the data-parallel ranks; --use-distributed-optimizer "
                   "is stage 1")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="ranks a step's batch is split over (shards ZeRO's state)")
    p.add_argument("--num-micro-batches", type=int, default=None,
                   help="micro-batches per step; default: global-batch-size / "
                   "(micro-batch-size x data-parallel-size), else 1")
    p.add_argument("--uniform", dest="per_layer", action="store_false",
                   help="one policy for every layer (the paper's model)")
    p.add_argument("--per-layer", dest="per_layer", action="store_true", default=True,
                   help="a policy for each layer (the default)")
    p.add_argument("--exact", dest="allow_lossy_sources", action="store_false", default=None,
                   help="never rebuild a recomputed site from a compressed one (the default: "
                   "the trainer plans so)")
    p.add_argument("--lossy-sources", dest="allow_lossy_sources", action="store_true",
                   help="let a recomputed site be rebuilt from a compressed one")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


def training_argv(args: argparse.Namespace, rest: Sequence[str]) -> list[str]:
    """pretrain_gpt.py's flags of a plan: the config's first, then the command line's.

    ``--precision`` replaces any fp16/bf16 flag, since a flag can switch one on, never off."""
    argv = launch.config_argv(["--config", args.config, *rest] if args.config else rest)
    if args.precision:
        argv = [flag for flag in argv if flag not in ("--fp16", "--bf16")]
        argv += {"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(args.precision, [])
    return argv


def training_flags(argv: Sequence[str]) -> argparse.Namespace:
    """pretrain_gpt.py's parser over ``argv``, every refusal a one-line ConfigError.

    It reads ``--config`` and validates nothing, since nothing is built."""
    parser = launch.build_parser()

    def refuse(message: str):
        raise launch.ConfigError(message)

    parser.error = refuse  # argparse would print its usage and exit
    return parser.parse_args(launch.config_argv(argv, parser))


def shape_flags(flags: argparse.Namespace) -> dict[str, Any]:
    """Model-shape flags of parsed pretrain_gpt.py flags, keyed as ``ModelShape.from_flags`` reads.

    The vocabulary is the one pretrain_gpt.py trains: ``--vocab-size``, else the built-in
    corpus's bytes when no data flag is given."""
    from megatron_adacc import corpus

    shape = {dest.replace("_", "-"): value for dest, value in vars(flags).items()
             if value is not None}
    backend = flags.attention_backend
    shape["attention-backend"] = getattr(backend, "name", str(backend))
    shape["disable-bias-linear"] = not flags.add_bias_linear
    if flags.vocab_size is None:
        if any(getattr(flags, name, None) for name in _DATA_FLAGS):
            raise UsageError(f"--vocab-size is needed: a plan does not build the "
                             f"{flags.tokenizer_type} tokenizer to read its size")
        shape["vocab-size"] = corpus.ByteTokenizer.vocab_size
    return shape


def model_shape(argv: Sequence[str]) -> analytic.ModelShape:
    """The accelerator model's shape of the GPT pretrain_gpt.py trains with ``argv``."""
    try:
        return _gpu_shape(training_flags(argv))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _gpu_shape(flags: argparse.Namespace) -> analytic.ModelShape:
    """The shape the accelerator model prices on a GPU, stepped by this install's optimizer."""
    return analytic.ModelShape.from_flags(shape_flags(flags),
                                          engine_memory.steps_with_torch_adam())


def trainer_costs(argv: Sequence[str], budget: int | None = None) -> ModelCosts:
    """The costs ``--adacc-policy auto`` plans pretrain_gpt.py's run of ``argv`` with.

    They cover its model, first micro-batch and engine's static bytes. They come from the
    ProfileDB or from one training iteration in this process, which writes only the ProfileDB."""
    import pretrain_gpt
    from megatron_adacc import megatron_lm

    argv = launch.config_argv(argv)
    kept: list[str] = []
    while argv:
        flag = argv.pop(0)
        if flag in _OUTPUT_FLAGS:
            argv.pop(0) if argv else None
        else:
            kept.append(flag)
    # a plan needs no learning rate, but Megatron-LM's optimizer does: the user's wins
    probe = ["--lr", "1e-4", *kept, "--train-iters", "1", "--lr-warmup-iters", "0",
             "--eval-iters", "0", "--log-interval", "1000", "--adacc-policy", "auto",
             "--adacc-tracking", "off",
             "--adacc-memory-budget", str(_NO_LIMIT if budget is None else budget)]
    chatter, errors = io.StringIO(), io.StringIO()
    # Megatron-LM's loggers write to the stream their handler took when it was made, which
    # redirecting sys.stderr does not reach: some hundred lines would come before the table.
    silenced = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(errors):
            status = pretrain_gpt.main(probe)
    finally:
        logging.disable(silenced)
    if status != 0:
        lines = [line for line in errors.getvalue().splitlines() if line.strip()]
        message = lines[-1] if lines else f"pretrain_gpt.py exited {status}"
        raise UsageError(message.removeprefix(f"{pretrain_gpt.PROG}: error: "))
    return megatron_lm.session().adacc.costs


def _profiled_costs(args: argparse.Namespace, flags: argparse.Namespace, argv: list[str]
                    ) -> tuple[ModelCosts, int | None]:
    """This machine's measured costs of the trainer's model, and the default budget.

    The default budget is a GPU's usable memory, None on a CPU."""
    from megatron_adacc import policies

    if flags.tensor_model_parallel_size != 1:
        raise UsageError(f"tensor-model-parallel-size {flags.tensor_model_parallel_size}: a "
                         "profile on this machine measures one process; plan it with "
                         "--hardware, or train it under torchrun, which profiles every rank")
    if args.profile_db:
        argv = [*argv, "--adacc-profile-db", args.profile_db]
    argv += ["--micro-batch-size", str(args.micro_batch_size), "--global-batch-size",
             str(args.micro_batch_size)]
    return trainer_costs(argv), policies.default_budget()


def _zero_stage(args: argparse.Namespace) -> int:
    if not args.use_distributed_optimizer:
        return args.zero_stage or 0
    if args.zero_stage not in (None, 1):
        raise UsageError(f"--use-distributed-optimizer is ZeRO stage 1, not --zero-stage "
                         f"{args.zero_stage}")
    return 1


def _num_micro_batches(args: argparse.Namespace, flags: argparse.Namespace) -> int:
    if args.num_micro_batches is not None:
        if args.num_micro_batches < 1:
            raise UsageError(f"--num-micro-batches must be >= 1, got {args.num_micro_batches}")
        return args.num_micro_batches
    global_batch = flags.global_batch_size
    if global_batch is None or args.pipeline_model_parallel_size == 1:
        return 1        # one stage holds one micro-batch whatever their number
    per_step = args.micro_batch_size * args.data_parallel_size
    if int(global_batch) % per_step:
        raise UsageError(f"global-batch-size {global_batch} is not a multiple of micro-batch "
                         f"size x data-parallel size = {per_step}")
    return int(global_batch) // per_step


def _costs(args: argparse.Namespace, flags: argparse.Namespace, argv: list[str]
           ) -> tuple[list[ModelCosts], int | None]:
    """The costs of each pipeline stage to plan from, and the default budget (usable memory)."""
    if args.data_parallel_size < 1 or args.pipeline_model_parallel_size < 1:
        raise UsageError("--data-parallel-size and --pipeline-model-parallel-size must be >= 1")
    zero_stage = _zero_stage(args)
    if not args.hardware:
        if args.pipeline_model_parallel_size > 1 or zero_stage:
            raise UsageError("pipeline stages and ZeRO are planned with --hardware: a profile "
                             "measures the whole model on this machine")
        costs, default_budget = _profiled_costs(args, flags, argv)
        return [costs], default_budget
    try:
        shape = _gpu_shape(flags)
        stages = analytic.pipeline_costs(
            shape, args.micro_batch_size, args.hardware, args.pipeline_model_parallel_size,
            _num_micro_batches(args, flags), zero_stage, args.data_parallel_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    device = analytic.get_accelerator(args.hardware)
    return stages, device.capacity_bytes - analytic.DEFAULT_RESERVED_BYTES


def _refuse_unplanned(args: argparse.Namespace, flags: argparse.Namespace) -> None:
    """UsageError for pretrain_gpt.py flags a plan would leave out; the trainer refuses them too.

    Under them, a plan would price a model other than the one trained."""
    from megatron_adacc import policies
    from megatron_adacc.models import family

    try:
        policies.require_plannable("auto", flags.recompute_granularity)
        family.require_modelled_layer(flags)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if flags.recompute_granularity and args.hardware:
        raise UsageError(f"--recompute-granularity {flags.recompute_granularity}: the analytic "
                         f"model prices no Megatron recompute beside Adacc's plan; drop it, or "
                         f"plan from this machine's profile (no --hardware)")
    if flags.context_parallel_size > 1:
        raise UsageError(f"--context-parallel-size {flags.context_parallel_size}: Adacc's layer "
                         f"(--transformer-impl local) has no context parallelism")
    if flags.num_layers_per_virtual_pipeline_stage or flags.num_virtual_stages_per_pipeline_rank:
        raise UsageError("Adacc plans one model chunk per rank; drop the virtual pipeline flags")


def _adacc_flags(args: argparse.Namespace, flags: argparse.Namespace) -> tuple[str, int | None]:
    """Fold the trainer's ``--adacc-*`` flags into ``args``; returns the auto policy and budget.

    A plan of pretrain_gpt.py's flags is the one its ``--adacc-policy auto`` would make: its
    budget, rebuild sources and ProfileDB count as ``adacc plan``'s own flags do."""
    from megatron_adacc import policies

    def size(flag: str, text: str | None) -> int | None:
        try:
            return None if text is None else parse_size(text)
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None

    def disagree(own: str, trainers: str) -> UsageError:
        return UsageError(f"{own} and {trainers} disagree; give one")

    mine = size("--memory-budget", args.memory_budget)
    theirs = size("--adacc-memory-budget", flags.adacc_memory_budget)
    if mine is not None and theirs is not None and mine != theirs:
        raise disagree(f"--memory-budget {args.memory_budget}",
                       f"--adacc-memory-budget {flags.adacc_memory_budget}")
    budget = mine if mine is not None else theirs
    if (args.profile_db is not None and flags.adacc_profile_db is not None
            and os.path.realpath(args.profile_db) != os.path.realpath(flags.adacc_profile_db)):
        raise disagree(f"--profile-db {args.profile_db}",
                       f"--adacc-profile-db {flags.adacc_profile_db}")
    if args.profile_db is None:
        args.profile_db = flags.adacc_profile_db
    if args.allow_lossy_sources is False and flags.adacc_lossy_sources:
        raise disagree("--exact", "--adacc-lossy-sources")
    args.allow_lossy_sources = bool(args.allow_lossy_sources or flags.adacc_lossy_sources)
    policy = flags.adacc_policy
    if policy not in policies.AUTO_POLICIES and policy != "none":
        # none is the trainer's default: a plan is asked for all the same
        raise UsageError(f"--adacc-policy {policy} runs a fixed plan, with no budget to plan "
                         f"for; adacc plan plans {' and '.join(policies.AUTO_POLICIES)}")
    return (policy if policy in policies.AUTO_POLICIES else "auto"), budget


def _plan_command(args: argparse.Namespace, rest: list[str]) -> int:
    argv = training_argv(args, rest)
    flags = training_flags(argv)
    _refuse_unplanned(args, flags)
    policy, budget = _adacc_flags(args, flags)
    options = {"per_layer": args.per_layer, "allow_lossy_sources": args.allow_lossy_sources,
               "separate_outliers": policy == "auto"}
    # pretrain_gpt.py's flags (the config's or the command line's) that shape the plan
    args.micro_batch_size = flags.micro_batch_size
    args.pipeline_model_parallel_size = flags.pipeline_model_parallel_size
    args.use_distributed_optimizer = flags.use_distributed_optimizer
    if args.micro_batch_size is None:
        raise UsageError("--micro-batch-size is needed (on the command line or in the config)")
    if args.micro_batch_size < 1:
        raise UsageError(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    if budget is None and not args.hardware and not torch.cuda.is_available():
        # Before profiling: a CPU has no capacity to default to.
        raise UsageError("--memory-budget SIZE is needed to plan for a CPU (no device capacity "
                         "to default to)")
    stages, default_budget = _costs(args, flags, argv)
    budget = default_budget if budget is None else budget
    try:
        plans = plan_stages(stages, budget, **options)
    except InfeasibleBudget as exc:
        exc = with_lossy_hint(exc, stages, "--lossy-sources", **options)
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
    """``adacc``'s exit status: 0 planned, 2 a bad request or an infeasible budget."""
    megatron_compat.quiet_missing_kernel_notices()
    parser = _build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        return _plan_command(args, rest)
    except (UsageError, InputError) as exc:
        print(f"adacc {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
