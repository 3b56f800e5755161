"""pretrain_gpt.py end to end on the CPU, through Megatron-LM's loop: resume, parallelism,
megatron's recompute baselines, metrics and the one-line errors users see."""
import gzip
import json
import math

import pytest
import torch

from megatron_adacc.launch import latest_checkpoint

from helpers import forked
from helpers.pretrain import LLAMA_FLAGS, ROOT, TINY, child_env, losses, pretrain, train


def test_metrics_record_every_iteration_with_full_precision(tmp_path):
    metrics = tmp_path / "m.jsonl"
    records = train("--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
                    "--metrics-file", str(metrics))
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["iteration"] for line in lines] == [1, 2, 3, 4]
    for line in lines:
        assert {"iteration", "loss", "lr", "step_time_s", "tokens_per_s", "grad_norm"} <= set(line)
    assert [("val_loss" in line) for line in lines] == [False, True, False, True]
    assert [line["loss"] for line in lines] == losses(records)  # no rounding on the way out


def test_a_session_keeps_its_newest_records_and_the_file_every_one(monkeypatch, tmp_path):
    # A session once kept every record in memory: 1.5 KB an iteration for the run's life.
    from megatron_adacc import megatron_lm

    monkeypatch.setattr(megatron_lm, "RECORDS_KEPT", 2)
    metrics = tmp_path / "m.jsonl"
    records = train("--train-iters", "7", "--metrics-file", str(metrics))
    assert [r["iteration"] for r in records] == [4, 5, 6, 7]   # cut to the newest 2 at 5
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["iteration"] for line in lines] == list(range(1, 8))


def test_megatron_lms_dataset_flags_reach_the_dataset_config(monkeypatch, tmp_path):
    # pretrain_gpt.py's provider once passed a dozen of them on, and dropped the rest.
    from megatron.core.datasets import blended_megatron_dataset_builder as builder

    configs, build = [], builder.BlendedMegatronDatasetBuilder.__init__

    def kept(self, cls, sizes, is_built_on_rank, config, *args, **kwargs):
        configs.append(config)
        build(self, cls, sizes, is_built_on_rank, config, *args, **kwargs)

    monkeypatch.setattr(builder.BlendedMegatronDatasetBuilder, "__init__", kept)
    train("--train-iters", "1", "--num-dataset-builder-threads", "2", "--data-cache-path",
          str(tmp_path), "--allow-ambiguous-pad-tokens", "--no-mmap-bin-files")
    (config,) = configs
    assert (config.num_dataset_builder_threads, config.path_to_cache,
            config.allow_ambiguous_pad_tokens, config.mmap_bin_files) == (2, str(tmp_path),
                                                                          True, False)


def test_adacc_times_forward_and_backward_and_not_the_optimizer_step(monkeypatch):
    """What the step watch compares with a plan's prediction is what the profile predicts: the
    micro-batches' forward and backward. The optimizer step runs outside Adacc.measure."""
    import contextlib

    from megatron_adacc.adacc import Adacc

    measure, events = Adacc.measure, []

    @contextlib.contextmanager
    def noted(self, enabled=True):
        events.append("measure")
        with measure(self, enabled) as ruler:
            yield ruler
        events.append("measured")

    def step(original):
        def stepped(self, *args, **kwargs):
            events.append("optimizer step")
            return original(self, *args, **kwargs)
        return stepped

    monkeypatch.setattr(Adacc, "measure", noted)
    for optimizer in (torch.optim.Adam, torch.optim.AdamW):
        if "step" in vars(optimizer):  # AdamW may take Adam's
            monkeypatch.setattr(optimizer, "step", step(optimizer.step))
    session = pretrain("--adacc-policy", "full-recompute", "--train-iters", "3")
    assert events == ["measure", "measured", "optimizer step"] * 3
    assert all(r["measured_step_time_s"] < r["step_time_s"] for r in session.records[1:])


