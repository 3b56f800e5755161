"""The process around Megatron-LM's ``pretrain``: flags in, one line and an exit status out.

- ``--config FILE``: YAML whose keys are flag names, read before the command line's flags (which
  win).
- Megatron-LM's parser and ``validate_args``: their usage dumps and assertions become one line and
  exit status 2.
- A single process without torchrun gets a world of one. A host without CUDA gets gloo and
  megatron_compat's CPU defaults. Without data flags, the run reads the built-in corpus.
- Ctrl-C (130), SIGTERM (143) and a diverged run (1) end in one line, without a traceback.
- A checkpoint load Megatron-LM gives up on (it prints why and exits 0), and a checkpoint of another
  model, end in one line with status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import re
import signal
import sys
from pathlib import Path
from typing import Callable, Sequence

import yaml

from megatron_adacc.common.errors import InputError, first_line
from megatron_adacc.megatron_lm import ConfigError, add_arguments


class Diverged(RuntimeError):
    """The loss or gradient went non-finite and Megatron-LM stopped the run."""


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's parser with Adacc's flags: what ``--config`` keys are checked against."""
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    return add_arguments(add_megatron_arguments(parser))


def config_argv(argv: Sequence[str], parser: argparse.ArgumentParser | None = None
                ) -> list[str]:
    """``argv`` with ``--config FILE`` replaced by the file's flags, placed first."""
    argv = list(argv)
    if "--config" not in argv:
        return argv
    if argv.count("--config") > 1:
        raise ConfigError("--config is given twice; give one file, and the other's flags on "
                          "the command line")
    at = argv.index("--config")
    if at + 1 >= len(argv):
        raise ConfigError("--config: expected a YAML file")
    path, rest = argv[at + 1], argv[:at] + argv[at + 2:]
    return _flags_of(read_config(path), path, parser or build_parser()) + rest


def read_config(path: str) -> dict:
    """A ``--config`` file's mapping of flag name to value."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path}: file not found")
    try:
        values = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})")
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag-name: value")
    return values


def _flags_of(values: dict, path: str, parser: argparse.ArgumentParser) -> list[str]:
    actions = {option: action for action in parser._actions
               for option in action.option_strings}
    flags: list[str] = []
    seen: dict[str, str] = {}
    for key, value in values.items():
        option = "--" + str(key).replace("_", "-")
        action = actions.get(option)
        if action is None:
            raise ConfigError(f"--config {path}: unknown key {key!r} (keys are the "
                              f"command-line flag names, e.g. num-layers)")
        if option in seen:
            raise ConfigError(f"--config {path}: {seen[option]} and {key} are one flag, "
                              f"{option}; keep one")
        seen[option] = str(key)
        if isinstance(value, list) and action.nargs is None:
            raise ConfigError(f"--config {path}: {key}: takes one value, got a list")
        if action.nargs == 0:  # store_true / store_false
            if not isinstance(value, bool):
                raise ConfigError(f"--config {path}: {key}: must be true or false, "
                                  f"got {value!r}")
            flags += [option] if value else []
        elif value is not None:
            items = value if isinstance(value, list) else [value]
            flags += [option, *(_yaml_number(item, action) for item in items)]
    return flags


def _yaml_number(value, action: argparse.Action) -> str:
    """A config value as a flag's text.

    YAML 1.1 reads 1e3 as a string; an integer flag takes it as 1000."""
    if (action.type is int and isinstance(value, str)
            and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", value)
            and float(value).is_integer()):
        return str(int(float(value)))
    return str(value)


@contextlib.contextmanager
def _one_line_parse_errors():
    """argparse's usage-and-exit as a ConfigError."""
    def error(self, message):
        raise ConfigError(message)

    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original


