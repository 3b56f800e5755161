"""``adacc plan``: table, JSON keys, exit code 2 with one line on infeasible or bad input."""
import json

import pytest

from megatron_adacc.cli import main
from megatron_adacc.units import format_size, parse_size

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "256", "--vocab-size", "1000", "--micro-batch-size", "2",
         "--hardware", "a100-80gb", "--precision", "bf16"]


def test_table(capsys):
    assert main(["plan", *MODEL, "--memory-budget", "200MiB"]) == 0
    out = capsys.readouterr().out
    for word in ("site", "action", "codec", "bytes kept", "time added", "no optimisation",
                 "full recompute", "qkv"):
        assert word in out


def test_json(capsys, tmp_path):
    config = tmp_path / "model.yaml"
    config.write_text("num-layers: 4\nhidden-size: 256\nnum-attention-heads: 4\n"
                      "seq-length: 256\nvocab-size: 1000\nbf16: true\n")
    assert main(["plan", "--config", str(config), "--micro-batch-size", "2", "--hardware",
                 "a100-80gb", "--memory-budget", "200MiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("feasible", "activation_bytes", "static_bytes", "added_time_s", "solve_time_s",
                "plan", "minimum_feasible_budget"):
        assert key in data
    assert data["feasible"] is True


def test_infeasible_exit_2_one_line(capsys):
    assert main(["plan", *MODEL, "--memory-budget", "1MiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "smallest feasible budget" in err


@pytest.mark.parametrize("bad", ["12XB", "lots", "-3GiB"])
def test_bad_size_one_line(capsys, bad):
    assert main(["plan", *MODEL, f"--memory-budget={bad}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "memory size" in err


def test_no_profile_no_hardware(capsys):
    assert main(["plan", *MODEL[:-4], "--memory-budget", "1GiB"]) == 2
    assert "--hardware" in capsys.readouterr().err


def test_units():
    assert parse_size("1KiB") == 1024 and parse_size("2 GB") == 2 * 10**9
    assert parse_size("512") == 512 and parse_size("1.5MiB") == 1572864
    assert format_size(1536 * 1024**2) == "1.50 GiB"


PAPER_RUNS = [("gpt-117m.yaml", 32, []), ("gpt-117m.yaml", 64, []),
              ("gpt-345m.yaml", 8, []), ("gpt-345m.yaml", 16, [])] + [
    # 4.7B's parameters, gradients and Adam states alone exceed 32 GB: the paper trains it
    # with ZeRO over 8 GPUs.
    ("gpt-4.7b.yaml", batch, ["--zero-stage", "1", "--data-parallel-size", "8"])
    for batch in (1, 2, 3, 4)]


@pytest.mark.parametrize("config, batch, extra", PAPER_RUNS)
def test_paper_models_plan_on_a_v100_at_the_papers_batch_sizes(capsys, config, batch, extra):
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "configs" / config
    assert main(["plan", "--config", str(path), "--micro-batch-size", str(batch),
                 "--hardware", "v100-32gb", "--precision", "fp16", "--json", *extra]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["feasible"]
    assert result["static_bytes"] + result["activation_bytes"] <= 32 * 2**30


def test_fp16_profiles_the_trainers_fp16_model(capsys, tmp_path):
    from pathlib import Path

    # A bf16 config: --precision replaces its precision, as it does with --hardware.
    tiny = tmp_path / "tiny-bf16.yaml"
    tiny.write_text((Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml")
                    .read_text() + "bf16: true\n")
    db = tmp_path / "profiles.sqlite"
    assert main(["plan", "--config", str(tiny), "--num-layers", "1", "--hidden-size", "64",
                 "--seq-length", "32", "--micro-batch-size", "2", "--precision", "fp16",
                 "--memory-budget", "1GiB", "--profile-db", str(db), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["feasible"]
    import sqlite3

    with sqlite3.connect(db) as conn:
        (key,), = conn.execute("SELECT key FROM profiles").fetchall()
    assert json.loads(key)["params_dtype"] == "float16"
