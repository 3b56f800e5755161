"""Checkpoints with megatron.core.dist_checkpointing (``--ckpt-format torch_dist``) in
Megatron-LM's layout: ``<save>/iter_0000010/`` (the torch_dist files of every rank) and
``<save>/latest_checkpointed_iteration.txt`` naming the newest complete iteration.

What is saved is Megatron-LM's state dict: the model's and the optimizer's sharded state
dicts (the distributed optimizer's in the dp_reshardable format, so a run resumes at another
data-parallel size; the model's reshards to another tensor or pipeline size), the
scheduler, and the random generators of every model-parallel rank. The data position needs
no state of its own: batches are a function of the iteration.

What this module adds to Megatron-LM's save: a model or optimizer state holding NaN or Inf
is never written; the files go to a staging directory that is renamed into place once every
rank has finished, and the tracker file is rewritten (write, fsync, rename) only then, so a
save killed at any point leaves the previous checkpoint the newest; and a newest checkpoint
that cannot be read falls back to the newest intact one with one line on stderr. Loading
runs no code from the checkpoint (megatron_adacc.safe_checkpoint): a file whose pickle names
a global outside its allow-list is refused, naming both, and nothing is loaded.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.distributed as dist

from megatron_adacc import safe_checkpoint
from megatron_adacc.training import numerics
from megatron_adacc.common.errors import InputError

TRACKER = "latest_checkpointed_iteration.txt"
_STAGING_PREFIX = ".staging_iter_"
# The distributed optimizer's state laid out by bucket, resharded over data-parallel ranks
# on load (megatron's fully_reshardable format resumed wrong with several buckets).
_SHARDING_METADATA = {"distrib_optim_sharding_type": "dp_reshardable",
                      "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
# The scheduler's values a resume compares with the flags, and the flag that sets each.
_SCHEDULE_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
                   "wd_incr_steps": "--train-iters", "lr_decay_steps": "--lr-decay-iters",
                   "lr_decay_style": "--lr-decay-style", "start_wd": "--weight-decay"}


class CheckpointError(InputError):
    """A checkpoint that cannot be loaded into this run."""


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _rng_state() -> dict[str, Any]:
    """Every generator, as tensors and plain values (weights_only-loadable)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    numpy_state = numpy.random.get_state(legacy=False)
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(numpy.int64)),
            "pos": numpy_state["state"]["pos"],
            "has_gauss": numpy_state["has_gauss"], "gauss": numpy_state["gauss"]},
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    saved = state["np_rng_state"]
    random.setstate(state["random_rng_state"])
    numpy.random.set_state({
        "bit_generator": saved["bit_generator"],
        "state": {"key": saved["key"].numpy().astype(numpy.uint32), "pos": saved["pos"]},
        "has_gauss": saved["has_gauss"], "gauss": saved["gauss"]})
    torch.set_rng_state(state["torch_rng_state"])
    get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])


def _parallel_sizes() -> dict[str, int]:
    from megatron.core import parallel_state

    return {"tensor": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline": parallel_state.get_pipeline_model_parallel_world_size()}


def _sharded_rng_state():
    """This rank's generators, one object per (pipeline, tensor) rank: data-parallel ranks
    hold replicas."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "rng_state", _rng_state(),
        (parallel_state.get_pipeline_model_parallel_world_size(),
         parallel_state.get_tensor_model_parallel_world_size()),
        (parallel_state.get_pipeline_model_parallel_rank(),
         parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


def _state_dict(model_chunks, optimizer, scheduler, *, iteration: int, with_optimizer: bool,
                with_rng: bool, loading: bool) -> dict[str, Any]:
    """Megatron-LM's checkpoint state dict (sharded where megatron shards it)."""
    model = model_chunks[0].module.sharded_state_dict()
    state: dict[str, Any] = {"checkpoint_version": 3.0, "iteration": iteration,
                             "parallel": _parallel_sizes(), "model": model,
                             "optimizer_layout": _optimizer_layout(model_chunks)}
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(model, is_loading=loading,
                                                          metadata=_SHARDING_METADATA)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _sharded_rng_state()
    return state


def _optimizer_layout(model_chunks) -> dict[str, Any]:
    """What the distributed optimizer's dp_reshardable state is laid out by: DDP's buckets,
    which --overlap-grad-reduce and --ddp-bucket-size decide."""
    config = model_chunks[0].ddp_config
    if not config.use_distributed_optimizer:
        return {}
    return {"--overlap-grad-reduce": config.overlap_grad_reduce,
            "--ddp-bucket-size": config.bucket_size}


def _held_tensors(model_chunks, optimizer) -> dict[str, Any]:
    """What a save must not write when it is not finite: the weights, the optimizer's main
    parameters and its state."""
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    return {"model": {n: p for chunk in model_chunks for n, p in chunk.module.named_parameters()},
            "optimizer": [[p for g in o.param_groups for p in g["params"]] for o in inner]
            + [[t for s in o.state.values() for t in s.values()] for o in inner]}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for directory, _, files in os.walk(path):
        for name in files:
            fd = os.open(Path(directory) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))


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