def test_on_a_gpu_the_forward_and_backward_peak_is_read_without_waiting(monkeypatch):
    """The record keeps the allocator's peak at the end of forward and backward beside the
    step's, so the optimizer step's share shows; the host counts it, no sync is needed."""
    import contextlib
    from types import SimpleNamespace

    from megatron_adacc import megatron_lm

    session = megatron_lm.Session.__new__(megatron_lm.Session)
    session.device = torch.device("cuda")
    session.adacc = SimpleNamespace(measure=lambda ruled: contextlib.nullcontext())
    reads = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device: reads.append(device) or 7 << 20)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: pytest.fail("synchronised"))
    assert session._measured(lambda value: value + 1, False, 1) == 2
    assert session.forward_backward_peak == 7 << 20 and reads == [torch.device("cuda")]


def test_profile_traces_the_steps_megatron_lm_names(tmp_path):
    """--profile-step-start 1 --profile-step-end 3: iterations 1 and 2, one trace for the rank
    (Megatron-LM writes it gzipped beside --tensorboard-dir, in torch_profile/), after the
    warm-up step Megatron-LM's schedule has (before iteration 1: none here)."""
    train("--train-iters", "4", "--profile", "--use-pytorch-profiler", "--profile-step-start",
          "1", "--profile-step-end", "3", "--tensorboard-dir", str(tmp_path / "tb"))
    traces = list((tmp_path / "torch_profile").glob("rank-0*.json.gz"))
    assert len(traces) == 1
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#1", "ProfilerStep#2"}
    assert any(e.get("name") == "aten::mm" for e in events)


AUTO = ("--adacc-policy", "auto", "--adacc-memory-budget", "1GiB")


def test_timing_log_level_2_times_the_loops_steps_not_the_profilers():
    # The profiler ends a forward past the layer it measures, inside Megatron-LM's
    # forward_step: its forward timer was left running, and the next step asserted.
    records = train("--train-iters", "3", "--timing-log-level", "2", *AUTO)
    assert [r["iteration"] for r in records] == [1, 2, 3]


def test_log_params_norm_logs_the_norm_of_the_trained_parameters(capsys):
    session = pretrain("--train-iters", "2", "--log-interval", "1", "--log-params-norm", *AUTO)
    logged = [float(part.split(":")[1]) for line in capsys.readouterr().out.splitlines()
              for part in line.split("|") if part.strip().startswith("params norm:")]
    norm = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.float()) for p in session.model.parameters()]))
    assert len(logged) == 2 and logged[-1] == pytest.approx(float(norm), abs=1e-3)


def test_resume_reproduces_uninterrupted_losses_bit_for_bit(tmp_path):
    common = ("--train-iters", "6", "--hidden-dropout", "0.1", "--attention-dropout", "0.1")
    straight = losses(train(*common))
    ckpt = str(tmp_path / "ckpt")
    first = losses(train(*common, "--save", ckpt, "--save-interval", "3",
                         "--exit-interval", "3"))
    assert latest_checkpoint(ckpt) == 3
    rest = losses(train(*common, "--load", ckpt))
    assert first + rest == straight


@pytest.fixture
def guard_swaps(monkeypatch):
    """The profile prices outlier_int4 near nothing, so a first auto plan uses it on any CPU.

    With a guard threshold below any int4 error, tracking then takes it away: a swap. Priced
    as measured, a loaded machine's first plan could avoid outlier_int4, and the guard then
    had nothing to swap."""
    from dataclasses import replace

    from megatron_adacc.profiling import profiler

    measured = profiler.profile

    def outlier_int4_cheap(*args, **kwargs):
        costs = measured(*args, **kwargs)
        return replace(costs, sites=[replace(site, codecs=tuple(
            replace(codec, encode_s=codec.encode_s / 100, decode_s=codec.decode_s / 100)
            if codec.codec == "outlier_int4" else codec for codec in site.codecs))
            for site in costs.sites])

    monkeypatch.setattr(profiler, "profile", outlier_int4_cheap)


