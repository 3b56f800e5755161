"""Atomic, durable checkpoints: model, optimizer, scheduler, RNG and data position.

Layout (Megatron-LM's): ``<dir>/iter_0000042/mp_rank_00/model_optim_rng.pt``, a directory
per model-parallel rank, ``mp_rank_<tensor rank>`` or, with pipeline stages,
``mp_rank_<tensor rank>_<pipeline stage>`` (each stage saves its own layers); its file is
written by data-parallel rank 0 and read by every data-parallel rank (their states are
replicas), except that with a sharded optimizer each data-parallel rank writes and reads its
own ``model_optim_rng_dp<rank>.pt``; and ``<dir>/latest`` naming the newest complete
iteration. A save writes into a staging directory, fsyncs every file,
renames the directory into place once every rank has finished, and only then rewrites
``latest`` (write, fsync, rename), so a save killed at any point leaves ``latest`` pointing at
the previous complete checkpoint; the next save removes what the killed one left behind.
The data position needs no state of its own: batches are a function of the iteration.

Files are read with ``torch.load(weights_only=True)``: a checkpoint from someone else cannot
run code. Everything saved is therefore tensors and plain Python values (the numpy RNG key is
kept as a tensor). A newest checkpoint that cannot be read falls back to the newest intact
one with a warning; no checkpoint holding NaN or Inf is ever written.
"""
from __future__ import annotations

import os
import pickle
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.distributed as dist

from megatron_adacc import numerics
from megatron_adacc.errors import InputError

FORMAT_VERSION = 2  # 2: read with weights_only (numpy RNG key as a tensor)
_STAGING_PREFIX = ".staging_iter_"