def parse(argv: Sequence[str], prog: str = "pretrain_gpt.py") -> argparse.Namespace:
    """Megatron-LM's flags (``parse_and_validate_args``), each refusal a ConfigError."""
    import torch
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    from megatron_adacc import megatron_compat

    argv = config_argv(argv)
    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        with _one_line_parse_errors():
            args = parse_args(extra_args_provider=add_arguments)
    except KeyError as exc:  # an enum flag's type (AttnBackend[...]) fails past argparse
        value = exc.args[0] if exc.args else ""
        flag = next((argv[at - 1] for at in range(1, len(argv)) if argv[at] == value
                     and argv[at - 1].startswith("--")), "a flag")
        raise ConfigError(f"argument {flag}: invalid choice: {value!r}") from None
    finally:
        sys.argv = saved
    off = megatron_compat.kernel_arg_defaults(args)
    if not torch.cuda.is_available():
        args.distributed_backend = "gloo"
    elif off and int(os.environ.get("RANK", "0")) == 0:
        print(f"{prog}: no fused kernel installed for {', '.join(off)}: megatron-core's "
              "plain path runs them", file=sys.stderr, flush=True)
    if args.seed <= 0:  # Megatron-LM raises a ValueError once the process groups exist
        raise ConfigError(f"--seed {args.seed}: Megatron-LM seeds with a positive integer")
    if args.init_model_with_meta_device and not (args.use_torch_fsdp2 or args.use_megatron_fsdp):
        # Megatron-LM 0.19.2 materialises the meta weights with empty_like, and only an FSDP
        # wrapper initialises them: the run would train on whatever memory held.
        raise ConfigError("--init-model-with-meta-device leaves the weights uninitialised "
                          "without an FSDP wrapper (--use-megatron-fsdp, --use-torch-fsdp2); "
                          "drop it")
    if args.lr is None:  # Megatron-LM would pass it on to torch's AdamW, which raises TypeError
        raise ConfigError("--lr is required: Megatron-LM has no default learning rate")
    _check_profile(args)
    _check_cuda_only_flags(args)
    _check_packages(args)  # before validate_args, which imports some of them itself
    _check_outputs(args)
    _default_data(args)
    try:
        # Megatron-LM's pretrain_gpt.py default, given only where no tokenizer is (it warns
        # on stderr about overriding one).
        validate_args(args, {} if args.tokenizer_type else {"tokenizer_type": "GPT2BPETokenizer"})
    except (AssertionError, ValueError) as exc:  # e.g. --fp4-format without its kernels
        raise ConfigError(assertion_line(exc)) from None
    _check_transformer_engine(args)
    _check_tokenizer_files(args)
    megatron_compat.eval_interval_default(args)
    if args.wandb_project and not (args.wandb_save_dir or args.save):
        # Megatron-LM joins None to a path, a TypeError, when it builds the writer.
        raise ConfigError("--wandb-project writes under --wandb-save-dir, by default --save's "
                          "wandb/: give one of them")
    try:  # the tokenizer and the loggers: e.g. a wandb project without --wandb-exp-name
        set_global_variables(args)
    except ValueError as exc:
        raise ConfigError(assertion_line(exc)) from None
    except Exception as exc:
        if not type(exc).__module__.startswith("wandb."):
            raise
        # wandb.init refused: no API key (wandb login, or WANDB_MODE=offline), say
        raise ConfigError(f"--wandb-project {args.wandb_project}: wandb: "
                          f"{assertion_line(exc)}") from None
    return args