@pytest.mark.parametrize("saves", [
    ["--save-interval", "3"],
    # Megatron-LM's own record of the loaded iteration names the persistent checkpoint (none
    # here): tracking's state was neither written with a non-persistent save nor read.
    ["--save-interval", "100", "--non-persistent-save-interval", "1",
     "--non-persistent-ckpt-type", "global"],
], ids=["persistent", "non-persistent"])
def test_auto_resumes_the_plan_tracking_chose_and_the_losses_bit_for_bit(
        tmp_path, saves, guard_swaps):
    """A guard threshold below any int4 error makes tracking swap plans at iteration 1
    (guard_swaps). A run resumed at 3 runs that plan, as the uninterrupted run does; it used to
    start again from the first plan and swap at 4. (The step watch decides on step times:
    off.)"""
    import pretrain_gpt

    from megatron_adacc import megatron_lm

    def run(*flags):
        assert pretrain_gpt.main([
            "--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--log-interval", "1000",
            "--train-iters", "6", "--lr-warmup-iters", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--adacc-policy", "auto", "--adacc-memory-budget",
            "17MiB", "--adacc-guard-threshold", "0.000001", "--adacc-step-watch", "off",
            "--adacc-profile-repeats", "1", "--adacc-profile-db",
            str(tmp_path / "profiles.sqlite"), *flags]) == 0
        return megatron_lm.session().records

    straight = run()
    ck = str(tmp_path / "ck")
    first = run("--save", ck, *saves, "--exit-interval", "3")
    rest = run("--load", ck, *saves[2:])
    plans = [r["plan_id"] for r in straight]
    assert plans[2] != plans[0]  # the plan in force at the save is tracking's, not the first
    assert [r["plan_id"] for r in first + rest] == plans
    assert losses(first + rest) == losses(straight)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    import pretrain_gpt

    ckpt = str(tmp_path / "ckpt")
    train("--train-iters", "2", "--save", ckpt, "--save-interval", "1", "--exit-interval", "1")
    assert latest_checkpoint(ckpt) == 1

    real_save = torch.save

    def dying_save(obj, path, *a, **k):
        real_save({"partial": True}, path)
        raise KeyboardInterrupt("killed during save")

    monkeypatch.setattr(torch, "save", dying_save)
    status = pretrain_gpt.main([*TINY, "--train-iters", "2", "--load", ckpt, "--save", ckpt,
                                "--save-interval", "1"])
    monkeypatch.undo()
    assert status == 130
    assert latest_checkpoint(ckpt) == 1
    resumed = losses(train("--train-iters", "2", "--load", ckpt))
    straight = losses(train("--train-iters", "2"))
    assert resumed == straight[1:]


# Megatron-LM requires a --recompute-method (and its --recompute-num-layers) with full.
@pytest.mark.parametrize("recompute", [
    ["--recompute-granularity", "full", "--recompute-method", "uniform",
     "--recompute-num-layers", "1"],
    ["--recompute-granularity", "full", "--recompute-method", "block",
     "--recompute-num-layers", "1"],
    ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"],
    ["--recompute-granularity", "selective", "--recompute-modules", "layernorm", "core_attn"],
])
def test_megatron_recompute_is_bitwise_identical_to_no_recompute(recompute):
    common = ("--train-iters", "5", "--hidden-dropout", "0.1", "--attention-dropout", "0.1")
    assert losses(train(*common, *recompute)) == losses(train(*common))


def test_auto_profiles_with_the_repeats_asked_for(tmp_path):
    for repeats in (1, 2):
        session = pretrain("--train-iters", "1", "--adacc-policy", "auto",
                           "--adacc-memory-budget", "1GiB", "--adacc-profile-repeats",
                           str(repeats), "--adacc-profile-db", str(tmp_path / f"{repeats}.db"))
        assert session.adacc.costs.meta["repeats"] == repeats


def test_bytes_the_process_holds_beside_the_engine_count_as_static(monkeypatch):
    # On the H200 a process that had trained before held 64 MiB of cuBLAS workspaces, and every
    # plan peaked by them over its prediction. Each byte allocated beyond the engine and the
    # batch when Adacc sets up counts once (1 TiB is above whatever they hold).
    from megatron_adacc.profiling import allocator, engine_memory

    static = {}
    for extra in (0, 64 << 20):
        monkeypatch.setattr(allocator, "allocated", lambda device, extra=extra: (1 << 40) + extra)
        session = pretrain("--train-iters", "1")
        engine = engine_memory.engine_static_bytes(session.ddp_models, session.optimizer)
        static[extra] = session.adacc.static_bytes
        assert session.rank_static_bytes == static[extra] > engine
    assert static[64 << 20] - static[0] == 64 << 20


