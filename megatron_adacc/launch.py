"""The process around Megatron-LM's ``pretrain``: flags in, one line and an exit status out.

- ``--config FILE``: YAML whose keys are flag names, read before the command line's flags
  (which win);
- Megatron-LM's parser and ``validate_args``, whose usage dumps and assertions become one
  line and exit status 2;
- a single process without torchrun gets a world of one; a host without CUDA, gloo and the
  CPU defaults of megatron_compat; no data flags, the built-in corpus;
- Ctrl-C (130), SIGTERM (143) and a diverged run (1) end in one line, without a traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Callable, Sequence

import yaml

from megatron_adacc.common.errors import InputError
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
    for key, value in values.items():
        option = "--" + str(key).replace("_", "-")
        action = actions.get(option)
        if action is None:
            raise ConfigError(f"--config {path}: unknown key {key!r} (keys are the "
                              f"command-line flag names, e.g. num-layers)")
        if action.nargs == 0:  # store_true / store_false
            if not isinstance(value, bool):
                raise ConfigError(f"--config {path}: {key}: must be true or false, "
                                  f"got {value!r}")
            flags += [option] if value else []
        elif value is not None:
            items = value if isinstance(value, list) else [value]
            flags += [option, *map(str, items)]
    return flags


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
    megatron_compat.cpu_arg_defaults(args)
    if not torch.cuda.is_available():
        args.distributed_backend = "gloo"
    _default_data(args)
    try:
        validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    except AssertionError as exc:
        raise ConfigError(str(exc).splitlines()[0] if str(exc) else
                          _bare_assertion(exc)) from None
    set_global_variables(args)
    return args


def _bare_assertion(exc: AssertionError) -> str:
    """A message-less assertion of validate_args as one line: the check that failed."""
    import traceback

    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"Megatron-LM refused the flags: {frame.line} ({Path(frame.filename).name})"


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
        return
    train, valid = corpus.prepare_demo_corpus()
    args.train_data_path, args.valid_data_path, args.test_data_path = [train], [valid], [valid]
    # A config's own vocabulary (a Llama's 128256) is kept, the bytes its first ids, so the
    # model trained is the shape the config describes (and `adacc plan` plans).
    args.tokenizer_type = "NullTokenizer"
    args.vocab_size = max(args.vocab_size or 0, corpus.ByteTokenizer.vocab_size)
    args.null_tokenizer_eod_id = corpus.ByteTokenizer.eod  # NullTokenizer reads it by name


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
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def teardown(owns_process_group: bool) -> None:
    """Megatron-LM's global state, so the next run in this process starts afresh; the process
    group and model-parallel state too when this run set them up (a caller's stay theirs)."""
    import torch.distributed as dist
    from megatron.core import num_microbatches_calculator, rerun_state_machine
    from megatron.training import global_vars, training

    if owns_process_group:
        training.destroy_global_state()
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    global_vars.destroy_global_vars()
    num_microbatches_calculator.destroy_num_microbatches_calculator()
    rerun_state_machine.destroy_rerun_state_machine()


class _Interrupts:
    """SIGTERM as an interrupt (torchrun stopping its workers), like SIGINT."""

    def __enter__(self):
        self._previous = signal.signal(signal.SIGTERM, self._terminated)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self._previous)

    @staticmethod
    def _terminated(signum, frame):
        raise _Terminated()


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


def run(argv: Sequence[str], prog: str, pretrain: Callable[[argparse.Namespace], None]) -> int:
    """Parse ``argv`` and call ``pretrain(args)``; returns the exit status."""
    from megatron_adacc import megatron_compat, megatron_lm

    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    owns_process_group = not dist.is_initialized()
    _world_of_one()
    args = None
    with _Interrupts(), _own_attention_env():
        try:
            megatron_compat.apply_training()
            args = parse(argv, prog)
            pretrain(args)
        except KeyboardInterrupt as exc:
            if rank == 0:
                iteration = getattr(args, "curr_iteration", 0) if args else 0
                print(f"{prog}: interrupted at iteration {iteration}", file=sys.stderr,
                      flush=True)
            return 143 if isinstance(exc, _Terminated) else 130
        except (InputError, FileNotFoundError) as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
            return 2
        except Diverged as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
            return 1
        except SystemExit as exc:  # Megatron-LM ends --exit-interval/-duration with sys.exit
            if isinstance(exc.code, int) or exc.code is None:
                return exc.code or 0
            raise
        finally:
            current = megatron_lm.session()
            if current is not None:
                current.close()
            teardown(owns_process_group)
    return 0