def assertion_line(exc: Exception) -> str:
    """One line for a Megatron-LM refusal: its message, and where it names no flag, the check.

    Megatron-LM's messages can be terse ("expected sample-based training"); a check on ``args``
    names the flags (``assert args.train_iters is None (arguments.py:1253)``). An assertion with
    no message is quoted whatever it checks."""
    import traceback

    message = first_line(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    if not isinstance(exc, AssertionError) or not frames or "--" in message:
        return message or "Megatron-LM refused the flags"
    where = frames[-1]
    condition = _asserted(where.filename, where.lineno) or where.line or ""
    condition = condition.removeprefix("assert ")
    if not condition or (message and not re.search(r"\bargs\.", condition)):
        return message or "Megatron-LM refused the flags"
    check = f"assert {condition} ({Path(where.filename).name}:{where.lineno})"
    return f"{message}: {check}" if message else f"Megatron-LM refused the flags: {check}"


def _asserted(filename: str, lineno: int) -> str | None:
    """The condition of the assert statement at ``filename:lineno``, whole; None if not found."""
    import ast
    import linecache

    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return None
    found = [node for node in ast.walk(tree) if isinstance(node, ast.Assert)
             and node.lineno <= lineno <= (node.end_lineno or node.lineno)]
    return ast.unparse(found[-1].test) if found else None


def _check_profile(args: argparse.Namespace) -> None:
    """--profile's flags that Megatron-LM would only trip over mid-run, in one line."""
    import torch

    if not args.profile:
        return
    if args.use_pytorch_profiler and not args.tensorboard_dir:
        raise ConfigError("--use-pytorch-profiler writes its traces to --tensorboard-dir; "
                          "give one")
    if not args.use_pytorch_profiler and not torch.cuda.is_available():
        raise ConfigError("--profile marks a CUDA profiler range for nsys, and this machine "
                          "has no GPU; add --use-pytorch-profiler (and --tensorboard-dir)")
    if args.profile_step_end <= args.profile_step_start:
        raise ConfigError(f"--profile-step-end {args.profile_step_end} must be after "
                          f"--profile-step-start {args.profile_step_start}")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    outside = [rank for rank in args.profile_ranks if rank >= world_size]
    if outside:
        raise ConfigError(f"--profile-ranks {' '.join(map(str, outside))}: no such rank in a "
                          f"world of {world_size}")


def _check_transformer_engine(args: argparse.Namespace) -> None:
    """ConfigError when the layers would be Transformer Engine's and it is not installed.

    megatron-core builds its layer spec with None for every class it lacks, and the first layer
    dies in a TypeError. After validate_args, so that the flags' own faults come first."""
    from megatron_adacc.megatron_compat import importable

    if (args.transformer_impl == "transformer_engine" and args.spec is None
            and not importable("transformer_engine")):
        raise ConfigError("--transformer-impl transformer_engine (Megatron-LM's default) needs "
                          "the transformer-engine package, which is not installed; add "
                          "--transformer-impl local (megatron-core's own layers), or pip "
                          "install transformer-engine")


def _check_tokenizer_files(args: argparse.Namespace) -> None:
    """ConfigError when GPT-2's tokenizer would be downloaded by a package that is missing.

    Megatron-LM fetches GPT-2's vocabulary and merges when no file is given, with the wget
    package; without it the build dies in a traceback."""
    from megatron_adacc.megatron_compat import importable

    if (args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file)
            and not importable("wget")):
        raise ConfigError("--tokenizer-type GPT2BPETokenizer (Megatron-LM's default) needs "
                          "--vocab-file and --merge-file: without them Megatron-LM downloads "
                          "GPT-2's with the wget package, which is not installed; data already "
                          "in token ids (--mock-data) takes --tokenizer-type NullTokenizer "
                          "--vocab-size N")


# Megatron-LM's optimizers from the emerging-optimizers package.
EMERGING_OPTIMIZERS = ("muon", "dist_muon", "lion", "soap", "adaptive_muon")
# Flags whose code comes from a package megatron-core does not install, each with the module
# and its pip name: without it the run died in an ImportError traceback.
PACKAGE_FLAGS = (
    (lambda args: args.optimizer in EMERGING_OPTIMIZERS, "--optimizer {optimizer}",
     "emerging_optimizers", "emerging-optimizers"),
    (lambda args: args.enable_ft_package, "--enable-ft-package", "nvidia_resiliency_ext",
     "nvidia-resiliency-ext"),
    # megatron-core finds the fused router missing only in the first forward
    (lambda args: args.moe_router_fusion, "--moe-router-fusion", "transformer_engine",
     "transformer-engine"),
    # these two at the first save
    (lambda args: args.non_persistent_ckpt_type == "local", "--non-persistent-ckpt-type local",
     "nvidia_resiliency_ext", "nvidia-resiliency-ext"),
    (lambda args: (args.async_save and args.use_persistent_ckpt_worker
                   and args.async_strategy == "nvrx"),
     "--async-save --use-persistent-ckpt-worker --async-strategy nvrx", "nvidia_resiliency_ext",
     "nvidia-resiliency-ext"),
)


def _check_packages(args: argparse.Namespace) -> None:
    from megatron_adacc.megatron_compat import importable

    for given, flag, module, package in PACKAGE_FLAGS:
        if given(args) and not importable(module):
            raise ConfigError(f"{flag.format(**vars(args))} needs the {package} package, which "
                              f"is not installed (pip install {package})")