def test_the_bytes_a_record_reads_are_of_the_plan_it_predicts_for(guard_swaps):
    # The ruler measured every 50th step: after tracking swapped plans, the log set the last
    # plan's measured bytes beside the new plan's prediction, which read as a misprediction.
    import pretrain_gpt

    from megatron_adacc import megatron_lm

    # a guard threshold below any int4 error swaps plans (guard_swaps)
    assert pretrain_gpt.main([
        "--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--log-interval", "1000",
        "--train-iters", "5", "--lr-warmup-iters", "1", "--adacc-policy", "auto",
        "--adacc-memory-budget", "17MiB", "--adacc-guard-threshold", "0.000001",
        "--adacc-step-watch", "off", "--adacc-profile-repeats", "1"]) == 0
    records = megatron_lm.session().records
    plans = [r["plan_id"] for r in records]
    assert len(set(plans)) > 1  # tracking swapped
    assert [r["activation_measured"] for r in records] == [
        i == 0 or plans[i] != plans[i - 1] for i in range(len(plans))]
    assert all(r["activation_bytes"] == r["predicted_activation_bytes"] for r in records)


def test_strict_auto_takes_a_zero_centred_norms_weight_plus_one():
    # Llama-3's script norms with --apply-layernorm-1p; the torch norm saves weight + 1, a
    # vector of parameters alone, which strict attribution refused as an unknown activation.
    records = train(*LLAMA_FLAGS, "--apply-layernorm-1p", "--train-iters", "2",
                    "--adacc-policy", "auto", "--adacc-memory-budget", "64MiB",
                    "--adacc-strict")
    assert [r["iteration"] for r in records] == [1, 2]
    assert records[0]["activation_bytes"] == records[0]["predicted_activation_bytes"]


def test_auto_tracks_sites_megatrons_selective_recompute_frees():
    # The rectifier's samples shared the storage of the norms' outputs, which Megatron's
    # selective recompute frees after its forward-only sampling step: the native codec read freed
    # memory and the process died (SIGSEGV) at the first tracking iteration.
    records = train("--train-iters", "3", "--adacc-policy", "auto", "--adacc-memory-budget",
                    "6MiB", "--adacc-step-watch", "off", "--recompute-granularity", "selective",
                    "--recompute-modules", "layernorm", "core_attn")
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert records[0]["activation_bytes"] == records[0]["predicted_activation_bytes"]


def test_selective_mlp_recompute_without_bias_is_identical():
    common = ("--train-iters", "5", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
              "--disable-bias-linear")
    recompute = ("--recompute-granularity", "selective", "--recompute-modules", "mlp")
    assert losses(train(*common, *recompute)) == losses(train(*common))


