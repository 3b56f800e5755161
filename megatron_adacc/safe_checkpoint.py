"""Loading a checkpoint never runs code: every pickle in it is read restrictedly.

A torch_dist checkpoint (megatron-core's dist_checkpointing over torch.distributed.checkpoint, DCP)
holds pickles that torch 2.13 and megatron-core 0.19.2 would unpickle as they stand:

- ``.metadata``: DCP's ``FileSystemReader.read_metadata`` calls ``pickle.load``. Here
  :func:`load_metadata` resolves only :data:`METADATA_GLOBALS` and torch's dtypes.
- the non-tensor objects in ``*.distcp`` (megatron's ShardedObjects: the random generators, the
  optimizer's non-tensor state): DCP calls ``torch.load(weights_only=False)``. Here
  ``weights_only=True``.
- the common state: one more such object in megatron-core 0.19. An older ``common.pt`` is still
  read when present, with ``torch.load``'s default ``weights_only``, which
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` turns off. Here always True.
- the tensors in ``*.distcp``: DCP reads them with ``weights_only=True`` already. Here a refusal
  names its file too, as the others do.
- Megatron-LM's older ``--ckpt-format torch``: ``mp_rank_*/model_optim_rng.pt`` and
  ``distrib_optim.pt``, read with ``torch.load``'s default (as ``common.pt``). Here always
  ``weights_only=True`` (:data:`LEGACY_READERS`).

A file that names any other global raises :class:`CheckpointRefused`, naming the file and the
global.

Use: call :func:`install` once per process, before loading. A refusal arrives as CheckpointRefused
or wrapped in DCP's ``CheckpointException``; :func:`refusal` finds it in either. Nothing here
depends on the project's trainer: a Megatron-LM training loop applies it the same way.
"""
from __future__ import annotations

import functools
import glob
import importlib
import inspect
import json
import os
import pickle
import re
import types
from typing import Any, BinaryIO

import torch

from megatron_adacc.common.errors import InputError, first_line

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"  # megatron-core's common state before 0.19 (read if present)
MEGATRON_METADATA_FILE = "metadata.json"  # marks a megatron-core distributed checkpoint

_DCP = "torch.distributed.checkpoint"
# The globals a .metadata pickle names, listed from checkpoints this project saves (GPT and
# Llama; fp32, fp16 and bf16; with and without the distributed optimizer; tensor, pipeline and
# data parallel; --async-save), plus the classes their fields may hold that those runs left
# empty (BytesIOWriteData, _StoragePrefix) and megatron-core's two empty classes kept for older
# checkpoints' metadata. Every dtype is allowed too (_is_dtype): the model's precision picks them.
METADATA_GLOBALS = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout
    (f"{_DCP}.metadata", "Metadata"),
    (f"{_DCP}.metadata", "MetadataIndex"),
    (f"{_DCP}.metadata", "StorageMeta"),
    (f"{_DCP}.metadata", "TensorStorageMetadata"),
    (f"{_DCP}.metadata", "BytesStorageMetadata"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"),
    (f"{_DCP}.metadata", "TensorProperties"),
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),
    (f"{_DCP}.planner", "SavePlan"),  # megatron keeps every rank's plan in the metadata
    (f"{_DCP}.planner", "WriteItem"),
    (f"{_DCP}.planner", "WriteItemType"),
    (f"{_DCP}.planner", "TensorWriteData"),
    (f"{_DCP}.planner", "BytesIOWriteData"),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    (f"{_DCP}.filesystem", "_StoragePrefix"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"),
    # DCP's own FileSystemWriter (torch.distributed.checkpoint.save, as bench_accuracy's
    # gain-scaled checkpoints are written) keeps the folder as StorageMeta.checkpoint_id: a
    # path, which builds from its string parts and runs nothing else.
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
})
_METADATA_ALLOWS = "one of the classes DCP's metadata holds"
_OBJECT_ALLOWS = "allowed by torch.load(weights_only=True)"