class Saver:
    """Writes checkpoints; with ``--async-save`` in a background process while training
    goes on (published once written: ``finish`` waits for the last)."""

    def __init__(self, args: argparse.Namespace):
        self.root = Path(args.save) if args.save else None
        self.queue = None
        if args.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.queue = AsyncCallsQueue()

    def save(self, iteration: int, model_chunks, optimizer, scheduler) -> Path:
        """Write the checkpoint of ``iteration`` on every rank (collective). Raises
        NonFiniteError, writing nothing, when a weight or optimizer state holds NaN or
        Inf."""
        from megatron.core import dist_checkpointing

        root = self.root
        bad = numerics.first_non_finite(_held_tensors(model_chunks, optimizer))
        if not numerics.agree(bad is None):
            raise numerics.NonFiniteError(
                f"checkpoint of iteration {iteration} not written to {root}: "
                f"{bad or 'a tensor on another rank'} holds NaN or Inf")
        self.poll(blocking=True)  # one save in flight at a time
        staging = root / f"{_STAGING_PREFIX}{iteration:07d}"
        if dist.get_rank() == 0:
            # A save is collective, so no other save of this run is under way: any staging
            # directory is what a killed save left behind.
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(f"{_STAGING_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)
            staging.mkdir()
        dist.barrier()
        state = _state_dict(model_chunks, optimizer, scheduler, iteration=iteration,
                            with_optimizer=True, with_rng=True, loading=False)
        final = iteration_dir(root, iteration)
        request = dist_checkpointing.save(
            state, str(staging), async_sharded_save=self.queue is not None,
            content_metadata=_SHARDING_METADATA)
        if self.queue is None:
            _publish(root, staging, final, iteration)
        else:
            request.add_finalize_fn(lambda: _publish(root, staging, final, iteration))
            self.queue.schedule_async_request(request)
        return final

    def poll(self, blocking: bool = False) -> None:
        """Publish the background saves that have finished (all of them with
        ``blocking``)."""
        if self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=blocking, no_dist=False)

    def finish(self) -> None:
        self.poll(blocking=True)
        if self.queue is not None:
            self.queue.close()
            self.queue = None


def _publish(root: Path, staging: Path, final: Path, iteration: int) -> None:
    """Once every rank has written: the staging directory becomes ``iter_N`` and the
    tracker names it."""
    dist.barrier()
    if dist.get_rank() == 0:
        _fsync_tree(staging)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        _fsync_dir(root)
        _fsync_write(root / TRACKER, f"{iteration}\n")
    dist.barrier()


def latest_iteration(directory: str | Path) -> int | None:
    marker = Path(directory) / TRACKER
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{marker} is damaged ({text!r}); delete it or point --load "
                              f"elsewhere")
    return int(text)


def _candidates(root: Path) -> list[int]:
    """Iterations to try, newest first: the tracker's and the saved ones before it (all
    saved ones when the tracker is missing: a save killed before publishing it)."""
    saved = {int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit()}
    latest = latest_iteration(root)
    if latest is not None:
        saved = {i for i in saved if i < latest} | {latest}
    return sorted(saved, reverse=True)


def _unreadable() -> tuple[type[BaseException], ...]:
    # torch.distributed.checkpoint raises a BaseException when a rank fails to read.
    from torch.distributed.checkpoint import CheckpointException

    return Exception, CheckpointException


_UNREADABLE = _unreadable()