# Megatron-LM's flags that only a GPU can run (all of a tuple given together), with what they
# need of it: on a host they failed in a traceback, at the model's wrapping, in the first
# step's log, or in a worker process (the persistent one, which then left the run hanging).
CUDA_ONLY_FLAGS = {
    ("log_memory_to_tensorboard",): "reads the GPU's memory",
    ("log_device_memory_used",): "reads the GPU's memory",
    ("record_memory_history",): "reads the GPU's memory",
    ("use_torch_fsdp2",): "shards over a CUDA device mesh",
    ("use_megatron_fsdp",): "shards over a CUDA device mesh",
    ("cuda_graph_impl",): "captures CUDA graphs",
    ("check_weight_hash_across_dp_replicas_interval",): "gathers weights' hashes on the GPU",
    ("moe_grouped_gemm",): "runs the experts' grouped GEMMs on the GPU",
    ("moe_shared_expert_overlap",): "overlaps the shared experts on a CUDA stream",
    ("async_save", "use_persistent_ckpt_worker"): "saves from a worker process on a GPU",
}


def _check_cuda_only_flags(args: argparse.Namespace) -> None:
    import torch

    def given(name: str) -> bool:
        return getattr(args, name, None) not in (None, False, "none")

    def text(name: str) -> str:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        return flag if value is True else f"{flag} {value}"

    for names, needs in CUDA_ONLY_FLAGS.items():
        if all(map(given, names)) and not torch.cuda.is_available():
            raise ConfigError(f"{' '.join(map(text, names))} {needs}, and this machine has no "
                              f"GPU; drop {'it' if len(names) == 1 else 'them'}")


def _check_outputs(args: argparse.Namespace) -> None:
    """Check every path the run will write, before anything is built; nothing is created here.

    A save failing after the last step would lose the run."""
    from megatron_adacc import corpus, policies
    from megatron_adacc.profiling.profile_db import ProfileDB

    for flag, path in (("--save", args.save), ("--tensorboard-dir", args.tensorboard_dir)):
        if path:
            check_writable(path, flag, directory=True)
    if args.metrics_file:
        check_writable(args.metrics_file, "--metrics-file", directory=False)
    if not (args.mock_data or args.data_path or args.train_data_path
            or corpus.demo_corpus_ready()):
        check_writable(corpus.demo_corpus_prefixes()[0].parent,
                       "$ADACC_DATA_DIR (the demo corpus, no --data-path)", directory=True)
    if args.adacc_policy in policies.AUTO_POLICIES:  # they profile into the ProfileDB
        check_writable(ProfileDB(args.adacc_profile_db).path, "--adacc-profile-db",
                       directory=False)


def check_writable(path: str | Path, flag: str, directory: bool) -> None:
    """ConfigError naming ``flag`` unless ``path`` is or can be made a writable directory or file.

    ``directory`` says which; parents may be made too."""
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


def _default_data(args: argparse.Namespace) -> None:
    """No data flags: the built-in corpus, bytes read through NullTokenizer."""
    from megatron_adacc import corpus

    given = (args.data_path, args.train_data_path, args.valid_data_path, args.test_data_path,
             getattr(args, "data_args_path", None), getattr(args, "per_split_data_args_path",
                                                            None))
    if args.mock_data or any(given):
        for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
            for prefix in _prefixes(getattr(args, flag)):
                corpus.check_dataset(prefix, f"--{flag.replace('_', '-')}")
        for prefix in _prefixes(args.data_path):
            _check_split(prefix, args)
        return
    train, valid = corpus.prepare_demo_corpus()
    args.train_data_path, args.valid_data_path, args.test_data_path = [train], [valid], [valid]
    # A config's own vocabulary (a Llama's 128256) is kept, the bytes its first ids, so the
    # model trained is the shape the config describes (and `adacc plan` plans).
    args.tokenizer_type = "NullTokenizer"
    args.vocab_size = max(args.vocab_size or 0, corpus.ByteTokenizer.vocab_size)
    args.null_tokenizer_eod_id = corpus.ByteTokenizer.eod  # NullTokenizer reads it by name