class CheckpointRefused(InputError):
    """A checkpoint file that names a global outside its allow-list: loading it would run code.

    Attributes:
        file: the file's path.
        global_name: ``module.name``.
        allowed: what the allow-list is, in words.
    """

    def __init__(self, file: str, global_name: str, allowed: str):
        # The fields are the exception's args, so it pickles: DCP gathers ranks' errors.
        super().__init__(file, global_name, allowed)
        self.file, self.global_name, self.allowed = file, global_name, allowed

    def __str__(self) -> str:
        return (f"{self.file} names {self.global_name}, which is not {self.allowed}: the "
                f"checkpoint is refused, since loading it would run code")


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only DCP metadata's globals."""

    def __init__(self, file: BinaryIO, name: str):
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or _is_dtype(module, name):
            return super().find_class(module, name)
        raise CheckpointRefused(self.name, f"{module}.{name}", _METADATA_ALLOWS)


def load_metadata(file: BinaryIO, *args, **kwargs) -> Any:
    """Unpickle a DCP ``.metadata`` stream, with ``pickle.load``'s signature and result.

    Raises CheckpointRefused (naming ``file.name``) at a global outside METADATA_GLOBALS.
    """
    return _MetadataUnpickler(file, str(getattr(file, "name", METADATA_FILE))).load()


def read_metadata(directory: str | os.PathLike) -> Any:
    """The DCP metadata of a checkpoint directory, read with :func:`load_metadata`."""
    with open(os.path.join(directory, METADATA_FILE), "rb") as file:
        return load_metadata(file)


def load_weights_only(file: Any, name: str, map_location: Any = None) -> Any:
    """``torch.load(file, weights_only=True)``; a refused global raises CheckpointRefused.

    The refusal names ``name``."""
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:  # a global torch refuses, or a damaged pickle
        unsafe = _unsafe_global(file)
        if unsafe is None:  # nothing names code: damage, for the caller's fallback
            raise
        raise CheckpointRefused(name, unsafe, _OBJECT_ALLOWS) from None


def _unsafe_global(file: Any) -> str | None:
    """The first global of a torch.save file that weights_only refuses; None if none is."""
    try:
        if hasattr(file, "seek"):
            file.seek(0)
        names = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except Exception:  # not a zip-format torch.save file
        return None
    return names[0] if names else None


def refusal(exc: BaseException) -> CheckpointRefused | None:
    """The CheckpointRefused behind ``exc`` (see behind)."""
    return next(behind(exc, CheckpointRefused), None)


def behind(exc: BaseException, kind):
    """Each ``kind`` error behind ``exc``: itself, a cause, or a rank's error in a DCP exception.

    A DCP ``CheckpointException`` holds ``failures``: rank -> (exception, traceback)."""
    pending, seen = [exc], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, kind):
            yield current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            pending += [failure[0] for failure in failures.values()]
        pending += [current.__cause__, current.__context__]


class _MetadataPickle(types.ModuleType):
    """``pickle`` as DCP's filesystem module sees it: ``load`` is :func:`load_metadata`."""

    load = staticmethod(load_metadata)

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)


class _WeightsOnlyTorch(types.ModuleType):
    """``torch`` as a checkpoint reader sees it: ``load`` is :func:`load_weights_only`.

    Every other name is ``base``'s: torch, or what a CPU shim already put in its place."""

    def __init__(self, base: Any = torch):
        super().__init__("torch")
        self._base = base

    @staticmethod
    def load(file, map_location=None, **_) -> Any:
        return load_weights_only(file, _name_of(file), map_location)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def _name_of(file: Any) -> str:
    """A path, or the path of the file a DCP stream (a view into a ``.distcp``) reads."""
    if isinstance(file, (str, os.PathLike)):
        return str(file)
    return str(getattr(getattr(file, "base_stream", file), "name", "*.distcp"))


def _load_bytes(self, read_item, value) -> None:
    """DCP's ``DefaultLoadPlanner.load_bytes``, with ``weights_only=True``.

    It loads one object of a ``.distcp`` file, named relative to the checkpoint;
    ``_naming_directory`` completes the name."""
    try:
        file = self.metadata.storage_data[read_item.storage_index].relative_path
    except (AttributeError, KeyError, TypeError):
        file = read_item.dest_index.fqn
    value = load_weights_only(value, file)
    if self.flatten_state_dict:
        from torch.distributed.checkpoint._traverse import set_element

        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)
    else:
        self.state_dict[read_item.dest_index.fqn] = value


