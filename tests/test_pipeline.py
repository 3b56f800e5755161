"""Pipeline parallelism on megatron-core's schedules (1F1B over gloo): every split of the
model trains like one process, alone and with tensor and data parallelism, and a resumed
pipeline run continues bit for bit."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_adacc.training.checkpointing import CheckpointError
from megatron_adacc.common.plan import Plan
from megatron_adacc.policies import full_recompute_plan, quantize_plan
from test_trainer import TINY, losses, train

HERE = Path(__file__).resolve().parent
ENV = dict(os.environ, OMP_NUM_THREADS="1")
ITERS = 5
TOLERANCE = 1e-5  # relative, the issue's


def _upper_layers_plan(directory: Path, name: str, whole_model_plan: Plan) -> str:
    """``whole_model_plan``'s decisions for layers 2-3 only (stage 1 at PP=2, stages 2-3 at
    PP=4): a later stage must find its layers under their whole-model numbers, and stage 0
    must accept a plan naming layers it does not hold."""
    path = directory / f"{name}.yaml"
    Plan.from_dict({"layers": {"2-3": {"sites": whole_model_plan.to_dict()["sites"]}}}).save(path)
    return str(path)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pipeline")
    return {"recompute": _upper_layers_plan(directory, "recompute", full_recompute_plan()),
            "quantize": _upper_layers_plan(directory, "quantize", quantize_plan())}


# Four layers (one per stage at PP=4), 4 micro-batches of 2 per step (2 per rank at DP=2),
# no dropout (stages draw from different generators). Megatron pads the vocabulary to a
# multiple of divisible-by x TP; 256 keeps it equal.
COMMON = [*TINY, "--num-layers", "4", "--global-batch-size", "8", "--train-iters", str(ITERS),
          "--hidden-dropout", "0", "--attention-dropout", "0",
          "--make-vocab-size-divisible-by", "256"]


def _torchrun(processes: int, runs: dict[str, list[str]], common: list[str]) -> dict:
    spec = json.dumps([{"name": name, "flags": flags} for name, flags in runs.items()])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(processes), str(HERE / "multirank_pipeline.py"), spec, *common]
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _relative_error(got: list[float], expected: list[float]) -> float:
    assert len(got) == len(expected) == ITERS
    return max(abs(a - b) / abs(b) for a, b in zip(got, expected))


def test_pipeline_stages_train_like_one_process_and_resume_bit_for_bit(plans, tmp_path):
    # Recomputing is exact, so every split can match one process under it (int4 compression
    # of tensor-parallel shards quantises other groups than TP=1 does).
    common = [*COMMON, "--adacc-policy", plans["recompute"]]
    quantized = ["--adacc-policy", plans["quantize"]]
    single = losses(train(*common))
    single_quantized = losses(train(*COMMON, *quantized))
    # The compressed layers move the losses well past the tolerance, so a stage that missed
    # its plan would show.
    assert _relative_error(single_quantized, single) > 5 * TOLERANCE
    ckpt = str(tmp_path / "ckpt")
    two = _torchrun(2, {
        "pp2": ["--pipeline-model-parallel-size", "2"],
        "pp2_first": ["--pipeline-model-parallel-size", "2", "--save", ckpt,
                      "--exit-interval", "3"],
        "pp2_resumed": ["--pipeline-model-parallel-size", "2", "--load", ckpt],
        "pp2_quantized": ["--pipeline-model-parallel-size", "2", *quantized],
    }, common)
    four = _torchrun(4, {
        "pp4": ["--pipeline-model-parallel-size", "4"],
        "pp2_dp2": ["--pipeline-model-parallel-size", "2"],
        "pp2_tp2": ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"],
    }, common)
    errors = {name: _relative_error(got, single)
              for name, got in (("pp2", two["pp2"]), *four.items())}
    errors["pp2_quantized"] = _relative_error(two["pp2_quantized"], single_quantized)
    print(json.dumps(errors))  # the agreement the closing note reports
    assert max(errors.values()) < TOLERANCE, errors
    assert two["pp2_first"] + two["pp2_resumed"] == two["pp2"]


@pytest.mark.parametrize("flags, world, message", [
    (["--pipeline-model-parallel-size", "2"], 1,
     "--pipeline-model-parallel-size 2 does not divide the world size 1 / "
     "--tensor-model-parallel-size 1; launch a multiple of 2 processes"),
    (["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"], 2,
     "--pipeline-model-parallel-size 2 does not divide the world size 2 / "
     "--tensor-model-parallel-size 2; launch a multiple of 4 processes"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "3"], 2,
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2: every stage holds "
     "the same number of layers"),
    # auto plans every stage; only the rectifier still re-plans one model.
    (["--pipeline-model-parallel-size", "2", "--adacc-policy", "auto",
      "--adacc-memory-budget", "1GiB", "--adacc-tracking", "backoff"], 2,
     "--adacc-tracking backoff does not run with pipeline stages yet (the rectifier re-plans "
     "one model, not a plan per stage); use --adacc-tracking off with "
     "--pipeline-model-parallel-size 2"),
])
def test_bad_pipeline_flags_say_what_to_change(flags, world, message):
    from megatron_adacc.training.arguments import ConfigError, parse_args

    with pytest.raises(ConfigError) as raised:
        parse_args([*TINY, *flags], world_size=world)
    assert str(raised.value) == message
