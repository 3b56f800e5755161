"""Builders the pretrain_gpt.py tests share: the tiny run's flags, an in-process run, and a
run in a fresh process that must end without a traceback."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = str(ROOT / "pretrain_gpt.py")
TINY = ["--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--log-interval", "1000",
        "--eval-interval", "0", "--num-layers", "2", "--hidden-size", "64", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "0"]
# Megatron-LM's Llama architecture flags (no dropout, as Llama trains).
LLAMA_FLAGS = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
               "--group-query-attention", "--num-query-groups", "2",
               "--untie-embeddings-and-output-weights", "--disable-bias-linear",
               "--hidden-dropout", "0", "--attention-dropout", "0"]


def train(*flags: str) -> list[dict]:
    """The metrics records of a TINY run with ``flags``, in this process."""
    from megatron_adacc.training.arguments import parse_args
    from megatron_adacc.training.trainer import Trainer

    return Trainer(parse_args(TINY + list(flags))).train()


def losses(records):
    return [r["loss"] for r in records]


def run(script, *flags, cwd, timeout=300):
    """(exit code, last stderr line, whole stderr) of a script run in a fresh process."""
    # PYTHONPATH: scripts/ would otherwise import the installed package, not this checkout.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, script, *map(str, flags)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return done.returncode, (lines[-1] if lines else ""), done.stderr