def _naming_directory(read_data):
    """``FileSystemReader.read_data`` that adds the directory to a refusal naming a bare file."""

    @functools.wraps(read_data)
    def wrapper(self, plan, planner):
        try:
            return read_data(self, plan, planner)
        except CheckpointRefused as exc:
            if os.path.dirname(exc.file):
                raise
            raise CheckpointRefused(os.path.join(str(self.path), exc.file), exc.global_name,
                                    exc.allowed) from None

    return wrapper


def _metadata_read_first(load):
    """A megatron loader that reads its checkpoint's ``.metadata`` with read_metadata first."""
    signature = inspect.signature(load)

    @functools.wraps(load)
    def wrapper(*args, **kwargs):
        directory = signature.bind(*args, **kwargs).arguments["checkpoint_dir"]
        # DCP catches what read_metadata raises inside its load and fails later on "metadata
        # is None"; read first, a refusal comes out as it is.
        if os.path.isfile(os.path.join(directory, METADATA_FILE)):  # torch_dist's
            read_metadata(directory)
        return load(*args, **kwargs)

    return wrapper


def _load_common(checkpoint_dir) -> Any:
    """megatron-core's ``load_common``: a checkpoint's ``common.pt``, weights only."""
    path = os.path.join(str(checkpoint_dir), COMMON_FILE)
    return load_weights_only(path, path, map_location="cpu")


# Modules that read --ckpt-format torch's files with a bare torch.load, whose weights_only
# default TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns off: the model, RNG and scheduler state
# (mp_rank_*/model_optim_rng.pt) and the distributed optimizer's (distrib_optim.pt).
LEGACY_READERS = ("megatron.training.checkpointing", "megatron.core.optimizer.optimizer",
                  "megatron.core.optimizer.distrib_optimizer",
                  "megatron.core.optimizer.layer_wise_optimizer")
_installed = False


def install() -> None:
    """Make every checkpoint read of this process restricted, as the module docstring lists.

    Calling it again does nothing."""
    global _installed
    if _installed:
        return
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import common as megatron_common
    from torch.distributed.checkpoint import default_planner, filesystem

    filesystem.pickle = _MetadataPickle("pickle")  # its one pickle.load is read_metadata's
    filesystem.torch = _WeightsOnlyTorch()  # its tensors' torch.load: weights_only=True
    filesystem.FileSystemReader.read_data = _naming_directory(
        filesystem.FileSystemReader.read_data)
    # megatron's MCoreLoadPlanner inherits it (megatron-core 0.16.1 and 0.19.2).
    default_planner.DefaultLoadPlanner.load_bytes = _load_bytes
    megatron_common.torch = _WeightsOnlyTorch()  # its torch.load calls read common.pt
    # megatron-core 0.19 reads a legacy common.pt through its msc wrapper's torch.load:
    # weights_only by torch's default only, and TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD undoes that.
    megatron_common.load_common = serialization.load_common = _load_common
    for name in ("load", "load_common_state_dict"):
        checked = _metadata_read_first(getattr(serialization, name))
        setattr(serialization, name, checked)  # as megatron's own modules call it
        setattr(dist_checkpointing, name, checked)
    for name in LEGACY_READERS:
        module = importlib.import_module(name)
        module.torch = _WeightsOnlyTorch(module.torch)
    _installed = True


# --- which checkpoint a --load reads ------------------------------------------------------------

TRACKER_FILE = "latest_checkpointed_iteration.txt"  # Megatron-LM's name for the newest one
_ITERATION_DIR = re.compile(r"^iter_(\d{7})$")


