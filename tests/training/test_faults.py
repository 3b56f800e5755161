"""Faults a new user meets (issue 16), through Megatron-LM's loop: each ends in one line on
stderr, a non-zero exit (2 for bad input), no traceback, and nothing lost; a corrupt newest
checkpoint resumes from the newest intact one with the uninterrupted run's losses."""
import importlib.util
import json
import os
import re
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

from megatron_adacc import launch, safe_checkpoint

from helpers import forked
from helpers.pretrain import (CORPUS_TINY as TINY, PRETRAIN, ROOT, child_env, data_flags, losses,
                              run)

PREPROCESS = str(ROOT / "scripts" / "preprocess_data.py")


def metrics(path):
    """Records of a metrics file, read as strict JSON (bare NaN/Infinity rejected)."""
    def strict(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return [json.loads(line, parse_constant=strict) for line in Path(path).read_text().splitlines()]


# --- 1. an empty split ----------------------------------------------------------------------

def test_a_split_without_documents_is_an_error_not_a_hang(tmp_path):
    (tmp_path / "one.jsonl").write_text('{"text": ""}\n')
    code, _, _ = run(PREPROCESS, "--input", "one.jsonl", "--output-prefix", "d/e",
                     "--tokenizer-type", "ByteLevel", cwd=tmp_path)
    assert code == 0
    code, line, _ = run(PRETRAIN, *TINY, "--data-path", "d/e_text_document", "--train-iters", "2",
                        cwd=tmp_path, timeout=120)
    # Megatron-LM's GPTDataset would add epochs of a split shorter than one sample forever.
    assert (code, line) == (2, "pretrain_gpt.py: error: dataset d/e_text_document: its train "
                               "split (--split 969, 30, 1) gets 1 of its 1 documents, 1 tokens, "
                               "less than one sample of --seq-length 32; add documents or "
                               "change --split")


# --- 2. NaN ---------------------------------------------------------------------------------

def test_a_diverged_run_stops_at_the_first_nan_and_saves_no_nan(tmp_path, corpus):
    # Megatron-LM's rerun state machine checks the loss and the gradients from the second
    # iteration on, re-runs the step that failed, and keeps the weights from before it.
    code, line, _ = run(PRETRAIN, *TINY, *data_flags(corpus), "--train-iters", "5",
                        "--lr", "1e6", "--save", "ck", "--save-interval", "100",
                        "--metrics-file", "m.jsonl", cwd=tmp_path)
    done = [r["iteration"] for r in metrics(tmp_path / "m.jsonl")]
    nan_at = len(done) + 1
    assert done == list(range(1, nan_at)) and nan_at > 1
    assert code == 1
    assert re.fullmatch(
        rf"pretrain_gpt\.py: error: iteration {nan_at}: found NaN in .* \(nan\); stopped "
        rf"before the optimizer step, the weights before it saved as iteration {nan_at - 1} "
        rf"in ck \(lower --lr, or --load the last checkpoint\)", line), line
    assert safe_checkpoint.saved_iterations(tmp_path / "ck") == (nan_at - 1, [nan_at - 1])


def test_a_diverged_run_without_save_saves_nothing(tmp_path, corpus, capsys):
    assert _main([*TINY, *data_flags(corpus), "--train-iters", "5", "--lr", "1e6"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"pretrain_gpt\.py: error: iteration \d+: found NaN in .*; stopped "
                        r"before the optimizer step, nothing saved \(lower --lr, or --load "
                        r"the last checkpoint\)", last), last


def test_each_loss_goes_through_megatron_lms_result_checks(tmp_path, corpus):
    # --rerun-mode report_stats runs every step twice and reports, per validate_result call, how
    # the two results differ: so the loss function's calls show, as in Megatron-LM's script.
    # Under auto the profile's passes run the same forward step outside the loop's step.
    from helpers import forked

    done = forked.run([PRETRAIN, *TINY, *data_flags(corpus), "--train-iters", "2",
                       "--rerun-mode", "report_stats", "--adacc-policy", "auto",
                       "--adacc-memory-budget", "1GiB", "--adacc-profile-repeats", "1"],
                      cwd=tmp_path, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    for output in (done.stdout, done.stderr):
        assert "Traceback" not in output, output[-3000:]
    for check in ("NaN", "Inf"):
        assert f"From validation call 'found {check} in local forward loss calculation'" in (
            done.stdout)


def test_metrics_files_are_strict_json():
    from megatron_adacc.megatron_lm import _json_safe

    record = {"iteration": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3}
    line = json.dumps(_json_safe(record), allow_nan=False)
    assert json.loads(line) == {"iteration": 1, "loss": None, "grad_norm": None, "lr": 1e-3}


# --- 3. checkpoints -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus):
    """An uninterrupted 6-iteration run saving at 2, 4 and 6: (directory, losses)."""
    work = tmp_path_factory.mktemp("straight")
    code = _main([*TINY, *data_flags(corpus), "--train-iters", "6", "--save",
                  str(work / "ck"), "--save-interval", "2"])
    assert code == 0
    return work, losses(launch_records())


def _copy_checkpoints(straight, tmp_path):
    shutil.copytree(straight[0] / "ck", tmp_path / "ck")
    return tmp_path / "ck" / "iter_0000006"


def _main_here(tmp_path, monkeypatch, capsys, *flags):
    """(exit status, stderr lines) of pretrain_gpt.main run in ``tmp_path``, in this process."""
    monkeypatch.chdir(tmp_path)
    code = _main([*TINY, *map(str, flags)])
    return code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("damage, problem", [
    ("truncate", "unreadable (ck/iter_0000006/__0_0.distcp holds 100 bytes, its .metadata "
                 "places {size}; truncated?)"),
    ("delete", "unreadable (ck/iter_0000006/__0_0.distcp is missing)"),
    ("metadata", "unreadable (EOFError: Ran out of input)"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(
        tmp_path, monkeypatch, capsys, corpus, straight, damage, problem):
    newest = _copy_checkpoints(straight, tmp_path)
    shard = newest / "__0_0.distcp"
    size = shard.stat().st_size
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "delete":
        shard.unlink()
    else:
        (newest / ".metadata").write_bytes(b"")
    code, err = _main_here(tmp_path, monkeypatch, capsys, *data_flags(corpus),
                           "--train-iters", "6", "--load", "ck")
    assert code == 0, err
    assert (f"warning: checkpoint ck/iter_0000006 is {problem.format(size=size)}; resuming "
            f"from the newest intact one, ck/iter_0000004") in err
    assert not any("Traceback" in line for line in err)
    resumed = launch_records()
    assert [r["iteration"] for r in resumed] == [5, 6]
    assert [r["loss"] for r in resumed] == straight[1][4:]  # bit for bit


@pytest.fixture(scope="module")
def straight_legacy(tmp_path_factory, corpus):
    """``straight`` in Megatron-LM's older format with the distributed optimizer."""
    work = tmp_path_factory.mktemp("straight-legacy")
    code = _main([*TINY, *data_flags(corpus), *LEGACY, "--train-iters", "6", "--save",
                  str(work / "ck"), "--save-interval", "2"])
    assert code == 0
    return work, losses(launch_records())


LEGACY = ["--ckpt-format", "torch", "--use-distributed-optimizer"]


def test_a_damaged_newest_legacy_checkpoint_falls_back_and_counts_on_from_the_older(
        tmp_path, monkeypatch, capsys, corpus, straight_legacy):
    # Megatron-LM's own load would take the optimizer's state and the count from the tracker's
    # iteration 6, and train nothing (megatron_compat's legacy_distributed_optimizer_...).
    model = _copy_checkpoints(straight_legacy, tmp_path) / "mp_rank_00" / "model_optim_rng.pt"
    model.write_bytes(model.read_bytes()[:100])
    code, err = _main_here(tmp_path, monkeypatch, capsys, *data_flags(corpus), *LEGACY,
                           "--train-iters", "6", "--load", "ck")
    assert code == 0, err
    assert ("warning: checkpoint ck/iter_0000006 is unreadable (ck/iter_0000006/mp_rank_00/"
            "model_optim_rng.pt: RuntimeError: PytorchStreamReader failed reading zip archive: "
            "failed finding central directory); resuming from the newest intact one, "
            "ck/iter_0000004") in err
    resumed = launch_records()
    assert [r["iteration"] for r in resumed] == [5, 6]
    assert [r["loss"] for r in resumed] == straight_legacy[1][4:]  # bit for bit


def test_a_split_without_validation_data_trains_and_skips_validation(tmp_path, monkeypatch,
                                                                    capsys, corpus):
    # Megatron-LM 0.19.2 still evaluated after training, on a None iterator: a TypeError.
    code, err = _main_here(tmp_path, monkeypatch, capsys, *data_flags(corpus)[:2], "--split",
                           "100,0,0", "--eval-iters", "2", "--train-iters", "2")
    assert code == 0, err
    records = launch_records()
    assert [r["iteration"] for r in records] == [1, 2]
    assert not any("val_loss" in r for r in records)


def test_exit_on_missing_checkpoint_is_an_error_in_one_line(tmp_path, monkeypatch, capsys,
                                                             corpus):
    # Megatron-LM prints its notice and exits with status 0, as if it had trained.
    code, err = _main_here(tmp_path, monkeypatch, capsys, *data_flags(corpus), "--train-iters",
                           "2", "--load", "nothing", "--exit-on-missing-checkpoint")
    assert (code, err[-1]) == (2, "pretrain_gpt.py: error: --load nothing: no checkpoint "
                                  "there, and --exit-on-missing-checkpoint stops the run")
    assert launch_records() == []


def launch_records():
    from megatron_adacc import megatron_lm

    return megatron_lm.session().records


# Megatron-LM's OptimizerParamScheduler words the refusal (its decay counts samples: 4 a step;
# "checkpointvalue" is its spelling); the old trainer's wording named the flags. Unlike the old
# trainer, a checkpoint at --train-iters itself trains nothing and ends with 0.
def _schedule_refusal(what: str) -> str:
    return (f"pretrain_gpt.py: error: --load ck: OptimizerParamScheduler: {what} do not match; "
            f"add --override-opt_param-scheduler to train on the flags' schedule or "
            f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's")


@pytest.mark.parametrize("flags, status, message", [
    (["--train-iters", "3"], 2, _schedule_refusal(
        "class input value 12 and checkpointvalue 24 for total number of iterations")),
    (["--train-iters", "6"], 0, None),
    (["--train-iters", "8"], 2, _schedule_refusal(
        "class input value 32 and checkpointvalue 24 for total number of iterations")),
])
def test_loading_into_the_wrong_run_says_why(tmp_path, monkeypatch, capsys, corpus, straight,
                                            flags, status, message):
    _copy_checkpoints(straight, tmp_path)
    code, err = _main_here(tmp_path, monkeypatch, capsys, *data_flags(corpus), *flags,
                           "--load", "ck")
    assert code == status, err
    if message is None:
        assert launch_records() == []  # nothing trained
    else:
        assert err[-1] == message


_OTHER_MODEL = ("pretrain_gpt.py: error: --load ck: the checkpoint holds another model than these "
                "flags build ({}); give the model flags it was saved with")


def test_an_optimizer_of_other_parameters_is_refused_in_one_line(tmp_path, monkeypatch, capsys,
                                                                corpus):
    # torch's optimizer refused the groups of a --ckpt-format torch checkpoint in a traceback.
    torch_format = ["--ckpt-format", "torch", "--train-iters", "2"]
    code, err = _main_here(tmp_path, monkeypatch, capsys, *data_flags(corpus), *torch_format,
                           "--save", "ck", "--save-interval", "2")
    assert code == 0, err
    code, err = _main_here(tmp_path, monkeypatch, capsys, *data_flags(corpus), *torch_format,
                           "--qk-layernorm", "--load", "ck")
    assert (code, err[-1:]) == (2, [_OTHER_MODEL.format(
        "loaded state dict contains a parameter group that doesn't match the size of "
        "optimizer's group")])


@pytest.mark.parametrize("legacy, flags, message", [
    (False, ["--num-layers", "3"], _OTHER_MODEL.format(
        "Global shape mismatch for loaded (torch.Size([2, 64])) and expected ((3, 64)) tensor for "
        "key decoder.layers.self_attention.linear_qkv.layer_norm_weight")),
    (False, ["--qk-layernorm"], _OTHER_MODEL.format(
        "decoder.layers.self_attention.q_layernorm.weight from model not in state dict")),
    (False, ["--ckpt-format", "torch"], "pretrain_gpt.py: error: --load ck: Detected load from "
     "a distributed checkpoint, but neither --use-dist-ckpt nor --auto-detect-ckpt-format is "
     "set."),
    (True, ["--num-layers", "3"], _OTHER_MODEL.format(
        "num_layers value from checkpoint (2) is not equal to the input argument value (3)")),
    (True, ["--qk-layernorm"], _OTHER_MODEL.format(
        "Number of unpadded elements must be same in current run (127232) and checkpoint "
        "(126720)")),
])
def test_a_checkpoint_of_another_model_is_refused_in_one_line(
        tmp_path, monkeypatch, capsys, corpus, straight, straight_legacy, legacy, flags, message):
    # Each ended in a traceback: from DCP, megatron-core's optimizer or Megatron-LM's checks.
    _copy_checkpoints(straight_legacy if legacy else straight, tmp_path)
    code, err = _main_here(tmp_path, monkeypatch, capsys, *data_flags(corpus),
                           *(LEGACY if legacy else []), "--train-iters", "6", *flags,
                           "--load", "ck")
    assert (code, err[-1:]) == (2, [message])


@pytest.mark.parametrize("which, lr_at_7", [
    ("--override-opt_param-scheduler", "flags"), ("--use-checkpoint-opt_param-scheduler", "min")])
def test_a_changed_schedule_trains_on_the_schedule_the_user_names(
        tmp_path, monkeypatch, capsys, corpus, straight, which, lr_at_7):
    _copy_checkpoints(straight, tmp_path)
    code, err = _main_here(tmp_path, monkeypatch, capsys, *data_flags(corpus),
                           "--train-iters", "8", "--load", "ck", which)
    assert code == 0, err
    lrs = [r["lr"] for r in launch_records()]
    assert len(lrs) == 2
    if lr_at_7 == "min":  # the checkpoint's schedule decayed to --min-lr at iteration 6
        assert lrs == [1e-4, 1e-4]
    else:  # the flags' 8-iteration cosine is still above its minimum at iteration 7
        assert 1e-4 < lrs[0] and lrs[1] < lrs[0]


@pytest.mark.parametrize("directory", ["empty", "not-yet"])
def test_load_of_a_directory_without_checkpoints_warns_and_starts_from_scratch(
        tmp_path, monkeypatch, capsys, corpus, directory):
    (tmp_path / "empty").mkdir()
    code, err = _main_here(tmp_path, monkeypatch, capsys, *data_flags(corpus),
                           "--train-iters", "2", "--load", directory)
    assert code == 0
    assert (f"warning: --load {directory}: no checkpoint there (no "
            f"latest_checkpointed_iteration.txt, no iter_*); training starts from scratch"
            ) in err
    assert [r["iteration"] for r in launch_records()] == [1, 2]


def test_every_saved_object_loads_with_weights_only(straight, distributed):
    from megatron.core import dist_checkpointing

    safe_checkpoint.install()  # ShardedObjects through torch.load(weights_only=True)
    final = straight[0] / "ck" / "iter_0000006"
    metadata = safe_checkpoint.read_metadata(final)
    objects = [fqn for fqn, item in metadata.state_dict_metadata.items()
               if type(item).__name__ == "BytesStorageMetadata"]
    assert any(fqn.startswith("rng_state") for fqn in objects)
    # Megatron-LM's rng_state holds numpy's generator state, which megatron-core allowlists
    # for weights_only itself; everything else is plain tensors and values.
    import io

    import torch.distributed.checkpoint as dcp

    loaded = {fqn: io.BytesIO() for fqn in objects}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(final)), no_dist=True)
    common = dist_checkpointing.load_common_state_dict(str(final))
    assert common["iteration"] == 6
    (rng,) = [value for fqn, value in loaded.items() if fqn.startswith("rng_state")]
    while isinstance(rng, list):  # a list per data-parallel rank, in DCP's own wrapping
        rng = rng[0]
    assert rng["torch_rng_state"].dtype == torch.uint8


# --- 4. flags and config keys ---------------------------------------------------------------

def _main(argv):
    spec = importlib.util.spec_from_file_location("pretrain_gpt", PRETRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


# Megatron-LM's parser and validate_args word most of these now (its assertions name the
# check and its line); a config value is the flag's text, so argparse words a wrong type.
@pytest.mark.parametrize("flags, config, message", [
    (["--global-batch-size", "-8"], None,
     "Megatron-LM refused the flags: assert args.global_batch_size > 0 (arguments.py:687)"),
    ([], {"micro-batch-size": 2.7}, "argument --micro-batch-size: invalid int value: '2.7'"),
    ([], {"num-layers": True}, "argument --num-layers: invalid int value: 'True'"),
    ([], {"hidden-sise": 64}, "--config {path}: unknown key 'hidden-sise' (keys are the "
                              "command-line flag names, e.g. num-layers)"),
    # argparse took the list's second value for a stray argument; the second spelling and the
    # second file silently won
    ([], {"num-layers": [2, 3]}, "--config {path}: num-layers: takes one value, got a list"),
    ([], {"num-layers": 2, "num_layers": 3},
     "--config {path}: num-layers and num_layers are one flag, --num-layers; keep one"),
    (["--config", "other.yaml"], {}, "--config is given twice; give one file, and the other's "
                                     "flags on the command line"),
    (["--lr", "-1"], None,
     "Megatron-LM refused the flags: assert args.min_lr <= args.lr (arguments.py:1320)"),
    (["--lr", "nan"], None,
     "Megatron-LM refused the flags: assert args.min_lr <= args.lr (arguments.py:1320)"),
    (["--lr-warmup-iters", "3"], None, "Megatron-LM refused the flags: assert "
     "self.lr_warmup_steps < self.lr_decay_steps (optimizer_param_scheduler.py:160)"),
    # a terse message gets the failed check, which names the flag
    (["--train-samples", "16"], None, "expected iteration-based training: assert "
     "args.train_samples is None (arguments.py:1239)"),
    # half a byte: a fraction of some memory, meant or not, is no budget
    (["--adacc-policy", "auto", "--adacc-memory-budget", "0.5"], None,
     "AdaccConfig.memory_budget (--adacc-memory-budget) 0.5: expected a positive size, e.g. "
     "24GiB (a bare number is bytes)"),
    (["--adacc-memory-budget", "1GiB"], None,
     "--adacc-memory-budget 1GiB has no effect with --adacc-policy none; drop it, or plan for "
     "it with --adacc-policy auto"),
    (["--adacc-policy", "missing.yaml"], None,
     "--adacc-policy missing.yaml: plan file not found (or give one of none, auto, "
     "auto-no-outlier, full-recompute, quantize)"),
])
def test_bad_flags_and_keys_are_refused_when_parsed(tmp_path, capsys, corpus, flags, config,
                                                    message):
    path = tmp_path / "bad.yaml"
    tiny = TINY
    if config is not None:  # in place of TINY's config: one --config a run
        path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in config.items()))
        tiny = ["--config", str(path), *TINY[2:]]
    assert _main([*tiny, *flags, *data_flags(corpus), "--train-iters", "2"]) == 2
    assert capsys.readouterr().err == f"pretrain_gpt.py: error: {message.format(path=path)}\n"


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train-iters: 1e3\nlr: 3e-4\n")
    args = launch.build_parser().parse_args(launch.config_argv(["--config", str(path)]))
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
             "--adacc-profile-repeats", "1", "--adacc-profile-db", tmp_path / "p.sqlite"]
    # two processes forked together, each a plain run (no world between them)
    done = forked.torchrun(2, [PRETRAIN, *flags], cwd=tmp_path, env=child_env(), world=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "adacc: profile database" not in done.stderr, done.stderr  # no "not caching", no move
    with sqlite3.connect(tmp_path / "p.sqlite") as db:
        assert db.execute("SELECT count(*) FROM profiles").fetchone()[0] == 1
    cache = Path(f"{prefix}/cache/GPTDataset_indices")
    names = sorted(p.name for p in cache.iterdir())
    assert len(names) == 8 and not any(n.startswith(".") for n in names), names
