"""Loading a checkpoint runs no code from it (issue 43): DCP's ``.metadata``, a ``common.pt``
and the objects inside ``*.distcp`` (megatron-core 0.19 keeps the common state there too) are
read restrictedly; a file naming any other global is refused in one line (exit 2) with nothing
created, whatever older checkpoints there are; and a checkpoint of every supported
configuration still loads and resumes bit for bit."""
import dataclasses
import importlib
import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from megatron_adacc import safe_checkpoint
from megatron_adacc.safe_checkpoint import CheckpointRefused

from helpers import forked
from helpers.pretrain import LLAMA_FLAGS, PRETRAIN, TINY, child_env, losses, run, train

# common.pt: a legacy common-state file planted beside the checkpoint (megatron-core still
# reads one where present); distcp_object: the rng_state and common_state ShardedObjects in a
# .distcp; tensor: the word embeddings' slot in a .distcp
FILES = [".metadata", "common.pt", "distcp_object", "tensor"]
TENSOR = "embedding.word_embeddings.weight"
# What each kind of file may name, as a refusal says it.
METADATA = "one of the classes DCP's metadata holds"
OBJECT = "allowed by torch.load(weights_only=True)"


class Payload:
    """Pickles as a call that creates ``target``: a shell command, or Python's own open()."""

    def __init__(self, target: Path, call: str = "system"):
        self.target, self.call = target, call

    def __deepcopy__(self, memo):  # megatron copies the state it saves: no call there
        return self

    def __reduce__(self):
        if self.call == "system":
            return os.system, (f"touch {self.target}",)
        return open, (str(self.target), "w")


def _global_of(call: str) -> str:
    function = os.system if call == "system" else open
    return f"{function.__module__}.{function.__name__}"


def _refusal(file, call="system", allowed=METADATA) -> str:
    return (f"{file} names {_global_of(call)}, which is not {allowed}: the checkpoint is "
            f"refused, since loading it would run code")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A TINY run's checkpoints at iterations 1 and 2."""
    ck = tmp_path_factory.mktemp("saved") / "ck"
    train("--train-iters", "2", "--save", str(ck), "--save-interval", "1")
    return ck


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    """Checkpoints like ``saved`` whose random-generator ShardedObject and common state each
    hold a Payload (pwned-at-save-rng, pwned-at-save-common)."""
    from megatron.core import dist_checkpointing

    work = tmp_path_factory.mktemp("crafted")
    save = dist_checkpointing.save

    def crafted_save(state_dict, *args, **kwargs):
        state_dict["rng_state"].data = [{"evil": Payload(work / "pwned-at-save-rng")}]
        state_dict["evil"] = Payload(work / "pwned-at-save-common")  # into the common state
        return save(state_dict, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dist_checkpointing, "save", crafted_save)
        train("--train-iters", "2", "--save", str(work / "ck"), "--save-interval", "1")
    assert not list(work.glob("pwned*"))  # pickling a payload runs nothing
    return work / "ck"


def _object_file(checkpoint: Path, key: str) -> str:
    """The .distcp file holding ShardedObject ``key``, as DCP's metadata says."""
    metadata = safe_checkpoint.read_metadata(checkpoint)
    (info,) = [info for index, info in metadata.storage_data.items()
               if index.fqn.startswith(key)]
    return info.relative_path


def _plant(which: str, ck: Path, crafted_ck: Path, target: Path, call: str = "system") -> Path:
    """A copy of ``ck`` whose newest checkpoint (iteration 2) holds a Payload in ``which``;
    returns the file to name."""
    shutil.copytree(crafted_ck if which == "distcp_object" else ck, target.parent / "ck")
    newest = target.parent / "ck" / "iter_0000002"
    if which == ".metadata":  # the real metadata with one more attribute
        with open(newest / ".metadata", "rb") as file:
            metadata = pickle.load(file)  # trusted: this test wrote it
        metadata.evil = Payload(target, call)
        with open(newest / ".metadata", "wb") as file:
            pickle.dump(metadata, file)
        return newest / ".metadata"
    if which == "common.pt":
        torch.save({"iteration": 2, "evil": Payload(target, call)}, newest / "common.pt")
        return newest / "common.pt"
    if which == "tensor":  # appended to its .distcp, the metadata pointing at it
        with open(newest / ".metadata", "rb") as file:
            metadata = pickle.load(file)  # trusted: this test wrote it
        (index,) = [index for index in metadata.storage_data if index.fqn == TENSOR]
        info = metadata.storage_data[index]
        payload = io.BytesIO()
        torch.save(Payload(target, call), payload)
        shard = newest / info.relative_path
        metadata.storage_data[index] = dataclasses.replace(
            info, offset=shard.stat().st_size, length=len(payload.getvalue()))
        with open(shard, "ab") as file:
            file.write(payload.getvalue())
        with open(newest / ".metadata", "wb") as file:
            pickle.dump(metadata, file)
        return shard
    return newest / _object_file(newest, "rng_state")