def _problem(exc: BaseException) -> str:
    """What is wrong with a checkpoint, in a few words: the first sentence of the first
    error underneath (torch.distributed.checkpoint wraps each rank's in ``failures``)."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))[0]
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip().splitlines()[0].split(". ")[0] if str(exc).strip() else ""
    return f"unreadable ({type(exc).__name__}{': ' + text if text else ''})"


def _read(args: argparse.Namespace, read) -> tuple[Any, str | None]:
    """``(read(), None)``, or ``(None, what is wrong)`` when it failed on any rank, so every
    rank resumes from the same iteration. A file that would run code when loaded is refused
    on every rank (CheckpointError), whatever older checkpoints there are."""
    value = refused = problem = None
    try:
        value = read()
    except _UNREADABLE as exc:
        refused = safe_checkpoint.refusal(exc)
        problem = None if refused else _problem(exc)
    if not numerics.agree(refused is None):
        raise CheckpointError(f"--load {args.load}: "
                              f"{refused or 'a file was refused on another rank'}")
    if not numerics.agree(problem is None):
        return None, problem or "damaged on another rank"
    return value, None


def _check_schedule(args: argparse.Namespace, saved: dict, scheduler, directory: str) -> None:
    """Megatron-LM's rule for a resumed schedule: the flags and the checkpoint must agree
    unless --override-opt_param-scheduler (the flags win) or
    --use-checkpoint-opt_param-scheduler (the checkpoint wins) says which wins."""
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    here = scheduler.state_dict()
    for key, flag in _SCHEDULE_FLAGS.items():
        if key in saved and saved[key] != here[key]:
            raise CheckpointError(
                f"--load {directory}: {flag} is {here[key]} here but {saved[key]} in the "
                f"checkpoint; add --override-opt_param-scheduler to train on the flags' "
                f"schedule or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")


def load(args: argparse.Namespace, model_chunks, optimizer, scheduler) -> int:
    """Restore what the flags ask for from ``--load``; returns the iteration to resume at
    (0 with --finetune). No checkpoint: a warning and 0. A damaged newest checkpoint falls
    back to the newest intact one."""
    from megatron.core import dist_checkpointing

    safe_checkpoint.install()
    root = Path(args.load)
    candidates = _candidates(root)
    if not candidates:
        _warn(f"--load {args.load}: no checkpoint there (no {TRACKER}, no iter_*); training "
              f"starts from scratch")
        return 0
    newest = None
    for iteration in candidates:
        path = iteration_dir(root, iteration)
        common, problem = _read(args, lambda: dist_checkpointing.load_common_state_dict(str(path)))
        if problem is not None:  # say how, then try the one before
            newest = newest or (path, problem)
            continue
        with_optimizer, with_rng = _what_to_load(args, common, path, model_chunks)
        state = _state_dict(model_chunks, optimizer, scheduler, iteration=iteration,
                            with_optimizer=with_optimizer, with_rng=with_rng, loading=True)
        loaded, problem = _read(args, lambda: dist_checkpointing.load(state, str(path)))
        if problem is not None:
            newest = newest or (path, problem)
            continue
        if newest is not None:
            _warn(f"checkpoint {newest[0]} is {newest[1]}; resuming from the newest intact "
                  f"one, {path}")
        model_chunks[0].module.load_state_dict(loaded["model"])
        if with_optimizer:
            optimizer.load_state_dict(loaded["optimizer"])
            # A run with nothing left to train (said by nothing_to_train) needs no schedule.
            if loaded["iteration"] < args.train_iters:
                _check_schedule(args, loaded["opt_param_scheduler"], scheduler, args.load)
                scheduler.load_state_dict(loaded["opt_param_scheduler"])
        if with_rng:
            _set_rng_state(loaded["rng_state"])
        return 0 if args.finetune else loaded["iteration"]
    raise CheckpointError(f"--load {args.load}: no intact checkpoint; the newest, {newest[0]}, "
                          f"is {newest[1]}; point --load elsewhere or drop it to start afresh")


def _what_to_load(args: argparse.Namespace, common: dict, path: Path, model_chunks
                  ) -> tuple[bool, bool]:
    """(optimizer and scheduler, random generators) to load, as Megatron-LM decides: not
    with --finetune or their --no-load-* flag; a checkpoint of other tensor or pipeline
    sizes gives its weights only (its optimizer state is refused unless --no-load-optim,
    its generators are skipped with a warning), and so is a distributed optimizer's state
    laid out by other buckets."""
    with_optimizer = not (args.finetune or args.no_load_optim)
    with_rng = not (args.finetune or args.no_load_rng)
    saved, here = common.get("parallel"), _parallel_sizes()
    if saved is not None and saved != here:
        sizes = (f"--tensor-model-parallel-size {saved['tensor']} "
                 f"--pipeline-model-parallel-size {saved['pipeline']}")
        if with_optimizer:
            raise CheckpointError(
                f"--load {args.load}: {path.name} was written with {sizes}, this run has "
                f"{here['tensor']} and {here['pipeline']}; add --no-load-optim to load its "
                f"weights only")
        if with_rng:
            _warn(f"{path} was written with {sizes}: its random generators are not loaded")
            with_rng = False
    layout = common.get("optimizer_layout")
    if with_optimizer and layout and layout != _optimizer_layout(model_chunks):
        here = _optimizer_layout(model_chunks)
        differs = ", ".join(f"{flag} {layout[flag]} there, {here.get(flag)} here"
                            for flag in layout if layout[flag] != here.get(flag))
        raise CheckpointError(
            f"--load {args.load}: {path.name}'s distributed-optimizer state is laid out by "
            f"DDP's buckets ({differs}); resume with the same flags, or add --no-load-optim "
            f"to load its weights only")
    return with_optimizer, with_rng


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