class CheckpointError(InputError):
    """A checkpoint that cannot be loaded into this run."""


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    numpy_state = numpy.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {"bit_generator": numpy_state["bit_generator"],
                  "key": torch.from_numpy(numpy_state["state"]["key"].astype(numpy.int64)),
                  "pos": numpy_state["state"]["pos"],
                  "has_gauss": numpy_state["has_gauss"], "gauss": numpy_state["gauss"]},
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    saved = state["numpy"]
    random.setstate(state["python"])
    numpy.random.set_state({
        "bit_generator": saved["bit_generator"],
        "state": {"key": saved["key"].numpy().astype(numpy.uint32), "pos": saved["pos"]},
        "has_gauss": saved["has_gauss"], "gauss": saved["gauss"]})
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _parallel_sizes() -> dict[str, int]:
    from megatron.core import parallel_state

    return {"tensor": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline": parallel_state.get_pipeline_model_parallel_world_size()}


def _model_parallel_dir(directory: Path) -> Path:
    from megatron.core import parallel_state

    name = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{parallel_state.get_pipeline_model_parallel_rank():03d}"
    return directory / name


def _shard_file(directory: Path) -> Path:
    from megatron.core import parallel_state

    return (_model_parallel_dir(directory)
            / f"model_optim_rng_dp{parallel_state.get_data_parallel_rank():03d}.pt")


def _written_file(directory: Path, optimizer) -> Path | None:
    """The file this rank writes, or None: data-parallel ranks hold replicas, so their rank
    0 writes ``model_optim_rng.pt``, unless the optimizer state is sharded over them
    (--use-distributed-optimizer), when each writes its own shard's file."""
    from megatron.core import parallel_state

    if getattr(optimizer, "shards", 1) > 1:
        return _shard_file(directory)
    if parallel_state.get_data_parallel_rank() == 0:
        return _model_parallel_dir(directory) / "model_optim_rng.pt"
    return None


def _read_file(directory: Path) -> Path:
    """The file this rank resumes from: its own shard's when there is one."""
    shard = _shard_file(directory)
    return shard if shard.is_file() else shard.parent / "model_optim_rng.pt"


def _iteration_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _warn(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def save(directory: str | Path, iteration: int, model, optimizer, scheduler,
         extra: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint of ``iteration`` on every rank (collective). Raises
    NonFiniteError, writing nothing, when a weight or optimizer state holds NaN or Inf."""
    root = Path(directory)
    final = _iteration_dir(root, iteration)
    staging = root / f"{_STAGING_PREFIX}{iteration:07d}"
    payload = {
        "format": FORMAT_VERSION,
        "iteration": iteration,
        "parallel": _parallel_sizes(),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": _rng_state(),
        "extra": extra or {},
    }
    bad = numerics.first_non_finite({"model": payload["model"],
                                     "optimizer": payload["optimizer"]})
    if not numerics.agree(bad is None):
        raise numerics.NonFiniteError(
            f"checkpoint of iteration {iteration} not written to {root}: "
            f"{bad or 'a tensor on another rank'} holds NaN or Inf"
        )
    if dist.get_rank() == 0:
        # A save is collective, so no other save of this run is under way: any staging
        # directory is what a killed save left behind.
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{_STAGING_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging.mkdir()
    dist.barrier()
    path = _written_file(staging, optimizer)
    if path is not None:
        path.parent.mkdir(exist_ok=True)
        with path.open("wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        _fsync_dir(path.parent)
    dist.barrier()
    if dist.get_rank() == 0:
        _fsync_dir(staging)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        _fsync_dir(root)
        _fsync_write(root / "latest", f"{iteration}\n")
    dist.barrier()
    return final


def latest_iteration(directory: str | Path) -> int | None:
    marker = Path(directory) / "latest"
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{marker} is damaged ({text!r}); delete it or point --load "
                              f"elsewhere")
    return int(text)


def _candidates(root: Path) -> list[int]:
    """Iterations to try, newest first: ``latest`` and the saved ones before it (all saved
    ones when ``latest`` is missing: a save killed between publishing and ``latest``)."""
    saved = {int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit()}
    latest = latest_iteration(root)
    if latest is not None:
        saved = {i for i in saved if i < latest} | {latest}
    return sorted(saved, reverse=True)


def _read(path: Path) -> tuple[dict | None, str | None]:
    """(payload, None), or (None, what is wrong with the file)."""
    if not path.is_file():
        others = sorted(d.name for d in path.parent.parent.glob("mp_rank_*") if d.is_dir())
        if others and path.parent.name not in others:
            return None, (f"missing (the checkpoint holds {', '.join(others)}: written with "
                          f"other --tensor-model-parallel-size or "
                          f"--pipeline-model-parallel-size)")
        return None, "missing"
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return None, "not plain tensors and values (loading it could run code), refused"
    except Exception as exc:  # truncated or corrupt: torch's first sentence says how
        return None, f"unreadable ({str(exc).strip().split('. ')[0]})"
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        found = payload.get("format") if isinstance(payload, dict) else None
        return None, f"not a checkpoint of format {FORMAT_VERSION} (format {found})"
    sizes = _parallel_sizes()
    if payload["parallel"] != sizes:
        return None, (f"written with --tensor-model-parallel-size {payload['parallel']['tensor']} "
                      f"--pipeline-model-parallel-size {payload['parallel']['pipeline']}, this "
                      f"run has {sizes['tensor']} and {sizes['pipeline']}")
    return payload, None


def _check_shapes(path: Path, saved: dict, model) -> None:
    expected = model.state_dict()
    hint = "load it with the model flags it was saved with (--num-layers, --hidden-size, ...)"
    for name, tensor in expected.items():
        if name not in saved:
            raise CheckpointError(f"checkpoint {path} does not fit this model: it has no "
                                  f"{name}; {hint}")
        if (isinstance(tensor, torch.Tensor) and isinstance(saved[name], torch.Tensor)
                and saved[name].shape != tensor.shape):
            raise CheckpointError(
                f"checkpoint {path} does not fit this model: {name} is "
                f"{list(saved[name].shape)} there, {list(tensor.shape)} here; {hint}")
    extra = sorted(saved.keys() - expected.keys())
    if extra:
        raise CheckpointError(f"checkpoint {path} does not fit this model: it has {extra[0]}, "
                              f"which this model does not; {hint}")


def load(directory: str | Path, model, optimizer, scheduler) -> tuple[int, dict[str, Any]]:
    """Restore everything ``save`` wrote; returns (iteration, extra). No checkpoint: a
    warning and (0, {}). A damaged newest checkpoint falls back to the newest intact one."""
    root = Path(directory)
    candidates = _candidates(root)
    if not candidates:
        _warn(f"--load {directory}: no checkpoint there (no 'latest', no iter_*); training "
              f"starts from scratch")
        return 0, {}
    newest = None
    for iteration in candidates:
        path = _read_file(_iteration_dir(root, iteration))
        payload, problem = _read(path)
        # Every rank resumes from the same iteration, so a file damaged on one rank only
        # sends all of them further back.
        if not numerics.agree(problem is None):
            newest = newest or (path, problem or "damaged on another rank")
            continue
        if newest is not None:
            _warn(f"checkpoint {newest[0]} is {newest[1]}; resuming from the newest intact "
                  f"one, {_iteration_dir(root, iteration)}")
        _check_shapes(path, payload["model"], model)
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        scheduler.load_state_dict(payload["scheduler"])
        _set_rng_state(payload["rng"])
        return payload["iteration"], payload["extra"]
    raise CheckpointError(f"--load {directory}: no intact checkpoint; the newest, {newest[0]}, "
                          f"is {newest[1]}; point --load elsewhere or drop it to start afresh")


def nothing_to_train(load: str | None, iteration: int, train_iters: int, last: int) -> bool:
    """Whether a run resumed at ``iteration`` has nothing to do before ``last`` (its
    --train-iters or --exit-interval), said on stderr; resuming past it is an error."""
    if iteration < last:
        return False
    flag = "--train-iters" if last == train_iters else "--exit-interval"
    where = "past" if iteration > last else "already at"
    message = f"--load {load} is at iteration {iteration}, {where} {flag} {last}: nothing to train"
    if iteration > last:
        raise CheckpointError(f"{message} (raise {flag})")
    if dist.get_rank() == 0:
        print(f"pretrain_gpt.py: {message}", file=sys.stderr, flush=True)
    return True
