"""Train a megatron-core GPT with Adacc's activation-memory optimiser.

    python pretrain_gpt.py --config configs/tiny-cpu.yaml
    torchrun --nproc_per_node 2 pretrain_gpt.py --config configs/tiny-cpu.yaml \
        --tensor-model-parallel-size 2

Exit status: 0 trained, 1 the run diverged, 2 bad input (one line on stderr), 130
interrupted (Ctrl-C; 143 on SIGTERM), with one line naming the last checkpoint.
"""
from __future__ import annotations

import os
import signal
import sys
import warnings


class Terminated(KeyboardInterrupt):
    """SIGTERM (torchrun stopping its workers), handled as an interrupt."""


class Interrupts:
    """SIGINT and SIGTERM as KeyboardInterrupt (Terminated for SIGTERM): raised where the
    signal arrives, as Python raises it, and raised again between training steps if that one
    was lost. Code that calls back into Python from C (CPython's, torch's) may clear an
    exception raised inside the callback; a run once trained on past a Ctrl-C that way."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.pending: KeyboardInterrupt | None = None
        self._previous = {}

    def __enter__(self) -> "Interrupts":
        self._previous = {signum: signal.signal(signum, self._arrived) for signum in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _arrived(self, signum, frame):
        self.pending = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        raise self.pending

    def raise_pending(self) -> None:
        """Between steps: the interrupt that arrived and was lost, if one was."""
        if self.pending is not None:
            raise self.pending


def _interrupted_line(args, trainer) -> str:
    from megatron_adacc.training import checkpointing

    iteration = trainer.iteration if trainer is not None else 0
    saved = None
    if args is not None and args.save:
        try:
            saved = checkpointing.latest_iteration(args.save)
        except ValueError:
            saved = None
    last = (f"last checkpoint: iteration {saved} in {args.save} (resume with --load "
            f"{args.save})" if saved is not None else "no checkpoint saved")
    return f"pretrain_gpt.py: interrupted at iteration {iteration}; {last}"


def main(argv: list[str] | None = None) -> int:
    # megatron-core warns at import about every optional fused kernel it cannot find.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    import torch.distributed as dist

    from megatron_adacc.training.arguments import parse_args
    from megatron_adacc.models.build import shutdown_distributed
    from megatron_adacc.training.numerics import NonFiniteError
    from megatron_adacc.training.trainer import Trainer

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    args = trainer = None
    # What this call sets up it shuts down (a caller's own process group stays theirs).
    owns_process_group = not dist.is_initialized()
    with Interrupts() as interrupts:
        try:
            args = parse_args(argv, world_size)
            trainer = Trainer(args)
            trainer.train(between_steps=interrupts.raise_pending)
        except KeyboardInterrupt as exc:  # one line from rank 0, no traceback on any rank
            if rank == 0:
                print(_interrupted_line(args, trainer), file=sys.stderr, flush=True)
            return 143 if isinstance(exc, Terminated) else 130
        except (ValueError, FileNotFoundError) as exc:  # errors.InputError is a ValueError
            print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr)
            return 2
        except NonFiniteError as exc:  # not bad input: the run diverged
            print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr)
            return 1
        finally:
            if owns_process_group:
                shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
