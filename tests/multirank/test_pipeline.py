"""Pipeline parallelism through Megatron-LM's loop (1F1B over gloo): every split of the model
trains like one process, alone and with tensor and data parallelism, each stage applies its
part of a plan, and a resumed pipeline run continues bit for bit."""
import pytest

from megatron_adacc.common.plan import Plan
from megatron_adacc.policies import full_recompute_plan, quantize_plan
from helpers.pretrain import TINY, losses, torchrun, train

ITERS = 4


def _upper_layers_plan(directory, name: str, whole_model_plan: Plan) -> str:
    """``whole_model_plan``'s decisions for layers 2-3 only (stage 1 at PP=2, stages 2-3 at
    PP=4): a later stage must find its layers under their whole-model numbers, and stage 0
    must accept a plan naming layers it does not hold."""
    path = directory / f"{name}.yaml"
    Plan.from_dict({"layers": {"2-3": {"sites": whole_model_plan.to_dict()["sites"]}}}).save(path)
    return str(path)


# Four layers (one per stage at PP=4), 4 micro-batches of 2 per step (2 per rank at DP=2),
# no dropout (stages draw from different generators). Megatron pads the vocabulary to a
# multiple of divisible-by x TP; 256 keeps it equal. The schedule is the checkpoint's, made
# for ITERS iterations. No gradient clipping: its norm sums each stage's squares, then the
# stages', another order than one process's sum, and a rounding apart on some CPUs (AVX2).
COMMON = ["--num-layers", "4", "--global-batch-size", "8", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--make-vocab-size-divisible-by", "256",
          "--lr-decay-iters", str(ITERS), "--use-checkpoint-opt_param-scheduler",
          "--clip-grad", "0"]
PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """The plans, and one process's checkpoint after its first iteration, which every run
    resumes: Megatron-LM seeds each pipeline stage's initialisation apart (seed + 100 x
    stage), so a split starts from other weights than one process unless both load them."""
    directory = tmp_path_factory.mktemp("pipeline")
    start = str(directory / "iteration1")
    train(*COMMON, "--train-iters", "1", "--save", start, "--save-interval", "1")
    return {"recompute": _upper_layers_plan(directory, "recompute", full_recompute_plan()),
            "quantize": _upper_layers_plan(directory, "quantize", quantize_plan()),
            "checkpoint": start}


def _losses(reports) -> list[float]:
    return losses(reports[0]["records"])  # rank 0 writes the records


def test_pipeline_stages_train_like_one_process_and_resume_bit_for_bit(start, tmp_path):
    recompute = ["--adacc-policy", start["recompute"]]
    quantized = ["--adacc-policy", start["quantize"]]
    resume = [*COMMON, "--train-iters", str(ITERS), "--load", start["checkpoint"]]
    single = losses(train(*resume, *recompute))
    single_quantized = losses(train(*resume, *quantized))
    assert len(single) == ITERS - 1
    # The compressed layers move the losses, so a stage that missed its plan would show.
    assert single_quantized != single
    halfway = str(tmp_path / "halfway")
    two = torchrun(2, {
        "pp2": [*PP2, *recompute],
        "pp2_first": [*PP2, *recompute, "--save", halfway, "--save-interval", "3",
                      "--exit-interval", "3"],
        "pp2_resumed": [*PP2, *recompute, "--load", halfway],  # the last --load counts
        "pp2_quantized": [*PP2, *quantized],
    }, *resume)
    four = torchrun(4, {
        "pp4": ["--pipeline-model-parallel-size", "4", *recompute],
        "pp2_dp2": [*PP2, *recompute],
        "pp2_tp2": [*PP2, "--tensor-model-parallel-size", "2", *recompute],
    }, *resume)
    # Recomputing is exact, and so is every split of the same arithmetic: bit for bit.
    for name, reports in (("pp2", two["pp2"]), ("pp4", four["pp4"]),
                          ("pp2_tp2", four["pp2_tp2"])):
        assert _losses(reports) == single, name
    # Data parallelism sums each rank's two micro-batches, then the ranks': the same terms
    # in another order, a rounding apart.
    assert max(abs(a - b) / b for a, b in zip(_losses(four["pp2_dp2"]), single)) < 1e-6
    # int4 over whole (not tensor-parallel) layers quantises the same groups at PP=2.
    assert _losses(two["pp2_quantized"]) == single_quantized
    # Every stage reports its own plan and readings on rank 0's record.
    for name, reports in (("pp2", two["pp2"]), ("pp4", four["pp4"])):
        stages = reports[0]["records"][0]["stages"]
        assert [s["pipeline_stage"] for s in stages] == list(range(len(stages))), name
    first = _losses(two["pp2_first"])
    assert len(first) == 2 and first + _losses(two["pp2_resumed"]) == _losses(two["pp2"])


@pytest.mark.parametrize("flags, world, message", [
    (PP2, 1, "world size (1) is not divisible by total_model_size (total_model_size=2): "
              "assert args.world_size % total_model_size == 0 (arguments.py:430)"),
    ([*PP2, "--tensor-model-parallel-size", "2"], 2,
     "world size (2) is not divisible by total_model_size (total_model_size=4): "
     "assert args.world_size % total_model_size == 0 (arguments.py:430)"),
    ([*PP2, "--num-layers", "3"], 2,
     "Number of layers should be divisible by the pipeline-model-parallel size: assert "
     "num_layers % args.transformer_pipeline_model_parallel_size == 0 (arguments.py:963)"),
    # auto plans every stage; only the rectifier still re-plans one model.
    ([*PP2, "--adacc-policy", "auto", "--adacc-memory-budget", "1GiB", "--adacc-tracking",
      "backoff"], 2,
     "--adacc-tracking backoff does not run with pipeline stages yet (the rectifier re-plans "
     "one model, not a plan per stage); use --adacc-tracking off with "
     "--pipeline-model-parallel-size 2"),
])
def test_bad_pipeline_flags_are_refused_in_one_line(flags, world, message, monkeypatch, capsys):
    import pretrain_gpt

    # Refused before the process group starts: the world size is torchrun's variable.
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert pretrain_gpt.main([*TINY, *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"pretrain_gpt.py: error: {message}"
