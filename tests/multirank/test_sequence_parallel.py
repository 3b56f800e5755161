"""Sequence parallelism at TP=2 (gloo on CPU), on the Llama family's tiny config.

Megatron's sequence parallelism shards the norms, the dropouts and the residual stream along
the sequence: training is the same arithmetic (losses bitwise those of TP=2 without it), and
every site Adacc plans is one rank's. This file launches itself under torchrun with two
processes, which measure and then run pretrain_gpt.py with and without it.
"""
import json

import pytest

from helpers import ROOT, forked
from helpers.pretrain import child_env

CONFIG = ROOT / "configs" / "llama-tiny-cpu.yaml"
VERDICT = "SP_VERDICT "
TP2 = ["--tensor-model-parallel-size", "2"]
RUN = ["--config", str(CONFIG), *TP2, "--train-iters", "3", "--lr-warmup-iters", "1",
       "--eval-interval", "1000", "--eval-iters", "0", "--log-interval", "1",
       "--micro-batch-size", "2", "--global-batch-size", "2", "--seq-length", "64",
       "--max-position-embeddings", "64", "--num-workers", "0"]


def _torchrun(*argv, timeout=600):
    # CUDA_DEVICE_MAX_CONNECTIONS: Megatron-LM asks for it at TP > 1, as its scripts export.
    # child_env's PYTHONPATH: this file, run as a script, imports the checkout and helpers.
    env = child_env(PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1")
    done = forked.torchrun(2, argv, cwd=ROOT, env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _rank_main() -> None:
    import warnings
    from dataclasses import replace

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from megatron_adacc.codecs.codec import Codec
    from megatron_adacc.common.sites import SHARED_SITES
    from megatron_adacc.planning import analytic
    import pretrain_gpt
    from megatron_adacc import megatron_lm
    from megatron_adacc.megatron_lm import batch_tuple
    from megatron_adacc.models.build import gpt_loss
    from megatron_adacc.planning import default_resolution, minimum_budget, plan
    from megatron_adacc.policies import predicted_activation_bytes
    from megatron_adacc.profiling.profiler import profile
    from megatron_adacc.runtime import apply_plan, measure_step
    from helpers.runtime import touch_fresh_pages

    # The model and first micro-batch Megatron-LM's loop builds from the flags (one step
    # under Adacc's layer); the process group is this script's, so the model-parallel state
    # outlives the run.
    dist.init_process_group("gloo")
    status = pretrain_gpt.main(RUN + ["--sequence-parallel", "--train-iters", "1",
                                      "--lr-warmup-iters", "0",
                                      "--adacc-policy", "full-recompute"])
    assert status == 0, status
    session = megatron_lm.session()
    args, model = session.args, session.model
    batch = batch_tuple(session.step_batch, model)

    def loss():
        return gpt_loss(model, *batch)

    apply_plan(model, None, strict=True)
    _, retained = measure_step(model, loss, strict=True)
    # Every rank plans from rank 0's costs (as Adacc does): a recompute that re-runs the
    # sequence-parallel gather must run on both ranks.
    box = [profile(model, batch, repeats=1, strict=True)]
    dist.broadcast_object_list(box, src=0)
    costs = box[0]
    # A timed step in which rank 0's decodes grow its host heap runs again on both ranks: the
    # peers' layers exchange activations in it (rank 0 re-running alone waited for good).
    decode = Codec.decode

    def heap_growing_decode(codec, payload):
        touch_fresh_pages(64)
        return decode(codec, payload)

    if dist.get_rank() == 0:
        Codec.decode = heap_growing_decode
    try:
        regrown = profile(model, batch, repeats=1, strict=True)
    finally:
        Codec.decode = decode
    low = (minimum_budget(costs, allow_lossy_sources=False)
           + costs.num_layers * default_resolution(costs))
    high = plan(costs, 10 * low).references["no optimisation"].peak_bytes
    result = plan(costs, int((low + high) / 2), allow_lossy_sources=False)
    apply_plan(model, result.plan, strict=True)
    _, planned = measure_step(model, loss, strict=True)
    apply_plan(model, None)
    flags = {**vars(args), "tensor-model-parallel-size": 2, "sequence-parallel": True,
             "vocab-size": model.vocab_size, "make-vocab-size-divisible-by": 1,
             "attention_backend": args.attention_backend.name}  # Megatron-LM's is an enum
    # compared with this CPU's measurements: a CPU's kernels
    shape = replace(analytic.ModelShape.from_flags(flags), cuda_kernels=False)
    modelled = analytic.analytic_costs(shape, args.micro_batch_size, "h100-80gb")
    # The training comparison: TP=2 with and without sequence parallelism, three steps each.
    losses = {}
    for name, extra in (("tp", []), ("sp", ["--sequence-parallel"])):
        assert pretrain_gpt.main(RUN + extra) == 0
        losses[name] = [record["loss"] for record in megatron_lm.session().records]
    print(VERDICT + json.dumps({
        "rank": dist.get_rank(),
        "measured_layer0": {site: n for (layer, site), n in retained.by_site.items()
                            if layer == 0 and site not in SHARED_SITES},
        "measured_shared": sum(n for (layer, site), n in retained.by_site.items()
                               if site in SHARED_SITES),
        "analytic_shared": analytic.shared_activation_bytes(shape, args.micro_batch_size),
        "analytic_layer": analytic.site_bytes(shape, args.micro_batch_size),
        "measured_bytes": retained.after_forward_bytes,
        "profiled_bytes": costs.embedding_bytes + costs.non_layer_bytes
        + costs.num_layers * sum(site.bytes for site in costs.sites),
        "analytic_bytes": modelled.embedding_bytes + modelled.non_layer_bytes
        + modelled.num_layers * sum(site.bytes for site in modelled.sites),
        "planned_measured": planned.after_forward_bytes,
        "planned_predicted": predicted_activation_bytes(costs, result),
        "sequence_shard": costs.site("layer_in").bytes,
        "sites": [site.name for site in costs.sites],
        "sites_when_one_rank_grew_its_heap": [site.name for site in regrown.sites],
        "losses": losses,
    }), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _verdicts(stdout: str) -> list[dict]:
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(chunk.lstrip())[0] for chunk in stdout.split(VERDICT)[1:]]


@pytest.fixture(scope="module")
def measured():
    verdicts = _verdicts(_torchrun(__file__))
    assert sorted(v["rank"] for v in verdicts) == [0, 1]
    return verdicts


def test_every_site_is_one_ranks_and_the_analytic_model_says_so(measured):
    for verdict in measured:
        # fp32, micro-batch 2, sequence 64 sharded over 2 ranks: 32 rows of 128 in fp32
        assert verdict["sequence_shard"] == 32 * 2 * 128 * 4
        assert verdict["measured_layer0"] == verdict["analytic_layer"]
        # RoPE's cos and sin, one storage each for the rank: sequence 64 x head dim 32, fp32
        assert verdict["measured_shared"] == verdict["analytic_shared"] == 2 * 64 * 32 * 4


def test_a_step_one_rank_reruns_runs_on_its_peer_too(measured):
    # the second profile returned on both ranks (no rank waited on the other for good)
    for verdict in measured:
        assert verdict["sites_when_one_rank_grew_its_heap"] == verdict["sites"]


def test_ruler_planner_and_analytic_model_agree_within_5_percent(measured):
    for verdict in measured:
        ruler = verdict["measured_bytes"]
        assert abs(verdict["profiled_bytes"] - ruler) <= 0.05 * ruler
        assert abs(verdict["analytic_bytes"] - ruler) <= 0.05 * ruler
        planned = verdict["planned_measured"]
        assert abs(verdict["planned_predicted"] - planned) <= 0.05 * planned


def test_sequence_parallel_losses_equal_tp2_without_it(measured):
    for verdict in measured:
        losses = verdict["losses"]
        assert len(losses["tp"]) == 3 and losses["sp"] == losses["tp"]


if __name__ == "__main__":
    _rank_main()
