"""--use-distributed-optimizer: the AdamW state (and a 16-bit model's fp32 main params)
sharded over the data-parallel group, each rank holding what optimizer.static_bytes says."""
import json
import os
import subprocess
import sys
from pathlib import Path


from megatron_adacc import Adacc, AdaccConfig, hardware
from megatron_adacc import model as model_lib
from megatron_adacc.optimizer import MainParamAdamW, owned_pieces, shard_range, static_bytes
from runtime_helpers import adacc_batch, adacc_model
from test_trainer import TINY

HERE = Path(__file__).resolve().parent


def test_shards_cover_every_element_once_and_rank_0_owns_the_most():
    numels = [7, 1, 12, 5]
    for shards in (1, 2, 3, 8, 40):
        covered = []
        for shard in range(shards):
            offsets = [sum(numels[:i]) for i in range(len(numels))]
            covered += [offsets[i] + k for i, start, end in owned_pieces(numels, shards, shard)
                        for k in range(start, end)]
        assert covered == list(range(sum(numels))), shards
        sizes = [end - start for start, end in (shard_range(25, shards, r) for r in range(shards))]
        assert max(sizes) == sizes[0] == -(-25 // shards)
    # The analytic model's ZeRO-1 shard is the trainer's rank-0 range.
    assert hardware.static_bytes(25, "fp32", zero_stage=1, data_parallel_size=3) == \
        (4 + 4) * 25 + 8 * (shard_range(25, 3, 0)[1] - shard_range(25, 3, 0)[0])


def test_auto_budgets_the_sharded_static_bytes_even_from_a_stored_profile(distributed,
                                                                          tmp_path):
    db = str(tmp_path / "profiles.sqlite")
    found = []
    for shards in (2, 1):  # the second setup reads the profile the first one stored
        adacc = Adacc(AdaccConfig(policy="auto", memory_budget="64MiB", profile_db=db,
                                  tracking="off"))
        model = adacc_model(adacc)
        adacc.setup(model, adacc_batch(), verbose=False, optimizer_shards=shards)
        found.append((adacc.static_bytes, adacc.costs.static_bytes, adacc.result.static_bytes,
                      static_bytes(model, shards)))
    (sharded, *_), (whole, *_) = found
    assert all(len(set(values)) == 1 for values in found), found
    assert sharded < whole


def test_at_one_data_parallel_rank_the_flag_holds_the_state_whole(distributed):
    # Megatron-LM allows --use-distributed-optimizer at DP=1: one shard, the whole state,
    # and checkpoints that load either way.
    from megatron.core import parallel_state

    model = adacc_model(Adacc())
    sharded = MainParamAdamW(model, 1e-3, 0.01, (0.9, 0.999),
                             shard_group=parallel_state.get_data_parallel_group())
    whole = MainParamAdamW(model, 1e-3, 0.01, (0.9, 0.999))
    assert all(a is b is p for a, b, p in zip(sharded.main_params, whole.main_params,
                                            whole.model_params))
    model_lib.gpt_loss(model, *adacc_batch()).backward()
    sharded.clip_and_step(1.0)
    whole.load_state_dict(sharded.state_dict())
    assert static_bytes(model, 1) == static_bytes(model)


def test_sharded_runs_match_whole_ones_bitwise_hold_the_prediction_and_resume(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(HERE / "multirank_distributed_optimizer.py"), str(tmp_path / "ckpt"),
           *TINY, "--train-iters", "5"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads(done.stdout.strip().splitlines()[-1])
    for rank, report in enumerate(ranks):
        for precision in ("fp32", "bf16"):
            run = report[precision]
            print(f"rank {rank} {precision}: held {run['held_sharded']}, predicted "
                  f"{run['predicted_sharded']}; whole {run['held_whole']}")
            # Each element's update is the unsharded arithmetic: bitwise, not just 1e-6.
            assert len(run["sharded"]) == 5 and run["sharded"] == run["whole"]
            assert run["weights_equal"] and run["ranks_agree"]
            assert run["held_whole"]["held"] == run["predicted_whole"]
            assert run["held_sharded"]["held"] == run["predicted_sharded"]
            # The moments (and bf16's main params) of half the elements, plus step counts.
            assert run["held_sharded"]["optimizer_state"] < 0.51 * run["held_whole"]["optimizer_state"]
            assert run["adacc_static_bytes"] == max(r[precision]["predicted_sharded"]
                                                    for r in ranks)
        resume = report["resume"]
        assert resume["resumed"] == resume["straight"]
        assert resume["unsharded_load"] == (
            f"the checkpoint's optimizer state is shard {rank} of 2 "
            "(--use-distributed-optimizer), this run's is whole: resume with the "
            "--use-distributed-optimizer setting and data-parallel size it was saved with "
            "(resharding is not supported)")
