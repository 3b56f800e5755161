"""Retain and recompute stay bitwise exact under tensor parallelism (TP=2, gloo on CPU).

The test launches this same file under torchrun with two processes. Each rank builds the
stock megatron-core model and the Adacc model with tensor parallel size 2, trains both with
dropout 0.1 on identical data and compares its own shards of losses and gradients with
torch.equal. What TP adds over the single-process tests: recompute replays linear_proj's
all-reduce inside backward (both ranks must rebuild at the same point, or gloo deadlocks or
pairs the wrong collectives), and attention dropout draws from the tensor-parallel RNG
tracker, a different stream on each rank, which the rebuild must restore. The flash layer
(SDPA core attention, attention dropout 0 as the CPU's flash kernel needs) runs the same
check with its own sites, on half of the heads per rank.
"""
import pytest
import json
import os
import sys

from helpers import ROOT, forked
from helpers.pretrain import child_env

VERDICT = "TP_VERDICT "
STEPS = 3
# Every segment, both sides of each anchor: ln2_in recomputed in layer 1 is rebuilt by its
# edge after the attention re-run rebuilds its context and mask, linear_proj's all-reduce in
# both; qkv and softmax_out re-draw the attention dropout from the tracker's per-rank stream;
# gelu_in and the bda masks re-draw the hidden dropout from the default stream. The residual
# plan rebuilds ln2_in by its edge alone (linear_proj's all-reduce, the kept mask), the
# norm on it and the MLP re-run from it.
PLANS = {
    "mixed": {
        "sites": {"qkv": "recompute", "softmax_out": "recompute",
                  "attn_dropout_mask": "recompute", "gelu_in": "recompute",
                  "ln2_stats": "recompute", "bda1_mask": "recompute"},
        "layers": {"1": {"sites": {"ln2_in": "recompute", "gelu_out": "recompute",
                                   "context": "recompute", "softmax_out": "retain"}}},
    },
    "mlp_only": {"sites": {"ln2_out": "recompute", "gelu_in": "recompute",
                           "bda2_mask": "recompute"}},
    "residual": {"sites": {"ln2_in": "recompute", "ln2_out": "recompute",
                           "gelu_in": "recompute"}},
}
# The flash layer's attention sites; hidden dropout stays on (its masks, default stream).
FLASH_PLANS = {
    "mixed": {
        "sites": {"qkv": "recompute", "attn_lse": "recompute", "gelu_in": "recompute",
                  "bda1_mask": "recompute"},
        "layers": {"1": {"sites": {"ln2_in": "recompute", "context": "recompute",
                                   "attn_lse": "retain"}}},
    },
    "attention_core": {"sites": {"qkv": "recompute", "attn_lse": "recompute",
                                 "context": "recompute"}},
    "residual": {"sites": {"ln2_in": "recompute", "ln2_out": "recompute"}},
}
# backend -> (attention dropout, plans)
BACKENDS = {"unfused": (0.1, PLANS), "flash": (0.0, FLASH_PLANS)}


def _rank_main(backends: list[str]) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    from megatron_adacc.models import build as model_lib
    from megatron_adacc.common.plan import Plan
    from megatron_adacc.runtime import apply_plan

    from helpers.runtime import build, train

    model_lib.init_distributed(2)
    rank = dist.get_rank()
    for backend in backends:
        failures = []
        attention_dropout, plans = BACKENDS[backend]
        kwargs = dict(dropout=0.1, attention_dropout=attention_dropout, attention_backend=backend)
        stock_losses, stock_grads = train(build(False, **kwargs), STEPS)
        for name, plan in plans.items():
            model = build(True, **kwargs)
            apply_plan(model, Plan.from_dict(plan), strict=True)
            losses, grads = train(model, STEPS)
            for step in range(STEPS):
                if not torch.equal(losses[step], stock_losses[step]):
                    failures.append(f"{name} step {step}: loss {losses[step].item()} != "
                                    f"{stock_losses[step].item()}")
                failures += [f"{name} step {step}: gradient of {param}"
                             for param, grad in grads[step].items()
                             if not torch.equal(grad, stock_grads[step][param])]
        # The shards really differ between ranks (else TP did not split anything).
        weights = dict(build(False).named_parameters())
        qkv = weights["decoder.layers.0.self_attention.linear_qkv.weight"]
        shards = [torch.empty_like(qkv) for _ in range(2)]
        dist.all_gather(shards, qkv.detach().contiguous())
        print(VERDICT + json.dumps({"backend": backend, "rank": rank, "failures": failures,
                                    "qkv_shard": list(qkv.shape),
                                    "shards_differ": not torch.equal(*shards)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def verdicts():
    """Each backend's verdicts from both ranks, from one torchrun launch (a launch's start-up
    is most of its time)."""
    # child_env's PYTHONPATH: this file, run as a script, imports the checkout and helpers.
    env = child_env(PYTHONWARNINGS="ignore")
    result = forked.torchrun(2, [os.path.abspath(__file__), *BACKENDS], cwd=ROOT, env=env,
                             timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The two ranks share one stdout pipe, so their lines can run together: decode each JSON
    # object that follows a marker rather than reading line by line.
    decoder = json.JSONDecoder()
    found = [decoder.raw_decode(chunk.lstrip())[0] for chunk in result.stdout.split(VERDICT)[1:]]
    return {backend: [v for v in found if v["backend"] == backend] for backend in BACKENDS}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_tensor_parallel_two_ranks_match_the_stock_layer_bitwise(verdicts, backend):
    assert sorted(v["rank"] for v in verdicts[backend]) == [0, 1], verdicts
    for verdict in verdicts[backend]:
        assert verdict["failures"] == [], verdict
        assert verdict["qkv_shard"] == [3 * 64 // 2, 64]  # half of the heads on each rank
        assert verdict["shards_differ"]


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