# --- the module's functions -------------------------------------------------------------------

@pytest.mark.parametrize("call", ["system", "open"])
def test_a_crafted_metadata_is_refused_by_the_reader_dcp_and_megatron(tmp_path, saved, call):
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    target = tmp_path / "pwned"
    metadata = _plant(".metadata", saved, saved, target, call)
    directory = str(metadata.parent)
    with pytest.raises(CheckpointRefused) as refused:
        safe_checkpoint.read_metadata(directory)
    assert str(refused.value) == _refusal(metadata, call)
    safe_checkpoint.install()
    readers = [FileSystemReader(directory).read_metadata,  # DCP's own reader
               lambda: dist_checkpointing.load_common_state_dict(directory),
               lambda: dist_checkpointing.load({}, directory)]  # DCP would swallow it here
    for read in readers:
        with pytest.raises(CheckpointRefused) as refused:
            read()
        assert str(refused.value) == _refusal(metadata, call)
    assert not target.exists()


def test_a_crafted_common_pt_is_refused_by_megatrons_loader(tmp_path, saved):
    from megatron.core import dist_checkpointing

    target = tmp_path / "pwned"
    common = _plant("common.pt", saved, saved, target)
    safe_checkpoint.install()
    with pytest.raises(CheckpointRefused) as refused:
        dist_checkpointing.load_common_state_dict(str(common.parent))
    assert str(refused.value) == _refusal(common, allowed=OBJECT)
    assert not target.exists()


@pytest.mark.parametrize("which", ["common_state", "rng_state", "tensor"])
def test_a_crafted_distcp_entry_is_refused_by_megatrons_loader(tmp_path, saved, crafted,
                                                               which, distributed):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    target = tmp_path / "pwned"
    shard = _plant("tensor" if which == "tensor" else "distcp_object", saved, crafted,
                   target)
    safe_checkpoint.install()
    if which == "tensor":
        size = safe_checkpoint.read_metadata(shard.parent).state_dict_metadata[TENSOR].size
        wanted = {"w": ShardedTensor.from_rank_offsets(TENSOR, torch.empty(size))}
        load = lambda: dist_checkpointing.load(wanted, str(shard.parent))  # noqa: E731
    elif which == "rng_state":  # megatron reads it after the common state: alone, with DCP
        import torch.distributed.checkpoint as dcp

        (key,) = [index.fqn for index in
                  safe_checkpoint.read_metadata(shard.parent).storage_data
                  if index.fqn.startswith("rng_state")]
        load = lambda: dcp.load({key: io.BytesIO()}, no_dist=True,  # noqa: E731
                                storage_reader=dcp.FileSystemReader(str(shard.parent)))
    else:
        load = lambda: dist_checkpointing.load_common_state_dict(str(shard.parent))  # noqa
    with pytest.raises(BaseException) as failed:  # DCP wraps it in a CheckpointException
        load()
    assert str(safe_checkpoint.refusal(failed.value)) == _refusal(shard, allowed=OBJECT)
    assert not target.exists() and not list(crafted.parent.glob("pwned*"))


# --- pretrain_gpt.py --load -------------------------------------------------------------------

@pytest.mark.parametrize("which", FILES)
def test_load_refuses_a_crafted_file_in_one_line(tmp_path, saved, crafted, which):
    target = tmp_path / "pwned"
    file = _plant(which, saved, crafted, target)
    code, line, stderr = run(PRETRAIN, *TINY, "--train-iters", "2", "--load", "ck",
                             cwd=tmp_path)
    allowed = METADATA if which == ".metadata" else OBJECT
    assert (code, line) == (2, f"pretrain_gpt.py: error: --load ck: "
                               f"{_refusal(file.relative_to(tmp_path), allowed=allowed)}")
    assert "resuming from" not in stderr  # no fallback to iteration 1
    assert not target.exists() and not list(crafted.parent.glob("pwned*"))


# --- Megatron-LM's older format (--ckpt-format torch) ------------------------------------------

@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    """A TINY run's checkpoints at iterations 1 and 2 in the older format."""
    ck = tmp_path_factory.mktemp("legacy") / "ck"
    train("--train-iters", "2", "--save", str(ck), "--save-interval", "1", "--ckpt-format",
          "torch")
    return ck


