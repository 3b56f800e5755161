"""scripts/preprocess_data.py writes what pretrain_gpt.py reads: the built-in corpus's bytes
(NullTokenizer at 257) round-trip exactly, and the flags it prints train on them."""
import importlib.util
import json

from helpers.pretrain import ROOT, train


def _preprocess():
    spec = importlib.util.spec_from_file_location("preprocess_data",
                                                  ROOT / "scripts" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bytes_round_trip_and_train(tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = ["In the beginning God created the heaven and the earth. " * 8,
            "Jesus wept. ünïcödé ok " * 8]
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    prefix = tmp_path / "out"
    # with two flags of Megatron-LM's own tool, as a command line copied from it has them
    assert _preprocess().main(["--input", str(source), "--output-prefix", str(prefix),
                               "--append-eod", "--workers", "4"]) == 0
    printed = capsys.readouterr().out
    dataset = IndexedDataset(f"{prefix}_text_document")
    assert [bytes(dataset[i].tolist()[:-1]).decode() for i in range(len(dataset))] == docs
    assert all(dataset[i][-1] == 256 for i in range(len(dataset)))
    flags = printed.split("(train with ")[1].rstrip(")\n").split()
    assert flags[:2] == ["--data-path", f"{prefix}_text_document"]
    records = train(*flags, "--split", "100,0,0", "--train-iters", "1")
    assert len(records) == 1 and records[0]["loss"] > 0


def test_a_run_prints_its_one_line_and_nothing_on_stderr(tmp_path):
    # Megatron-core's import-time notices that Apex and Transformer Engine are missing were
    # eight lines of warnings before the script's one line.
    import subprocess
    import sys

    from helpers.pretrain import child_env

    source = tmp_path / "docs.txt"
    source.write_text("In the beginning God created the heaven and the earth.\n")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "preprocess_data.py"),
                           "--input", str(source), "--output-prefix", str(tmp_path / "out")],
                          capture_output=True, text=True, env=child_env(), timeout=300)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith(f"{tmp_path / 'out'}_text_document: ")
    assert len(done.stdout.splitlines()) == 1
