"""Train a megatron-core GPT with Adacc's activation-memory optimiser.

    python pretrain_gpt.py --config configs/tiny-cpu.yaml
    torchrun --nproc_per_node 2 pretrain_gpt.py --config configs/tiny-cpu.yaml \
        --tensor-model-parallel-size 2
"""
from __future__ import annotations

import os
import sys
import warnings


def main(argv: list[str] | None = None) -> int:
    # megatron-core warns at import about every optional fused kernel it cannot find.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    from megatron_adacc.arguments import parse_args
    from megatron_adacc.numerics import NonFiniteError
    from megatron_adacc.trainer import Trainer

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args = parse_args(argv, world_size)
        Trainer(args).train()
    except (ValueError, FileNotFoundError) as exc:  # errors.InputError is a ValueError
        print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr)
        return 2
    except NonFiniteError as exc:  # not bad input: the run diverged
        print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
