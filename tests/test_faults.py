"""Faults a new user meets (issue 16): each ends in one line on stderr, a non-zero exit (2 for
bad input), no traceback, and nothing lost; a corrupt newest checkpoint resumes from the newest
intact one with the uninterrupted run's losses."""
import importlib.util
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_adacc import safe_checkpoint
from megatron_adacc.training import checkpointing
from megatron_adacc.training.data import write_indexed_dataset
from megatron_adacc.training.tokenizers import ByteLevelTokenizer

from pretrain_helpers import PRETRAIN, ROOT, run

PREPROCESS = str(ROOT / "scripts" / "preprocess_data.py")
TINY = ["--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--log-interval", "1000",
        "--eval-interval", "0", "--num-layers", "2", "--hidden-size", "64", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "1"]


def metrics(path):
    """Records of a metrics file, read as strict JSON (bare NaN/Infinity rejected)."""
    def strict(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return [json.loads(line, parse_constant=strict) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small ByteLevel dataset prefix (a few hundred samples of 32 tokens)."""
    rng = random.Random(0)
    words = "the of and to in that is was he for it with as his on be at by".split()
    docs = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(100)]
    prefix = tmp_path_factory.mktemp("corpus") / "c_text_document"
    write_indexed_dataset(docs, ByteLevelTokenizer(), prefix)
    return str(prefix)


def data_flags(corpus):
    return ["--data-path", corpus, "--split", "98,2,0"]


# --- 1. an empty split ----------------------------------------------------------------------

def test_a_split_without_documents_is_an_error_not_a_hang(tmp_path):
    (tmp_path / "one.jsonl").write_text('{"text": ""}\n')
    code, _, _ = run(PREPROCESS, "--input", "one.jsonl", "--output-prefix", "d/e",
                     "--tokenizer-type", "ByteLevel", cwd=tmp_path)
    assert code == 0
    code, line, _ = run(PRETRAIN, *TINY, "--data-path", "d/e_text_document", "--train-iters", "2",
                        cwd=tmp_path, timeout=120)
    assert (code, line) == (2, "pretrain_gpt.py: error: dataset d/e_text_document: its valid "
                               "split (--split 969,30,1) gets none of its 1 documents; add "
                               "documents (in plain text, separate them with blank lines) or "
                               "change --split")


# --- 2. NaN ---------------------------------------------------------------------------------

def test_a_diverged_run_stops_at_the_first_nan_and_saves_no_nan(tmp_path, corpus):
    code, line, _ = run(PRETRAIN, *TINY, *data_flags(corpus), "--train-iters", "4",
                        "--lr", "1e6", "--save", "ck", "--save-interval", "2",
                        "--metrics-file", "m.jsonl", cwd=tmp_path)
    assert (code, line) == (1, "pretrain_gpt.py: error: iteration 3: loss nan, gradient norm "
                               "nan on this rank: not finite on some rank; stopped before the "
                               "optimizer step, nothing saved (lower --lr, or --load the last "
                               "checkpoint)")
    assert [r["iteration"] for r in metrics(tmp_path / "m.jsonl")] == [1, 2]
    assert checkpointing.latest_iteration(tmp_path / "ck") == 2
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "iter_0000002", checkpointing.TRACKER]


def test_metrics_files_are_strict_json(tmp_path, distributed):
    from megatron_adacc.training.trainer import MetricsLog

    log = MetricsLog(str(tmp_path / "m.jsonl"), None, append=False)
    log.write({"iteration": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    log.close()
    assert metrics(tmp_path / "m.jsonl") == [
        {"iteration": 1, "loss": None, "grad_norm": None, "lr": 1e-3}]


@pytest.fixture(scope="module")
def trainer(corpus):
    """A tiny run in this process, trained one step, to save from."""
    from megatron_adacc.training.arguments import parse_args
    from megatron_adacc.training.trainer import Trainer

    trainer = Trainer(parse_args([*TINY, *data_flags(corpus), "--train-iters", "2",
                                  "--exit-interval", "1"]))
    trainer.train()
    return trainer


def _save(trainer, directory, iteration):
    from megatron_adacc.training.arguments import parse_args

    saver = checkpointing.Saver(parse_args([*TINY, "--save", str(directory)]))
    return saver.save(iteration, [trainer.train_model], trainer.optimizer, trainer.scheduler)


def test_a_checkpoint_with_nan_is_never_written(tmp_path, trainer):
    from megatron_adacc.training.numerics import NonFiniteError

    weight = trainer.model.decoder.final_layernorm.weight
    kept = weight.detach().clone()
    with torch.no_grad():
        weight[1] = float("nan")
    try:
        with pytest.raises(NonFiniteError, match=r"^checkpoint of iteration 5 not written "
                           r"to .*ck: model\.decoder\.final_layernorm\.weight holds NaN or "
                           r"Inf$"):
            _save(trainer, tmp_path / "ck", 5)
    finally:
        with torch.no_grad():
            weight.copy_(kept)
    assert not (tmp_path / "ck").exists()


# --- 3. checkpoints -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus):
    """An uninterrupted 6-iteration run saving at 2, 4 and 6: (directory, losses)."""
    work = tmp_path_factory.mktemp("straight")
    code, _, stderr = run(PRETRAIN, *TINY, *data_flags(corpus), "--train-iters", "6",
                          "--save", "ck", "--save-interval", "2", "--metrics-file", "m.jsonl",
                          cwd=work)
    assert code == 0, stderr
    return work, [r["loss"] for r in metrics(work / "m.jsonl")]


def _copy_checkpoints(straight, tmp_path):
    shutil.copytree(straight[0] / "ck", tmp_path / "ck")
    return tmp_path / "ck" / "iter_0000006"


@pytest.mark.parametrize("damage, problem", [
    ("truncate", "unreadable (EOFError)"),
    ("delete", "unreadable (FileNotFoundError: [Errno 2] No such file or directory: "
               "'ck/iter_0000006/common.pt')"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(
        tmp_path, corpus, straight, damage, problem):
    newest = _copy_checkpoints(straight, tmp_path)
    shard = next(newest.glob("*.distcp"))
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        (newest / "common.pt").unlink()
    code, _, stderr = run(PRETRAIN, *TINY, *data_flags(corpus), "--train-iters", "6",
                          "--load", "ck", "--metrics-file", "m.jsonl", cwd=tmp_path)
    assert code == 0, stderr
    assert (f"warning: checkpoint ck/iter_0000006 is {problem}; resuming from the newest "
            f"intact one, ck/iter_0000004") in stderr.splitlines()
    resumed = metrics(tmp_path / "m.jsonl")
    assert [r["iteration"] for r in resumed] == [5, 6]
    assert [r["loss"] for r in resumed] == straight[1][4:]  # bit for bit


@pytest.mark.parametrize("flags, expected", [
    (["--train-iters", "3"],
     (2, "pretrain_gpt.py: error: --load ck is at iteration 6, past --train-iters 3: nothing "
         "to train (raise --train-iters)")),
    (["--train-iters", "6"],
     (0, "pretrain_gpt.py: --load ck is at iteration 6, already at --train-iters 6: nothing "
         "to train")),
    (["--train-iters", "8"],
     (2, "pretrain_gpt.py: error: --load ck: --train-iters is 8 here but 6 in the checkpoint; "
         "add --override-opt_param-scheduler to train on the flags' schedule or "
         "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")),
    (["--train-iters", "8", "--lr", "0.002"],
     (2, "pretrain_gpt.py: error: --load ck: --lr is 0.002 here but 0.001 in the checkpoint; "
         "add --override-opt_param-scheduler to train on the flags' schedule or "
         "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")),
])
def test_loading_into_the_wrong_run_says_why(tmp_path, corpus, straight, flags, expected):
    _copy_checkpoints(straight, tmp_path)
    code, line, _ = run(PRETRAIN, *TINY, *data_flags(corpus), *flags, "--load", "ck",
                        cwd=tmp_path)
    assert (code, line) == expected


@pytest.mark.parametrize("which, lr_at_7", [
    ("--override-opt_param-scheduler", "flags"), ("--use-checkpoint-opt_param-scheduler", "min")])
def test_a_changed_schedule_trains_on_the_schedule_the_user_names(tmp_path, corpus, straight,
                                                                  which, lr_at_7):
    _copy_checkpoints(straight, tmp_path)
    code, _, stderr = run(PRETRAIN, *TINY, *data_flags(corpus), "--train-iters", "8",
                          "--load", "ck", which, "--metrics-file", "m.jsonl", cwd=tmp_path)
    assert code == 0, stderr
    lrs = [r["lr"] for r in metrics(tmp_path / "m.jsonl")]
    assert len(lrs) == 2
    if lr_at_7 == "min":  # the checkpoint's schedule decayed to --min-lr at iteration 6
        assert lrs == [1e-4, 1e-4]
    else:  # the flags' 8-iteration cosine is still above its minimum at iteration 7
        assert 1e-4 < lrs[1] < lrs[0]


def test_load_of_a_directory_without_checkpoints_warns_and_starts_from_scratch(tmp_path, corpus):
    (tmp_path / "empty").mkdir()
    code, _, stderr = run(PRETRAIN, *TINY, *data_flags(corpus), "--train-iters", "2",
                          "--load", "empty", cwd=tmp_path)
    assert code == 0
    assert ("warning: --load empty: no checkpoint there (no latest_checkpointed_iteration.txt, "
            "no iter_*); training starts from scratch") in stderr.splitlines()


def test_checkpoint_files_are_fsynced_before_the_publishing_rename(tmp_path, trainer,
                                                                   monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    final = _save(trainer, tmp_path / "ck", 1)
    staging = str(tmp_path / "ck" / ".staging_iter_0000001")
    publish = events.index(("replace", staging))
    for name in sorted(p.name for p in final.iterdir()):
        assert ("fsync", f"{staging}/{name}") in events[:publish], name
    assert ("fsync", staging) in events[:publish]
    tracker = str(tmp_path / "ck" / checkpointing.TRACKER) + ".tmp"
    assert events.index(("replace", tracker)) > publish


def test_a_save_killed_midway_leaves_no_staging_directory_after_the_next_save(tmp_path,
                                                                            trainer):
    leftover = tmp_path / "ck" / ".staging_iter_0000003"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"half a checkpoint")
    _save(trainer, tmp_path / "ck", 4)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "iter_0000004", checkpointing.TRACKER]


def test_every_saved_object_loads_with_weights_only(tmp_path, trainer):
    from megatron.core import dist_checkpointing

    safe_checkpoint.install()  # ShardedObjects through torch.load(weights_only=True)
    final = _save(trainer, tmp_path / "ck", 2)
    # Plain tensors and values: readable without the globals other libraries may allowlist
    # (numpy arrays, say) in this process.
    allowlisted = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        common = torch.load(final / "common.pt", weights_only=True)
        state = checkpointing._state_dict(
            [trainer.train_model], trainer.optimizer, trainer.scheduler, iteration=2,
            with_optimizer=True, with_rng=True, loading=True)
        loaded = dist_checkpointing.load(state, str(final))  # ShardedObjects: weights_only
    finally:
        torch.serialization.add_safe_globals(allowlisted)
    assert common["iteration"] == 2
    assert loaded["rng_state"]["torch_rng_state"].dtype == torch.uint8


# --- 4. flags and config keys ---------------------------------------------------------------

def _main(argv):
    spec = importlib.util.spec_from_file_location("pretrain_gpt", PRETRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


@pytest.mark.parametrize("flags, config, message", [
    (["--eval-iters", "-1"], None, "argument --eval-iters: must be an integer >= 0, got -1"),
    (["--global-batch-size", "-8"], None,
     "argument --global-batch-size: must be a positive integer, got -8"),
    ([], {"micro-batch-size": 2.7}, "micro-batch-size: must be an integer, got 2.7"),
    ([], {"num-layers": True}, "num-layers: must be an integer, got True"),
    (["--lr", "-1"], None, "argument --lr: must be a number >= 0, got -1"),
    (["--lr", "nan"], None, "argument --lr: must be a finite number, got nan"),
    (["--adacc-memory-budget", "1GiB"], None,
     "--adacc-memory-budget 1GiB has no effect with --adacc-policy none; drop it, or plan for "
     "it with --adacc-policy auto"),
    (["--adacc-policy", "missing.yaml"], None,
     "--adacc-policy missing.yaml: plan file not found (or give one of none, auto, "
     "auto-no-outlier, full-recompute, quantize)"),
])
def test_bad_flags_and_keys_are_refused_when_parsed(tmp_path, capsys, corpus, flags, config,
                                                    message):
    prefix = ""
    if config is not None:
        path = tmp_path / "bad.yaml"
        path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in config.items()))
        flags = ["--config", str(path), *flags]
        prefix = f"--config {path}: "
    else:
        flags = [*TINY, *flags]
    assert _main([*flags, *data_flags(corpus), "--train-iters", "2"]) == 2
    assert capsys.readouterr().err == f"pretrain_gpt.py: error: {prefix}{message}\n"


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path):
    from megatron_adacc.training.arguments import parse_args

    path = tmp_path / "c.yaml"
    path.write_text("train-iters: 1e3\nlr: 3e-4\n")
    args = parse_args(["--config", str(path)])
    assert (args.train_iters, args.lr) == (1000, 3e-4)


# --- 5. preprocessing -----------------------------------------------------------------------

@pytest.mark.parametrize("lines, keys, message", [
    (['{"text": "ok"}'] * 5 + ['{"text": "a" "b"}'], ["text"],
     "in.jsonl:6: not valid JSON (Expecting ',' delimiter at column 14)"),
    ([b'{"text": "ok"}', b'{"text": "ok"}', b'{"text": "caf\xe9"}'], ["text"],
     "in.jsonl:3: not UTF-8 (byte 0xe9 at column 14); convert the file to UTF-8, e.g. with "
     "iconv"),
    (['{"text": "ok"}', '{"text": 42}'], ["text"],
     "in.jsonl:2: 'text' is a number, expected a string"),
    (['{"text": "ok"}', '["text", "ok"]'], ["text"],
     "in.jsonl:2: expected a JSON object, got an array"),
    (['{"text": "ok", "title": "a"}', '{"text": "ok"}'], ["text", "title"],
     "in.jsonl:2: no key 'title' in the JSON object"),  # after text's dataset could be written
])
def test_preprocessing_reports_file_and_line_and_writes_nothing(tmp_path, lines, keys, message):
    raw = b"\n".join(line if isinstance(line, bytes) else line.encode() for line in lines)
    (tmp_path / "in.jsonl").write_bytes(raw + b"\n")
    code, line, _ = run(PREPROCESS, "--input", "in.jsonl", "--output-prefix", "out/d",
                        "--tokenizer-type", "ByteLevel", "--json-keys", *keys, cwd=tmp_path)
    assert (code, line) == (2, f"preprocess_data.py: error: {message}")
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["in.jsonl"]


def test_a_truncated_dataset_is_refused_before_training(tmp_path, capsys, corpus):
    prefix = tmp_path / "t_text_document"
    for ext in ("bin", "idx"):
        shutil.copy(f"{corpus}.{ext}", f"{prefix}.{ext}")
    size = Path(f"{prefix}.bin").stat().st_size
    os.truncate(f"{prefix}.bin", size // 2)
    assert _main([*TINY, "--data-path", str(prefix), "--train-iters", "2"]) == 2
    assert capsys.readouterr().err == (
        f"pretrain_gpt.py: error: --data-path {prefix}: {prefix}.bin holds {size // 2} bytes, "
        f"its .idx describes {size} (truncated?); make it again with "
        f"scripts/preprocess_data.py\n")


# --- 6. the ProfileDB -----------------------------------------------------------------------

def test_another_applications_database_is_refused_and_left_untouched(tmp_path, capsys, corpus):
    path = tmp_path / "app.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE users (name TEXT)")
        db.execute("INSERT INTO users VALUES ('ada')")
    before = path.read_bytes()
    assert _main([*TINY, *data_flags(corpus), "--train-iters", "2", "--adacc-policy", "auto",
                  "--adacc-memory-budget", "1GiB", "--adacc-profile-db", str(path)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"pretrain_gpt.py: error: profile database {path} is another application's SQLite "
        f"database (1 tables, application_id 0); left untouched: point --adacc-profile-db at "
        f"a new file")
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["app.sqlite"]  # nothing moved aside


# --- two runs at once -----------------------------------------------------------------------

def test_two_runs_started_together_share_the_data_cache_and_the_profile_db(tmp_path, corpus):
    prefix = tmp_path / "fresh_text_document"  # no index cache yet
    for ext in ("bin", "idx"):
        shutil.copy(f"{corpus}.{ext}", f"{prefix}.{ext}")
    flags = [*TINY, "--data-path", prefix, "--split", "98,2,0", "--train-iters", "2",
             "--adacc-policy", "auto", "--adacc-memory-budget", "1GiB",
             "--adacc-profile-db", tmp_path / "p.sqlite"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = [subprocess.Popen([sys.executable, PRETRAIN, *map(str, flags)], cwd=tmp_path,
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    errors = [r.communicate(timeout=600)[1] for r in runs]
    for r, stderr in zip(runs, errors):
        assert r.returncode == 0, stderr[-3000:]
        assert "adacc: profile database" not in stderr, stderr  # no "not caching", no move
    with sqlite3.connect(tmp_path / "p.sqlite") as db:
        assert db.execute("SELECT count(*) FROM profiles").fetchone()[0] == 1
    cache = Path(f"{prefix}/cache/GPTDataset_indices")
    names = sorted(p.name for p in cache.iterdir())
    assert len(names) == 8 and not any(n.startswith(".") for n in names), names


def test_a_killed_index_cache_write_is_not_read_back(tmp_path, corpus, monkeypatch):
    import numpy

    from megatron_adacc.training.data import DataSpec, build_datasets

    prefix = tmp_path / "fresh_text_document"
    for ext in ("bin", "idx"):
        shutil.copy(f"{corpus}.{ext}", f"{prefix}.{ext}")
    spec = DataSpec([str(prefix)], "98,2,0")
    real_save = numpy.save

    def killed_save(path, array, **kwargs):  # the last file of the cache, half written
        if str(path).endswith("shuffle_index.npy"):
            Path(path).write_bytes(b"\x93NUMPY")
            raise KeyboardInterrupt("killed while writing the index cache")
        return real_save(path, array, **kwargs)

    monkeypatch.setattr(numpy, "save", killed_save)
    with pytest.raises(KeyboardInterrupt):
        build_datasets(spec, ByteLevelTokenizer(), 32, 1234, 8, 8)
    monkeypatch.undo()
    train, _ = build_datasets(spec, ByteLevelTokenizer(), 32, 1234, 8, 8)
    assert len(train) >= 8