def _check_split(prefix: str, args: argparse.Namespace) -> None:
    """ConfigError when a split the run reads holds less than one sample of ``prefix``.

    Megatron-LM's GPTDataset would add epochs of it without end."""
    import numpy
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)
    from megatron.core.datasets.indexed_dataset import _IndexReader

    split = args.split or "969, 30, 1"  # validate_args' default, set after this check
    try:
        weights = parse_and_normalize_split(split)
        if not all(math.isfinite(weight) for weight in weights):
            raise ValueError("expected up to three weights >= 0, the first > 0")
        matrix = convert_split_vector_to_split_matrix(weights)
    except (AssertionError, ValueError) as exc:
        raise ConfigError(f"--split {split}: {assertion_line(exc)}") from None
    index = _IndexReader(f"{prefix}.idx", multimodal=False)
    documents = len(index.document_indices) - 1
    read = ("train",) + (("valid", "test") if args.eval_iters > 0 else ())
    for name, bounds in zip(("train", "valid", "test"), matrix):
        if name not in read or bounds is None:
            continue
        begin, end = (int(round(bound * documents)) for bound in bounds)
        first, last = index.document_indices[begin], index.document_indices[end]
        tokens = int(numpy.sum(index.sequence_lengths[first:last]))
        if (tokens - 1) // args.seq_length < 1:
            raise ConfigError(
                f"dataset {prefix}: its {name} split (--split {split}) gets {end - begin} "
                f"of its {documents} documents, {tokens} tokens, less than one sample of "
                f"--seq-length {args.seq_length}; add documents or change --split")


def _prefixes(paths) -> list[str]:
    """The dataset prefixes of a blend (``A``, or ``0.3 A 0.7 B``)."""
    if not paths:
        return []
    items = paths[0].split() if len(paths) == 1 else list(paths)
    try:
        float(items[0])
        return items[1::2]
    except ValueError:
        return items


def _world_of_one() -> None:
    """A plain ``python`` run: torch.distributed's environment for one process."""
    if "WORLD_SIZE" in os.environ:
        return
    # Port 0: the store binds a free port itself (no one else connects to a world of one), so
    # runs started together never race for one a probe found free.
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="0")


def teardown(owns_process_group: bool) -> None:
    """Reset Megatron-LM's global state, so the next run in this process starts afresh.

    The process group and model-parallel state are reset too when this run set them up; a
    caller's stay theirs."""
    import torch.distributed as dist
    from megatron.core import num_microbatches_calculator, rerun_state_machine
    from megatron.training import global_vars, training

    if owns_process_group:
        training.destroy_global_state()
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    # The caller's model-parallel state stays whole, its global memory buffer included:
    # initialize_megatron finds it initialized next time and makes no new buffer.
    global_vars.destroy_global_vars()
    num_microbatches_calculator.destroy_num_microbatches_calculator()
    rerun_state_machine.destroy_rerun_state_machine()