def _torchrun(tmp_path, name, *flags):
    metrics = tmp_path / f"{name}.jsonl"
    # CUDA_DEVICE_MAX_CONNECTIONS: Megatron-LM asks for it at TP > 1, as its scripts export.
    done = forked.torchrun(2, [ROOT / "pretrain_gpt.py", *TINY, *flags, "--metrics-file",
                               metrics], cwd=tmp_path,
                           env=child_env(CUDA_DEVICE_MAX_CONNECTIONS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


# Megatron pads the vocabulary to a multiple of divisible-by x TP; 256 keeps it equal.
PARALLEL = ("--train-iters", "5", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--make-vocab-size-divisible-by", "256")


def test_tensor_parallel_matches_a_single_process(tmp_path):
    single = losses(train(*PARALLEL))
    tp2 = _torchrun(tmp_path, "tp2", *PARALLEL, "--tensor-model-parallel-size", "2")
    assert len(tp2) == 5
    assert max(abs(a - b) for a, b in zip(tp2, single)) < 1e-4


def test_data_parallel_matches_a_single_process(tmp_path):
    single = losses(train(*PARALLEL))
    dp2 = _torchrun(tmp_path, "dp2", *PARALLEL)
    assert len(dp2) == 5
    assert max(abs(a - b) for a, b in zip(dp2, single)) < 1e-4


def test_a_virtual_pipeline_without_a_policy_trains_every_iteration(tmp_path):
    # Two model chunks a rank: Megatron-LM's layer runs them, without Adacc's ruler. (Its
    # pipeline stages initialise from seeds of their own: no single process to compare with.)
    virtual = _torchrun(tmp_path, "vpp", *PARALLEL, "--num-layers", "4",
                        "--pipeline-model-parallel-size", "2",
                        "--num-layers-per-virtual-pipeline-stage", "1")
    assert len(virtual) == 5 and all(math.isfinite(loss) for loss in virtual)
    assert virtual[-1] < virtual[0]


def test_without_a_policy_the_layer_is_megatron_lms_for_every_flag():
    # Adacc's dense layer spec stood in for Megatron-LM's and dropped --qk-layernorm silently.
    layers = pretrain("--train-iters", "1", "--qk-layernorm").model.decoder.layers
    assert all(isinstance(layer.self_attention.q_layernorm, torch.nn.LayerNorm)
               and isinstance(layer.self_attention.k_layernorm, torch.nn.LayerNorm)
               for layer in layers)


def test_yarn_positions_train_on_a_cpu():
    # YaRN's frequency tables went to CUDA at the first forward (megatron_compat's shim).
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding)

    session = pretrain("--train-iters", "2", "--position-embedding-type", "yarn")
    assert isinstance(session.model.rotary_pos_emb, YarnRotaryEmbedding)
    assert all(math.isfinite(record["loss"]) for record in session.records)


_LLAMA_YARN = [flag if flag != "rope" else "yarn" for flag in LLAMA_FLAGS]


@pytest.mark.parametrize("flags, budget", [(_LLAMA_YARN, "2.9MiB"),
                                           (["--position-embedding-type", "none"], "2.5MiB")],
                         ids=["llama-yarn", "gpt-none"])
def test_auto_plans_other_positions_and_keeps_the_bytes_it_predicts(flags, budget):
    # The planner's model knew rope and learned positions only: the profile ended in a
    # ValueError traceback. YaRN saves what RoPE saves; no positions save nothing.
    session = pretrain(*flags, "--train-iters", "2", "--adacc-policy", "auto",
                       "--adacc-memory-budget", budget, "--adacc-strict", "--adacc-tracking", "off")
    # the budget is below all-retain's peak: the plan compresses or recomputes (which, the
    # profile's timings decide)
    assert any(layer.actions for layer in session.model.decoder.layers)
    assert [r["activation_bytes"] for r in session.records] == [
        r["predicted_activation_bytes"] for r in session.records]


def test_the_flash_backend_reaches_every_layer_of_an_experts_block():
    # Megatron-LM's spec for experts is a block's, one spec per layer.
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_adacc.models.flash_attention import FlashDotProductAttention

    layers = pretrain("--train-iters", "1", "--num-experts", "2", "--disable-bias-linear",
                      "--attention-backend", "flash", "--attention-dropout", "0",
                      "--hidden-dropout", "0").model.decoder.layers
    assert len(layers) == 2
    assert all(isinstance(layer.mlp, MoELayer) and isinstance(
        layer.self_attention.core_attention, FlashDotProductAttention) for layer in layers)


def test_auto_refuses_a_virtual_pipeline_in_one_line(tmp_path):
    done = forked.torchrun(2, [ROOT / "pretrain_gpt.py", *TINY, "--train-iters", "2",
                               "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                               "--num-layers-per-virtual-pipeline-stage", "1",
                               "--adacc-policy", "auto", "--adacc-memory-budget", "1GiB"],
                           cwd=tmp_path, env=child_env())
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "pretrain_gpt.py: error: --adacc-policy auto plans one model chunk per rank; drop "
        "--num-layers-per-virtual-pipeline-stage")


# Megatron-LM's own checks word the last two (its validate_args assertions).
@pytest.mark.parametrize("flags, config, message", [
    ([], {"num-layers": 2, "hidden-sise": 64}, "unknown key 'hidden-sise'"),
    (["--data-path", "/nonexistent/corpus"], None, "/nonexistent/corpus.bin/.idx not found"),
    (["--hidden-size", "100", "--num-attention-heads", "3"], None,
     "assert args.hidden_size % args.num_attention_heads == 0"),
    (["--tensor-model-parallel-size", "2"], None,
     "world size (1) is not divisible by total_model_size"),
])
def test_bad_input_is_one_line_and_non_zero(tmp_path, flags, config, message):
    if config is not None:
        path = tmp_path / "bad.yaml"
        path.write_text(json.dumps(config))
        flags = ["--config", str(path), *flags]
    else:
        flags = [*TINY, *flags]
    done = forked.run([ROOT / "pretrain_gpt.py", *flags], cwd=tmp_path, env=child_env())
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_preprocess_data_round_trips_bytes(tmp_path):
    # Byte-level tokens are the text's UTF-8 bytes, then the end-of-document token: decoded
    # here without any tokenizer library.
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_adacc.corpus import ByteTokenizer

    docs = ["In the beginning God created the heaven and the earth.", "Jesus wept. ünïcödé ok"]
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    done = forked.run([ROOT / "scripts" / "preprocess_data.py", "--input", source,
                       "--output-prefix", tmp_path / "out", "--tokenizer-type", "ByteLevel"],
                      cwd=tmp_path, env=child_env())
    assert done.returncode == 0, done.stderr
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    decoded = [bytes(dataset[i].tolist()[:-1]).decode() for i in range(len(dataset))]
    assert decoded == docs
    assert all(dataset[i][-1] == ByteTokenizer().eod for i in range(len(dataset)))


@pytest.mark.parametrize("rerun", [True, False], ids=["rerun-iterator", "plain-iterator"])
def test_a_long_run_peeks_every_first_micro_batch_in_order(rerun, monkeypatch):
    """Each step's first micro-batch is kept and put back: 3,000 steps stay in order.

    The put-back once nested a generator a step: past about 1,000 iterations a run ended in a
    RecursionError traceback."""
    import types

    from megatron.core import rerun_state_machine
    from megatron.core.rerun_state_machine import RerunDataIterator, RerunMode

    from megatron_adacc.megatron_lm import Session

    # No global state machine: Megatron-LM's next run in this process would find it set up.
    machine = types.SimpleNamespace(get_mode=lambda: RerunMode.DISABLED)
    monkeypatch.setattr(rerun_state_machine, "get_rerun_state_machine", lambda: machine)

    loader = iter(range(10**6))
    given = RerunDataIterator(loader) if rerun else loader    # what Megatron-LM passes each step
    session = types.SimpleNamespace(step_batch=None)
    taken = []
    for step in range(3000):
        iterator = Session._keep_first(session, given)
        assert session.step_batch == 2 * step
        taken += [next(iterator), next(iterator)]    # two micro-batches a step
    assert taken == list(range(6000))


def test_the_step_batch_reaches_the_device_only_on_the_steps_that_read_it(monkeypatch):
    # Moving it (and sharing it over tensor parallelism) waits for the device: it once ran
    # every step, for a rectifier that samples at iterations 1, 2, 4, 8, ...
    from megatron_adacc import megatron_lm

    moved, real = [], megatron_lm.batch_tuple

    def batch_tuple(batch, model):
        moved.append(megatron_lm.session().args.curr_iteration)   # the iterations done
        return real(batch, model)

    monkeypatch.setattr(megatron_lm, "batch_tuple", batch_tuple)
    train("--train-iters", "10", "--adacc-policy", "auto", "--adacc-memory-budget", "1GiB",
          "--adacc-step-watch", "off")
    assert moved == [0, 0, 1, 3, 7]   # set-up, then after iterations 1, 2, 4 and 8


def test_a_loss_on_the_device_is_read_a_step_later_and_every_record_written(monkeypatch,
                                                                           tmp_path):
    # Reading it in its own step made every step wait for the device; a host loss (this CPU's)
    # is read at once. Here host losses stand in for device ones.
    from megatron_adacc import megatron_lm

    events = []

    class Late(megatron_lm._LateFloat):
        def __init__(self, tensor):
            self.value, self.index = float(tensor), sum(e[0] == "made" for e in events)
            events.append(("made", self.index))

        def __float__(self):
            events.append(("read", self.index))
            return self.value

    reference = losses(train("--train-iters", "4"))
    monkeypatch.setattr(megatron_lm, "_late_float", Late)
    metrics = tmp_path / "m.jsonl"
    records = train("--train-iters", "4", "--metrics-file", str(metrics))
    assert events == [("made", 0), ("made", 1), ("read", 0), ("made", 2), ("read", 1),
                      ("made", 3), ("read", 2), ("read", 3)]     # the last at the run's end
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["iteration"] for line in lines] == [1, 2, 3, 4]
    assert [line["loss"] for line in lines] == losses(records) == reference