@pytest.mark.parametrize("read_by", ["choice", "megatron"])
def test_a_crafted_legacy_checkpoint_is_refused_with_weights_only_forced_off(
        tmp_path, monkeypatch, legacy, read_by):
    """torch.load's weights_only default is all that guards this format in Megatron-LM, and
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns it off. The choice of checkpoint refuses the file;
    with --ckpt-step, which skips that choice, Megatron-LM's own read refuses it."""
    shutil.copytree(legacy, tmp_path / "ck")
    file = tmp_path / "ck" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(file, weights_only=True)
    state["evil"] = Payload(tmp_path / "pwned")
    torch.save(state, file)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    step = ["--ckpt-step", "2"] if read_by == "megatron" else []
    done = forked.run([PRETRAIN, *TINY, "--train-iters", "2", "--ckpt-format", "torch",
                       "--load", "ck", *step], cwd=tmp_path, env=child_env())
    line = done.stderr.strip().splitlines()[-1]
    refused = _refusal(file.relative_to(tmp_path), allowed=OBJECT)
    if read_by == "choice":
        assert (done.returncode, line) == (2, f"pretrain_gpt.py: error: --load ck: {refused}")
    else:
        assert refused in done.stdout  # Megatron-LM prints why; the run ends in one line
        assert (done.returncode, line) == (2, "pretrain_gpt.py: error: --load ck: Megatron-LM "
                                              "could not load the checkpoint (its reason is "
                                              "printed above)")
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "pwned").exists()


# --- what the allow-list lets through ---------------------------------------------------------

@pytest.mark.parametrize("flags", [
    [],
    ["--use-distributed-optimizer", "--bf16"],
    # A scale that steps at once: megatron's fp16 optimizer saves no Adam state before the
    # first step, and the load then misses it (tests/training/test_fp16.py resumes the same way).
    [*LLAMA_FLAGS, "--fp16", "--initial-loss-scale", "1024"],
    [*LLAMA_FLAGS, "--use-distributed-optimizer"],
    ["--ckpt-format", "torch", "--use-distributed-optimizer"],
], ids=["gpt", "gpt-distributed-bf16", "llama-fp16", "llama-distributed", "legacy-distributed"])
def test_every_configurations_checkpoint_loads_and_resumes_bit_for_bit(tmp_path, flags):
    from torch.distributed.checkpoint import default_planner, filesystem

    common = ["--train-iters", "3", *flags]
    straight = losses(train(*common))
    ck = str(tmp_path / "ck")
    first = losses(train(*common, "--save", ck, "--save-interval", "2", "--exit-interval", "2"))
    rest = losses(train(*common, "--load", ck))
    assert first + rest == straight
    # ... through the restricted readers, which the load installed
    assert filesystem.pickle.load is safe_checkpoint.load_metadata
    assert default_planner.DefaultLoadPlanner.load_bytes is safe_checkpoint._load_bytes


def test_every_allowed_global_exists():
    for module, name in safe_checkpoint.METADATA_GLOBALS:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


def test_older_megatron_metadata_classes_load(tmp_path):
    from megatron.core.dist_checkpointing.strategies.torch import MCoreMetadata, MCoreSavePlan
    from torch.distributed.checkpoint.metadata import Metadata

    metadata = Metadata(state_dict_metadata={})
    metadata.mcore_data, metadata.plan = MCoreMetadata(), MCoreSavePlan()
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    loaded = safe_checkpoint.read_metadata(tmp_path)
    assert (type(loaded.mcore_data), type(loaded.plan)) == (MCoreMetadata, MCoreSavePlan)


def test_a_checkpoint_saved_by_dcp_itself_loads(tmp_path):
    # DCP's FileSystemWriter keeps the folder, a pathlib path, in the metadata
    import torch.distributed.checkpoint as dcp

    state = {"weight": torch.arange(6.0).view(2, 3)}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    metadata = safe_checkpoint.read_metadata(tmp_path)
    assert set(metadata.state_dict_metadata) == {"weight"}
    loaded = {"weight": torch.zeros(2, 3)}
    dcp.load(loaded, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(loaded["weight"], state["weight"])


PROBE = """
import io, os, pickle, sys
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

class Payload:
    def __init__(self, target):
        self.target = target
    def __reduce__(self):
        return open, (self.target, "w")

directory = sys.argv[1]
with open(os.path.join(directory, ".metadata"), "wb") as file:
    pickle.dump(Payload(os.path.join(directory, "by_metadata")), file)
try:
    FileSystemReader(directory).read_metadata()
except AttributeError:  # what it unpickled is no Metadata: too late
    pass
planner = DefaultLoadPlanner()
planner.flatten_state_dict, planner.state_dict = False, {}
buffer = io.BytesIO()
torch.save(Payload(os.path.join(directory, "by_object")), buffer)
buffer.seek(0)
planner.load_bytes(type("Item", (), {"dest_index": type("Index", (), {"fqn": "x"})})(), buffer)
"""


def test_unpatched_dcp_still_runs_a_checkpoints_code(tmp_path):
    """Why install() patches torch: when this fails, torch reads checkpoints safely itself."""
    done = forked.run(["-c", PROBE, tmp_path], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".metadata", "by_metadata",
                                                          "by_object"]