class _Interrupts:
    """SIGINT and SIGTERM (torchrun stopping its workers) raise KeyboardInterrupt, and stay noted.

    So an interrupt swallowed by C code calling back into Python still ends the run at the end of
    its step (see ``_stop_if_interrupted``)."""

    received: int | None = None

    def __enter__(self):
        _Interrupts.received = None
        self._previous = {number: signal.signal(number, self._raise)
                          for number in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for number, previous in self._previous.items():
            signal.signal(number, previous)

    @staticmethod
    def _raise(signum, frame):
        _Interrupts.received = signum
        raise _Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


class _Terminated(KeyboardInterrupt):
    pass


# Megatron-core sets these from --attention-backend when it builds a GPTModel and asserts
# they agree with the backend: a run's are its own, whatever ran before it in the process.
TE_ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@contextlib.contextmanager
def _own_attention_env():
    saved = {name: os.environ.pop(name) for name in TE_ATTENTION_ENV if name in os.environ}
    try:
        yield
    finally:
        for name in TE_ATTENTION_ENV:
            os.environ.pop(name, None)
        os.environ.update(saved)


def _stop_if_interrupted(original, *args, **kwargs):
    """Megatron-LM's ``checkpoint_and_decide_exit``, then the interrupt a step swallowed."""
    result = original(*args, **kwargs)
    if _Interrupts.received is not None:
        raise _Terminated() if _Interrupts.received == signal.SIGTERM else KeyboardInterrupt()
    return result


def _wrap(owner, name: str, wrapper: Callable) -> None:
    """``owner.<name>`` (a module's function or a class's method) as ``wrapper(original, ...)``.

    Wrapping again replaces the wrapper, never nests it."""
    original = getattr(owner, name)
    original = getattr(original, "__wrapped_by_launch__", original)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        return wrapper(original, *args, **kwargs)

    wrapped.__wrapped_by_launch__ = original
    setattr(owner, name, wrapped)


def _built_or_refused(original, *args, **kwargs):
    """Megatron-LM's model build, whose config checks (assertions, ValueErrors) are bad flags.

    megatron-core asserts some flags only while it builds a layer, e.g. the DeepEP dispatcher's
    parallel sizes, and so does the flash core attention its own."""
    try:
        return original(*args, **kwargs)
    except (AssertionError, ValueError) as exc:
        # megatron-core's build_module adds the module it was building, once per level
        raise ConfigError(re.sub(r"( when instantiating \w+)+", "", assertion_line(exc))
                          ) from None


def _loaded_or_refused(original, *args, **kwargs):
    """Megatron-LM's ``load_checkpoint``; a failed load, or another model's checkpoint, is status 2.

    On a failed load Megatron-LM prints why and exits with status 0, as if the run had trained.
    A checkpoint of another model's shapes or parameters ended in a traceback from DCP."""
    from megatron.training import get_args

    try:
        return original(*args, **kwargs)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
        load = get_args().load
        if get_args().exit_on_missing_checkpoint and latest_checkpoint(load) is None:
            raise InputError(f"--load {load}: no checkpoint there, and "
                             f"--exit-on-missing-checkpoint stops the run") from None
        raise InputError(f"--load {load}: Megatron-LM could not load the checkpoint (its "
                         f"reason is printed above)") from None
    except BaseException as exc:  # DCP's CheckpointException is no Exception
        why = _load_failure(exc)
        if why is None:
            raise
        raise InputError(f"--load {get_args().load}: {why}") from None


_OTHER_MODEL = ("the checkpoint holds another model than these flags build ({}); give the model "
                "flags it was saved with")
# What megatron-core, Megatron-LM and torch say when a checkpoint cannot be this run's, each with
# the line that says so: one parameter's shape, or one missing from the checkpoint; an
# architecture flag or the optimizer's parameters of a --ckpt-format torch checkpoint (the
# distributed optimizer's, or torch's groups); or the format itself.
_LOAD_FAILURES = (
    (re.compile(r"^Global shape mismatch for loaded .*"), _OTHER_MODEL),
    (re.compile(r"^\S+ from model not in state dict"), _OTHER_MODEL),
    (re.compile(r"^\w+ value from checkpoint \(.*?\) is not equal to the input argument "
                r"value \(.*?\)"), _OTHER_MODEL),
    (re.compile(r"^loaded state dict contains a parameter group that doesn't match the size "
                r"of optimizer's group"), _OTHER_MODEL),
    (re.compile(r"^Number of unpadded elements must be same in current run \(\d+\) and "
                r"checkpoint \(\d+\)"), _OTHER_MODEL),
    (re.compile(r"^Detected load from a distributed checkpoint, but .*"), "{}"),
)


def _load_failure(exc: BaseException) -> str | None:
    """One line for a checkpoint that cannot be this run's, from the error behind ``exc``."""
    from megatron_adacc import safe_checkpoint

    for found in safe_checkpoint.behind(exc, (Exception,)):
        text = found.args[0] if found.args and isinstance(found.args[0], str) else ""
        for pattern, line in _LOAD_FAILURES:
            match = pattern.match(text)
            if match:
                what = match.group(1) if match.groups() else match.group(0)
                return line.format(what.strip().splitlines()[0])
    return None


# Megatron-LM's rerun state machine's exit codes (EXIT_CODE_RESUME_TO_DISAMBIGUATE,
# EXIT_CODE_FAILED_ON_RESULT_VALIDATION): a result, NaN or Inf, failed its validation.
RERUN_EXIT_CODES = (16, 17)


def _iteration(args) -> int:
    """The iteration in progress (Megatron-LM's ``curr_iteration`` counts those done)."""
    done = getattr(args, "curr_iteration", None) if args is not None else None
    return 0 if done is None else done + 1


def latest_checkpoint(directory) -> int | None:
    """The iteration Megatron-LM's tracker file in ``directory`` names; None without one."""
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    if not directory:
        return None
    try:
        text = Path(get_checkpoint_tracker_filename(str(directory))).read_text().strip()
        return int(text)
    except (OSError, ValueError):
        return None


def _interrupted(args) -> str:
    saved = latest_checkpoint(getattr(args, "save", None)) if args is not None else None
    if saved is None:
        return f"interrupted at iteration {_iteration(args)}; no checkpoint saved"
    return (f"interrupted at iteration {_iteration(args)}; last checkpoint: iteration {saved} "
            f"in {args.save} (resume with --load {args.save})")


def _diverged(args) -> Diverged:
    """What Megatron-LM's result validation stopped the run on, as a Diverged."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    call = machine.failed_validation_call
    what = call.caller.message if call is not None else "a result failed validation"
    saved = latest_checkpoint(args.save)
    kept = (f"the weights before it saved as iteration {saved} in {args.save}"
            if saved is not None and saved == _iteration(args) - 1 else "nothing saved")
    return Diverged(f"iteration {_iteration(args)}: {what} ({machine.initial_result}); "
                    f"stopped before the optimizer step, {kept} (lower --lr, or --load the "
                    f"last checkpoint)")


def _flag_assertion(exc: AssertionError, args) -> ConfigError | None:
    """A ConfigError for an assertion of Megatron-LM's learning-rate schedule; None for others.

    Such assertions concern the flags' warm-up and decay, or a --load whose schedule differs."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or Path(frames[-1].filename).name != "optimizer_param_scheduler.py":
        return None
    # the scheduler's own words where it has some: its checks name no flag
    line = first_line(exc) or assertion_line(exc)
    if frames[-1].name == "_check_and_set":  # loading a checkpoint of another schedule
        return ConfigError(f"--load {args.load}: {line}; add --override-opt_param-scheduler "
                           f"to train on the flags' schedule or "
                           f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's")
    return ConfigError(line)


def _choose_checkpoint(args: argparse.Namespace, rank: int) -> None:
    """Restrict every checkpoint read, and pick ``--load``'s newest whole checkpoint.

    When the newest is damaged, it passes an older one as --ckpt-step, with one warning line."""
    from megatron_adacc import safe_checkpoint

    safe_checkpoint.install()
    if not args.load or args.ckpt_step is not None or args.exit_on_missing_checkpoint:
        return

    def warn(line: str) -> None:
        if rank == 0:
            print(f"warning: {line}", file=sys.stderr, flush=True)

    try:
        step = safe_checkpoint.choose_checkpoint(args.load, warn)
    except safe_checkpoint.CheckpointRefused as exc:
        raise InputError(f"--load {args.load}: {exc}") from None
    if step is not None:
        args.ckpt_step = step


def run(argv: Sequence[str], prog: str, pretrain: Callable[[argparse.Namespace], None]) -> int:
    """Parse ``argv`` and call ``pretrain(args)``; returns the exit status."""
    import torch.distributed as dist
    from megatron.training import training
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_adacc import megatron_compat, megatron_lm, safe_checkpoint

    rank = int(os.environ.get("RANK", "0"))
    owns_process_group = not dist.is_initialized()
    _world_of_one()
    args = None
    with _Interrupts(), _own_attention_env():
        try:
            try:
                megatron_compat.apply_training()
                _wrap(training, "checkpoint_and_decide_exit", _stop_if_interrupted)
                _wrap(training, "load_checkpoint", _loaded_or_refused)
                _wrap(GPTModelBuilder, "build_model", _built_or_refused)
                args = parse(argv, prog)
                _choose_checkpoint(args, rank)
                try:
                    pretrain(args)
                except AssertionError as exc:
                    raise _flag_assertion(exc, args) or exc
            except SystemExit as exc:  # Megatron-LM's loop ends its early exits so
                if exc.code in RERUN_EXIT_CODES:
                    raise _diverged(args) from None
                if exc.code not in (0, None):
                    raise
        except KeyboardInterrupt as exc:
            if rank == 0:
                print(f"{prog}: {_interrupted(args)}", file=sys.stderr, flush=True)
            return 143 if isinstance(exc, _Terminated) else 130
        except (InputError, FileNotFoundError) as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
            return 2
        except Diverged as exc:
            if rank == 0:
                print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
            return 1
        except SystemExit as exc:  # Megatron-LM ends --exit-interval/-duration with sys.exit
            if isinstance(exc.code, int) or exc.code is None:
                return exc.code or 0
            raise
        except BaseException as exc:  # DCP's CheckpointException is no Exception
            refused = safe_checkpoint.refusal(exc)
            if refused is None:
                raise
            print(f"{prog}: error: --load {args.load}: {refused}", file=sys.stderr, flush=True)
            return 2
        finally:
            current = megatron_lm.session()
            if current is not None:
                current.close()
            # A later caller of Megatron-LM's loop in this process (or a test patching it)
            # meets its own functions, not this run's wrappers around them.
            megatron_lm.release(forget_session=False)
            teardown(owns_process_group)
    return 0