def damage(checkpoint: str | os.PathLike) -> str | None:
    """What makes a saved checkpoint unloadable, in words; None if it looks whole.

    It reads the ``.metadata`` and ``common.pt`` restrictedly. A refusal propagates as
    CheckpointRefused: a crafted file is no damage to fall back from. It also checks that every
    ``.distcp`` holds the bytes the metadata places in it. A checkpoint in Megatron-LM's older
    ``torch`` format (no ``.metadata``) is checked by :func:`_legacy_damage`.
    """
    directory = str(checkpoint)
    if not os.path.isdir(directory):
        return f"missing ({directory} is not a directory)"
    if not os.path.exists(os.path.join(directory, METADATA_FILE)):
        return _legacy_damage(directory)
    common = os.path.join(directory, COMMON_FILE)
    try:
        metadata = read_metadata(directory)
        if os.path.exists(common):  # older megatron-core's; newer keep it in a .distcp
            load_weights_only(common, common)
        with open(os.path.join(directory, MEGATRON_METADATA_FILE)) as file:
            json.load(file)
    except CheckpointRefused:
        raise
    except Exception as exc:  # damage of any kind: the caller falls back
        return f"unreadable ({_described(exc)})"
    needed: dict[str, int] = {}
    for info in getattr(metadata, "storage_data", {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"unreadable ({path} is missing)"
        held = os.path.getsize(path)
        if held < size:
            return (f"unreadable ({path} holds {held} bytes, its .metadata places {size}; "
                    f"truncated?)")
    return None


def _legacy_damage(directory: str) -> str | None:
    """damage() of a ``--ckpt-format torch`` checkpoint: its ``mp_rank_*/*.pt`` files.

    Each must open as a torch.save file, and its pickle (read without its tensors' bytes) may
    name only what ``torch.load(weights_only=True)`` allows; a file that names more raises
    CheckpointRefused. Files older than torch's zip format are left to the weights-only load."""
    files = sorted(glob.glob(os.path.join(directory, "mp_rank_*", "*.pt")))
    if not files:
        return f"unreadable ({directory} holds neither a {METADATA_FILE} nor mp_rank_*/*.pt)"
    for path in files:
        try:
            with open(path, "rb") as file:
                if not torch.serialization._is_zipfile(file):
                    continue
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception as exc:  # a truncated zip has no central directory
            return f"unreadable ({path}: {_described(exc)})"
        if unsafe:
            raise CheckpointRefused(path, unsafe[0], _OBJECT_ALLOWS)
    return None


def _described(exc: BaseException) -> str:
    """The exception's type and its message's first sentence: a warning stays one short line."""
    first = first_line(exc).split(". ")[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def saved_iterations(directory: str | os.PathLike) -> tuple[int | None, list[int]]:
    """(the iteration Megatron-LM's tracker file names or None, every ``iter_*`` there)."""
    directory = str(directory)
    tracker = None
    try:
        with open(os.path.join(directory, TRACKER_FILE)) as file:
            tracker = int(file.read().strip())
    except (OSError, ValueError):
        pass
    found = []
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            match = _ITERATION_DIR.match(name)
            if match and os.path.isdir(os.path.join(directory, name)):
                found.append(int(match.group(1)))
    return tracker, sorted(found)


def choose_checkpoint(load: str, warn) -> int | None:
    """The iteration a ``--load load`` should read: the newest whole checkpoint.

    Returns None to leave Megatron-LM's choice: the tracker file's, or a start from scratch.
    Otherwise it returns the older iteration to pass as ``--ckpt-step``, and calls ``warn(line)``
    once to say what was wrong with the newer one.

    Raises:
        CheckpointRefused: at a crafted file.
        InputError: when no checkpoint is whole.
    """
    tracker, found = saved_iterations(load)
    if tracker is None and not found:
        warn(f"--load {load}: no checkpoint there (no {TRACKER_FILE}, no iter_*); training "
             f"starts from scratch")
        return None
    newest = tracker if tracker is not None else found[-1]
    candidates = [newest] + [it for it in reversed(found) if it < newest]
    problems = []
    for iteration in candidates:
        path = os.path.join(load, f"iter_{iteration:07d}")
        problem = damage(path)
        if problem is None:
            if problems:
                warn(f"checkpoint {problems[0][0]} is {problems[0][1]}; resuming from the "
                     f"newest intact one, {path}")
            return None if iteration == tracker else iteration
        problems.append((path, problem))
    raise InputError(f"--load {load}: no intact checkpoint: " + "; ".join(
        f"{path} is {problem}" for path, problem in problems))
