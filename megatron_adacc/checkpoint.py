"""Atomic checkpoints: model, optimizer, scheduler, RNG and data position.

Layout: ``<dir>/iter_0000042/rank_000.pt`` (one file per rank) and ``<dir>/latest`` naming
the newest complete iteration. A save writes into a temporary directory, renames it into
place once every rank has finished, and only then rewrites ``latest`` (write-then-rename), so a
save killed at any point leaves ``latest`` pointing at the previous complete checkpoint.
The data position needs no state of its own: batches are a function of the iteration.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.distributed as dist

FORMAT_VERSION = 1


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": numpy.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rank_file(directory: Path) -> Path:
    return directory / f"rank_{dist.get_rank():03d}.pt"


def _fsync_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def save(directory: str | Path, iteration: int, model, optimizer, scheduler,
         extra: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint of ``iteration`` on every rank (collective)."""
    root = Path(directory)
    final = root / f"iter_{iteration:07d}"
    staging = root / f".staging_iter_{iteration:07d}"
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    payload = {
        "format": FORMAT_VERSION,
        "iteration": iteration,
        "world_size": dist.get_world_size(),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": _rng_state(),
        "extra": extra or {},
    }
    target = _rank_file(staging)
    torch.save(payload, target.with_suffix(".tmp"))
    os.replace(target.with_suffix(".tmp"), target)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        _fsync_write(root / "latest", f"{iteration}\n")
    dist.barrier()
    return final


def latest_iteration(directory: str | Path) -> int | None:
    marker = Path(directory) / "latest"
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{marker} is damaged ({text!r}); delete it or point --load elsewhere")
    return int(text)


def load(directory: str | Path, model, optimizer, scheduler) -> tuple[int, dict[str, Any]]:
    """Restore everything ``save`` wrote; returns (iteration, extra). No checkpoint: (0, {})."""
    iteration = latest_iteration(directory)
    if iteration is None:
        return 0, {}
    path = _rank_file(Path(directory) / f"iter_{iteration:07d}")
    if not path.is_file():
        raise ValueError(
            f"checkpoint {path} is missing: was it written with a different number of "
            f"processes (this run has {dist.get_world_size()})?"
        )
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if payload.get("format") != FORMAT_VERSION or payload["world_size"] != dist.get_world_size():
        raise ValueError(
            f"checkpoint {path} was written by {payload.get('world_size')} processes in format "
            f"{payload.get('format')}; this run has {dist.get_world_size()} (format "
            f"{FORMAT_VERSION})"
        )
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    _set_rng_state(payload["rng"])
    return payload["iteration"], payload["extra"]
