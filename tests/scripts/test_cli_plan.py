"""``adacc plan``: table, JSON keys, exit code 2 with one line on infeasible or bad input."""
import json
import subprocess
import sys

import pytest

from megatron_adacc import cli
from megatron_adacc.cli import main
from megatron_adacc.planning import plan_stages as cli_plan_stages
from megatron_adacc.common.units import format_size, parse_size

from helpers import ROOT

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "256", "--vocab-size", "1000", "--micro-batch-size", "2",
         "--hardware", "a100-80gb", "--precision", "bf16"]


def test_table(capsys):
    assert main(["plan", *MODEL, "--memory-budget", "200MiB"]) == 0
    out = capsys.readouterr().out
    for word in ("site", "action", "codec", "rebuilt from", "bytes kept", "time added",
                 "no optimisation", "full recompute", "qkv"):
        assert word in out


def test_a_plan_prints_nothing_on_stderr(capfd):
    # Megatron-LM's import-time warnings (Apex and Transformer Engine missing) need a fresh
    # process: the profiled plan's test below has one. Here, what planning itself prints.
    assert main(["plan", "--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--hardware",
                 "h100-80gb"]) == 0
    out, err = capfd.readouterr()
    assert "site" in out and err == ""


def test_a_profiled_plan_prints_the_table_alone(tmp_path):
    # The profile is one iteration of pretrain_gpt.py in this process: Megatron-LM's log lines
    # (its datasets, buffers, optimizer: about a hundred) came before the table. A fresh
    # process: Megatron-LM's modules warn at import, about ten lines before it.
    done = subprocess.run([sys.executable, "-m", "megatron_adacc.cli", "plan", "--config",
                           str(ROOT / "configs" / "tiny-cpu.yaml"), "--num-layers", "1",
                           "--memory-budget", "1GiB", "--adacc-profile-repeats", "1",
                           "--profile-db", str(tmp_path / "p.sqlite")],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("site ") and "megatron" not in done.stdout


def test_json(capsys, tmp_path):
    config = tmp_path / "model.yaml"
    config.write_text("num-layers: 4\nhidden-size: 256\nnum-attention-heads: 4\n"
                      "seq-length: 256\nbf16: true\n")
    assert main(["plan", "--config", str(config), "--vocab-size", "1000", "--micro-batch-size",
                 "2", "--hardware", "a100-80gb", "--memory-budget", "200MiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("feasible", "activation_bytes", "static_bytes", "added_time_s", "solve_time_s",
                "plan", "minimum_feasible_budget"):
        assert key in data
    assert data["feasible"] is True


def test_infeasible_exit_2_one_line(capsys):
    assert main(["plan", *MODEL, "--memory-budget", "1MiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "smallest feasible budget" in err


def test_a_budget_only_lossy_sources_fit_names_their_flag_and_smallest_budget(capsys):
    # Llama-1B on an H200: the loss sets the peak, so exact plans get no smaller than full
    # recompute, where an int4 layer_in rebuilt from fits less.
    model = ["--config", str(ROOT / "configs" / "llama-1b.yaml"), "--micro-batch-size", "2",
             "--hardware", "h200-141gb"]

    def smallest(*flags) -> tuple[int, int]:
        assert main(["plan", *model, "--memory-budget", "100GiB", "--json", *flags]) == 0
        data = json.loads(capsys.readouterr().out)
        return data["minimum_feasible_budget"], data["static_bytes"]

    (exact, static), (lossy, _) = smallest(), smallest("--lossy-sources")
    assert lossy < exact
    assert main(["plan", *model, "--memory-budget", str(lossy)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith(
        f"smallest feasible budget is {format_size(exact)} ({exact} B; static memory alone is "
        f"{format_size(static)}); with --lossy-sources, which rebuilds recomputed values from "
        f"compressed ones, it is {format_size(lossy)} ({lossy} B)"), err
    assert main(["plan", *model, "--memory-budget", str(lossy), "--lossy-sources"]) == 0
    capsys.readouterr()
    # Below both: nothing else to offer.
    assert main(["plan", *model, "--memory-budget", str(lossy - 1), "--lossy-sources"]) == 2
    assert "with --lossy-sources" not in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["12XB", "lots", "-3GiB"])
def test_bad_size_one_line(capsys, bad):
    assert main(["plan", *MODEL, f"--memory-budget={bad}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "memory size" in err


def test_a_profile_is_refused_as_pretrain_gpt_refuses_its_flags(capsys, tmp_path):
    # Without --hardware the model is profiled by pretrain_gpt.py itself, so its refusals
    # are the plan's, in one line: Megatron-LM requires --max-position-embeddings.
    assert main(["plan", *MODEL[:-4], "--memory-budget", "1GiB",
                 "--profile-db", str(tmp_path / "p.sqlite")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("adacc plan: ") and err.count("\n") == 1
    assert "max_position_embeddings" in err, err   # Megatron-LM's own words


def test_units():
    assert parse_size("1KiB") == 1024 and parse_size("2 GB") == 2 * 10**9
    assert parse_size("512") == 512 and parse_size("1.5MiB") == 1572864
    assert format_size(1536 * 1024**2) == "1.50 GiB"


PAPER_RUNS = [("gpt-117m.yaml", 32, []), ("gpt-117m.yaml", 64, []),
              ("gpt-345m.yaml", 8, []), ("gpt-345m.yaml", 16, [])] + [
    # 4.7B's parameters, gradients and Adam states alone exceed 32 GB: the paper trains it
    # with ZeRO over 8 GPUs.
    ("gpt-4.7b.yaml", batch, ["--use-distributed-optimizer", "--data-parallel-size", "8"])
    for batch in (1, 2, 3, 4)]


@pytest.mark.parametrize("config, batch, extra", PAPER_RUNS)
def test_paper_models_plan_on_a_v100_at_the_papers_batch_sizes(capsys, config, batch, extra):

    path = ROOT / "configs" / config
    assert main(["plan", "--config", str(path), "--micro-batch-size", str(batch),
                 "--hardware", "v100-32gb", "--precision", "fp16", "--json", *extra]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["feasible"]
    assert result["static_bytes"] + result["activation_bytes"] <= 32 * 2**30


# --- pipeline stages -----------------------------------------------------------------------
# Unfused attention: the byte counts below are the local spec's (auto would pick flash).
PIPELINE = [*MODEL, "--attention-backend", "unfused", "--pipeline-model-parallel-size", "2",
            "--num-micro-batches", "4"]


def _stages_of(capsys, argv):
    assert main(["plan", *argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["feasible"] and len(data["stages"]) == data["pipeline_model_parallel_size"]
    return data["stages"]


def _stages(capsys, *extra):
    return _stages_of(capsys, [*PIPELINE, *extra])


def test_pipeline_plans_each_stage_and_the_first_stores_less_when_the_budget_binds(capsys):
    from megatron_adacc.planning import analytic

    # Under 1F1B stage 0 of 2 holds 2 micro-batches, stage 1 one: at stage 1's unoptimised
    # peak, stage 1 keeps everything and stage 0 has to store less per micro-batch.
    loose = _stages(capsys, "--memory-budget", "1TiB")
    assert [s["in_flight_micro_batches"] for s in loose] == [2, 1]
    assert [s["layers"] for s in loose] == ["0-1", "2-3"]
    budget = loose[1]["references"]["no optimisation"]["peak_bytes"]
    # bf16: 2 + 4 + 12 bytes a parameter (fp32 gradients) of stage 1's 1,842,176, and its
    # activations
    assert budget == 51267584
    assert loose[0]["minimum_feasible_budget"] <= budget \
        < loose[0]["references"]["no optimisation"]["peak_bytes"]
    stages = _stages(capsys, "--memory-budget", str(budget))
    stored = [sum(row["bytes_kept"] for row in s["sites"]) for s in stages]
    shape = analytic.ModelShape(4, 256, 4, 256, 1000, precision="bf16")
    assert stored[1] == 2 * sum(analytic.site_bytes(shape, 2).values())   # all retained
    assert stored[0] < stored[1]
    assert all(s["peak_bytes"] <= budget == s["budget_bytes"] for s in stages)

    assert main(["plan", *PIPELINE, "--memory-budget", str(budget)]) == 0
    out = capsys.readouterr().out
    assert out.count("no optimisation") == 2
    assert "stage 0 of 2: layers 0-1 (rows number them from 0), 2 micro-batches in flight" in out
    assert "stage 1 of 2: layers 2-3 (rows number them from 0), 1 micro-batch in flight" in out


def test_an_infeasible_stage_is_named_with_its_smallest_feasible_budget(capsys):
    from megatron_adacc import planning
    from megatron_adacc.planning import analytic

    # GPT-2's vocabulary: the last stage's logits make it the one that does not fit.
    model = [*PIPELINE, "--vocab-size", "50257"]     # the last flag given wins
    shape = analytic.ModelShape(4, 256, 4, 256, 50257, precision="bf16")
    stages = analytic.pipeline_costs(shape, 2, "a100-80gb", 2, 4)
    # adacc plan plans as the trainer does: exact rebuild sources.
    minimum = [planning.minimum_feasible_budget(costs, allow_lossy_sources=False)
               for costs in stages]
    assert main(["plan", *model, "--memory-budget", str(minimum[1] - 1), "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {
        "feasible": False, "budget_bytes": minimum[1] - 1, "stage": 1,
        "minimum_feasible_budget": minimum[1], "static_bytes": stages[1].static_bytes}
    err = captured.err.strip()
    assert "\n" not in err and err.startswith("adacc plan: pipeline stage 1: memory budget")
    assert f"smallest feasible budget is {format_size(minimum[1])} ({minimum[1]} B" in err


def test_distributed_optimizer_is_zero1(capsys):
    from megatron_adacc.planning import analytic

    stages = _stages(capsys, "--memory-budget", "1TiB", "--data-parallel-size", "4",
                     "--use-distributed-optimizer")
    shape = analytic.ModelShape(4, 256, 4, 256, 1000, precision="bf16")
    expected = analytic.pipeline_costs(shape, 2, "a100-80gb", 2, 4, zero_stage=1,
                                       data_parallel_size=4)
    assert [s["static_bytes"] for s in stages] == [c.static_bytes for c in expected]
    assert main(["plan", *PIPELINE, "--use-distributed-optimizer", "--zero-stage", "2"]) == 2
    assert "ZeRO stage 1" in capsys.readouterr().err


def test_gpt345m_on_four_v100_stages(capsys):

    # The paper's larger 345M batch at PP=4 (2 data-parallel ranks, ZeRO-1, 8 micro-batches):
    # the first two stages must optimise, the last two keep everything.
    path = ROOT / "configs" / "gpt-345m.yaml"
    stages = _stages_of(capsys, ["--config", str(path), "--micro-batch-size", "16",
                                 "--hardware", "v100-32gb", "--precision", "fp16",
                                 "--pipeline-model-parallel-size", "4", "--num-micro-batches",
                                 "8", "--data-parallel-size", "2",
                                 "--use-distributed-optimizer"])
    assert [s["in_flight_micro_batches"] for s in stages] == [4, 3, 2, 1]
    assert all(s["peak_bytes"] <= s["budget_bytes"] == 31 * 2**30 for s in stages)
    assert [s["added_time_s"] > 0 for s in stages] == [True, True, False, False]


def test_fp16_profiles_the_trainers_fp16_model(capsys, tmp_path):

    # A bf16 config: --precision replaces its precision, as it does with --hardware.
    tiny = tmp_path / "tiny-bf16.yaml"
    tiny.write_text((ROOT / "configs" / "tiny-cpu.yaml")
                    .read_text() + "bf16: true\n")
    db = tmp_path / "profiles.sqlite"
    assert main(["plan", "--config", str(tiny), "--num-layers", "1", "--hidden-size", "64",
                 "--seq-length", "32", "--micro-batch-size", "2", "--precision", "fp16",
                 "--memory-budget", "1GiB", "--profile-db", str(db), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["feasible"]
    import sqlite3

    with sqlite3.connect(db) as conn:
        (key,), = conn.execute("SELECT key FROM profiles").fetchall()
    config = json.loads(key)["config"]
    assert (config["params_dtype"], config["fp16"], config["bf16"]) == ("float16", True, False)


# --- one config reader (issue 25) ----------------------------------------------------------
CONFIGS = ROOT / "configs"


@pytest.mark.parametrize("config", ["tiny-cpu.yaml", "demo.yaml"])
def test_the_projects_own_configs_plan(capsys, config):
    # ByteLevel's vocabulary is the tokenizer's own; micro-batch-size comes from the config.
    assert main(["plan", "--config", str(CONFIGS / config), "--hardware", "a100-80gb",
                 "--memory-budget", "1GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["feasible"]


def test_a_config_is_accepted_and_refused_as_the_trainer_does(tmp_path, capsys):
    from megatron_adacc import launch
    from megatron_adacc.megatron_lm import ConfigError

    config = tmp_path / "c.yaml"
    config.write_text((CONFIGS / "tiny-cpu.yaml").read_text() + "num-layerz: 3\n")
    with pytest.raises(ConfigError) as info:
        launch.parse(["--config", str(config)])
    assert main(["plan", "--config", str(config), "--hardware", "a100-80gb"]) == 2
    assert capsys.readouterr().err == f"adacc plan: {info.value}\n"


def test_a_bad_training_flag_is_refused_as_pretrain_gpt_refuses_it(capsys):
    import pretrain_gpt

    assert pretrain_gpt.main(["--num-layerz", "3"]) == 2
    trainer = capsys.readouterr().err.strip().removeprefix("pretrain_gpt.py: error: ")
    assert main(["plan", *MODEL, "--num-layerz", "3"]) == 2
    assert capsys.readouterr().err == f"adacc plan: {trainer}\n"


# Each planned a model other than the one trained: Megatron's recompute on top, the sequence
# split over ranks, several chunks a rank, or a layer no family describes (planned dense).
@pytest.mark.parametrize("flags, message", [
    (["--recompute-granularity", "full", "--recompute-method", "uniform"],
     "--recompute-granularity full keeps only each layer's input, which leaves --adacc-policy "
     "auto nothing to plan; drop it (auto's plans include full recompute)"),
    (["--recompute-granularity", "selective"],
     "--recompute-granularity selective: the analytic model prices no Megatron recompute beside "
     "Adacc's plan; drop it, or plan from this machine's profile (no --hardware)"),
    (["--context-parallel-size", "2"], "--context-parallel-size 2: Adacc's layer "
                                       "(--transformer-impl local) has no context parallelism"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
     "Adacc plans one model chunk per rank; drop the virtual pipeline flags"),
    (["--num-experts", "8"], "--num-experts 8 builds a mixture-of-experts MLP, and Adacc's "
                             "layer knows the dense GPT and Llama layers only"),
    (["--window-size", "127,0"], "--window-size 127,0 builds sliding-window attention, and "
                                 "Adacc's layer knows the dense GPT and Llama layers only"),
])
def test_flags_a_plan_would_leave_out_are_refused_in_one_line(capsys, flags, message):
    assert main(["plan", *MODEL, *flags]) == 2
    assert capsys.readouterr().err == f"adacc plan: {message}\n"


def test_megatron_lms_flags_shape_the_plan(capsys):
    # Llama flags of Megatron-LM (no config): the planned shape is the one they describe.
    from megatron_adacc import cli

    llama = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "256", "--max-position-embeddings", "256", "--swiglu",
             "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups",
             "2", "--disable-bias-linear", "--position-embedding-type", "rope"]
    shape = cli.model_shape(llama)
    assert (shape.swiglu, shape.normalization, shape.num_query_groups) == (True, "RMSNorm", 2)
    assert not shape.add_bias_linear and shape.vocab_size == 257   # the built-in corpus's
    assert cli.model_shape([*llama, "--vocab-size", "1000"]).vocab_size == 1000
    assert main(["plan", *llama, "--micro-batch-size", "1", "--hardware", "a100-80gb",
                 "--memory-budget", "1GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["feasible"]


def test_a_configs_tensor_parallel_size_is_planned_not_ignored(tmp_path, capsys):
    config = tmp_path / "tp.yaml"
    config.write_text((CONFIGS / "tiny-cpu.yaml").read_text()
                      + "tensor-model-parallel-size: 2\n")
    plan = ["plan", "--hardware", "a100-80gb", "--memory-budget", "1TiB", "--json"]

    def planned(*flags):
        assert main([*plan, *flags]) == 0
        return {k: v for k, v in json.loads(capsys.readouterr().out).items()
                if k != "solve_time_s"}

    from_config = planned("--config", str(config))
    assert from_config == planned("--config", str(CONFIGS / "tiny-cpu.yaml"),
                                  "--tensor-model-parallel-size", "2")
    assert from_config != planned("--config", str(CONFIGS / "tiny-cpu.yaml"))
    # A profile here is one process: the split model's ranks are not there to measure.
    assert main(["plan", "--config", str(config), "--memory-budget", "1GiB",
                 "--profile-db", str(tmp_path / "p.sqlite")]) == 2
    assert capsys.readouterr().err == (
        "adacc plan: tensor-model-parallel-size 2: a profile on this machine measures one "
        "process; plan it with --hardware, or train it under torchrun, which profiles every "
        "rank\n")


def test_a_cpu_profile_without_a_budget_is_refused_before_profiling(tmp_path, capsys):
    db = tmp_path / "profiles.sqlite"
    assert main(["plan", "--config", str(CONFIGS / "tiny-cpu.yaml"),
                 "--profile-db", str(db)]) == 2
    assert capsys.readouterr().err == ("adacc plan: --memory-budget SIZE is needed to plan "
                                       "for a CPU (no device capacity to default to)\n")
    assert not db.exists()


def test_the_table_the_error_and_the_json_quote_one_smallest_budget(tmp_path, capsys):
    # One model, one ProfileDB: the JSON's figure is the table's, the error's, and the
    # budget at which a plan still fits; one byte less fits none.
    tiny = ["plan", "--config", str(CONFIGS / "tiny-cpu.yaml"), "--num-layers", "1",
            "--hidden-size", "64", "--seq-length", "32", "--micro-batch-size", "2",
            "--profile-db", str(tmp_path / "profiles.sqlite")]
    assert main([*tiny, "--memory-budget", "1GiB", "--json"]) == 0
    minimum = json.loads(capsys.readouterr().out)["minimum_feasible_budget"]
    assert main([*tiny, "--memory-budget", "1GiB"]) == 0
    assert f"smallest feasible budget {format_size(minimum)} ({minimum} B);" in \
        capsys.readouterr().out
    assert main([*tiny, "--memory-budget", str(minimum - 1)]) == 2
    assert f"the smallest feasible budget is {format_size(minimum)} ({minimum} B;" in \
        capsys.readouterr().err
    assert main([*tiny, "--memory-budget", str(minimum), "--json"]) == 0
    fits = json.loads(capsys.readouterr().out)
    assert fits["peak_bytes"] <= minimum == fits["minimum_feasible_budget"]


def test_a_bad_flag_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--hardware", "abacus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("adacc plan: error: argument --hardware: invalid choice: 'abacus'")
    assert err.count("\n") == 1


def test_the_gpu_step_is_priced_with_the_optimizer_this_install_runs(capsys, monkeypatch):
    """Without Transformer Engine and Apex megatron-core steps with torch's AdamW, whose foreach
    path on a GPU makes a workspace like every fp32 main parameter; their fused Adam makes none.
    GPT-345M in fp16 then peaks in the step under full recompute."""
    from megatron.core import optimizer

    plan = ["plan", "--config", str(CONFIGS / "gpt-345m.yaml"), "--micro-batch-size", "4",
            "--hardware", "h200-141gb", "--memory-budget", "100GiB", "--json"]
    planned = {}
    for torch_adam in (True, False):
        monkeypatch.setattr(optimizer, "USING_PYTORCH_OPTIMIZER", torch_adam)
        assert main(plan) == 0
        planned[torch_adam] = json.loads(capsys.readouterr().out)
    parameters = 354_871_296  # GPT-345M's, its tied embedding padded to 50,304 rows
    # the fp32 gradient copies and the workspace: 8 bytes a parameter over static
    assert (planned[True]["minimum_feasible_budget"]
            == planned[True]["static_bytes"] + 8 * parameters)
    assert (planned[False]["minimum_feasible_budget"]
            < planned[True]["minimum_feasible_budget"] - (1 << 30))


def test_the_trainers_adacc_flags_plan_as_its_auto_policy_would(tmp_path, capsys, monkeypatch):
    # A config of pretrain_gpt.py's run: its budget is the plan's, not the accelerator's.
    config = tmp_path / "run.yaml"
    config.write_text("adacc-policy: auto\nadacc-memory-budget: 200MiB\n")

    def planned(*flags):
        assert main(["plan", *MODEL, *flags, "--json"]) == 0
        return {k: v for k, v in json.loads(capsys.readouterr().out).items()
                if k != "solve_time_s"}

    from_config = planned("--config", str(config))
    assert from_config["budget_bytes"] == 200 << 20
    assert from_config == planned("--memory-budget", "200MiB")
    assert from_config == planned("--adacc-memory-budget", "204800KiB", "--memory-budget",
                                  "200MiB")
    # The policy's codecs and the rebuild sources reach the planner.
    seen = []
    monkeypatch.setattr(cli, "plan_stages", lambda stages, budget, **options: seen.append(
        (budget, options)) or cli_plan_stages(stages, budget, **options))
    planned("--config", str(config), "--adacc-policy", "auto-no-outlier",
            "--adacc-lossy-sources")
    planned("--memory-budget", "1GiB")
    assert [(budget, options["separate_outliers"], options["allow_lossy_sources"])
            for budget, options in seen] == [(200 << 20, False, True), (1 << 30, True, False)]


@pytest.mark.parametrize("flags, message", [
    (["--memory-budget", "1GiB", "--adacc-memory-budget", "2GiB"],
     "--memory-budget 1GiB and --adacc-memory-budget 2GiB disagree; give one"),
    (["--profile-db", "a.sqlite", "--adacc-profile-db", "b.sqlite"],
     "--profile-db a.sqlite and --adacc-profile-db b.sqlite disagree; give one"),
    (["--exact", "--adacc-lossy-sources"], "--exact and --adacc-lossy-sources disagree; give one"),
    (["--adacc-policy", "quantize"], "--adacc-policy quantize runs a fixed plan, with no budget "
                                     "to plan for; adacc plan plans auto and auto-no-outlier"),
    (["--adacc-memory-budget", "lots"], "--adacc-memory-budget: bad memory size 'lots'; write a "
                                        "number with a unit, e.g. 24GiB, 512MiB, 32GB"),
])
def test_the_trainers_adacc_flags_against_adaccs_own_are_refused_in_one_line(
        capsys, flags, message):
    assert main(["plan", *MODEL, *flags]) == 2
    assert capsys.readouterr().err == f"adacc plan: {message}\n"
