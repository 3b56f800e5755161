"""Issue 25, through Megatron-LM's loop: every bad input refused before training in one line
naming the flag, field or file, exit 2, nothing written; the Python API refuses at
construction; Ctrl-C ends a run in one line with exit 130."""
import importlib.util
import math
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from megatron_adacc import Adacc, AdaccConfig
from megatron_adacc.common.plan import Plan, PlanError
from megatron_adacc import launch
from helpers import forked
from helpers.pretrain import CORPUS_TINY as TINY, PRETRAIN, child_env, data_flags


def _main(argv):
    spec = importlib.util.spec_from_file_location("pretrain_gpt", PRETRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def refused(capsys, argv) -> str:
    """The one stderr line of a run refused with exit 2 (checked: one line; stdout may hold
    the arguments Megatron-LM's validate_args prints)."""
    assert _main([*TINY, "--train-iters", "2", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    return captured.err.rstrip("\n")


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_help_lists_megatron_lms_flags_and_adaccs_with_exit_0(capsys):
    # One of Megatron-LM 0.19.2's help texts holds a bare "%", which argparse would format.
    assert _main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pretrain_gpt.py")
    assert "Magnitude is headroom (e.g. 1.10 = 10%)." in " ".join(out.split())
    assert "--adacc-memory-budget" in out and "--num-layers" in out


# --- 2. every output path, before training ---------------------------------------------------

@pytest.mark.parametrize("flag, target, message", [
    ("--save", "a_file", "--save {d}/a_file: is a file, not a directory"),
    ("--save", "a_file/ck", "--save {d}/a_file/ck: {d}/a_file is a file, so the directory "
                            "cannot be created"),
    ("--tensorboard-dir", "a_file/tb/run", "--tensorboard-dir {d}/a_file/tb/run: {d}/a_file is "
                                           "a file, so the directory cannot be created"),
    ("--metrics-file", "a_dir", "--metrics-file {d}/a_dir: is a directory, not a file"),
    ("--metrics-file", "a_file/m.jsonl", "--metrics-file {d}/a_file/m.jsonl: {d}/a_file is a "
                                         "file, so the file cannot be created"),
])
def test_an_output_path_that_cannot_be_written_is_refused_before_training(
        tmp_path, capsys, corpus, flag, target, message):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir()
    before = files_under(tmp_path)
    line = refused(capsys, [*data_flags(corpus), flag, str(tmp_path / target)])
    assert line == "pretrain_gpt.py: error: " + message.format(d=tmp_path)
    assert files_under(tmp_path) == before


def test_the_profile_db_auto_writes_is_checked_too(tmp_path, capsys, corpus):
    (tmp_path / "a_file").write_text("x")
    line = refused(capsys, [*data_flags(corpus), "--adacc-policy", "auto",
                            "--adacc-memory-budget", "1GiB", "--adacc-profile-db",
                            str(tmp_path / "a_file" / "p.sqlite")])
    assert line == (f"pretrain_gpt.py: error: --adacc-profile-db {tmp_path}/a_file/p.sqlite: "
                    f"{tmp_path}/a_file is a file, so the file cannot be created")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any directory")
def test_an_unwritable_save_directory_is_refused(tmp_path, capsys, corpus):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        line = refused(capsys, [*data_flags(corpus), "--save", str(locked / "ck")])
    finally:
        locked.chmod(0o700)
    assert line == (f"pretrain_gpt.py: error: --save {locked}/ck: {locked} is not writable, "
                    f"so the directory cannot be created")


# --- 3. configuration refused in one line -----------------------------------------------------

# Megatron-LM's own checks word the first three (its recompute-modules set is unordered).
@pytest.mark.parametrize("flags, message", [
    (["--recompute-granularity", "selective", "--recompute-modules", "bogus"],
     "Invalid choices for recompute_modules: {'bogus'}. Allowed modules are: {"),
    (["--split", "0,0,0"], "--split 0,0,0: expected up to three weights >= 0, the first > 0"),
    (["--seed", "0"], "--seed 0: Megatron-LM seeds with a positive integer"),  # a ValueError
    (["--init-model-with-meta-device"], "--init-model-with-meta-device leaves the weights "
     "uninitialised without an FSDP wrapper (--use-megatron-fsdp, --use-torch-fsdp2); drop it"),
    (["--split", "abc"], "--split abc: expected up to three weights >= 0, the first > 0"),
    (["--profile", "--use-pytorch-profiler"],
     "--use-pytorch-profiler writes its traces to --tensorboard-dir; give one"),
    (["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "tb", "--profile-step-start",
      "5", "--profile-step-end", "5"], "--profile-step-end 5 must be after --profile-step-start 5"),
    (["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "tb", "--profile-ranks", "0",
      "3"], "--profile-ranks 3: no such rank in a world of 1"),
])
def test_bad_megatron_flags_are_refused_in_one_line(capsys, corpus, flags, message):
    assert refused(capsys, [*data_flags(corpus), *flags]).startswith(
        f"pretrain_gpt.py: error: {message}")


def test_auto_under_megatrons_full_recompute_is_refused_in_one_line(capsys, corpus):
    # The profile saw only each layer's input, and planning died in a traceback.
    line = refused(capsys, [*data_flags(corpus), "--adacc-policy", "auto",
                            "--adacc-memory-budget", "1GiB", "--recompute-granularity", "full",
                            "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    assert line == ("pretrain_gpt.py: error: --recompute-granularity full keeps only each "
                    "layer's input, which leaves --adacc-policy auto nothing to plan; drop it "
                    "(auto's plans include full recompute)")


# Adacc's layer, built in their place, trained a dense layer without them (the first five) or
# met saves it has no site for (quick-geglu). Without a policy Megatron-LM's layer has them.
@pytest.mark.parametrize("flags, builds", [
    (["--num-experts", "4", "--disable-bias-linear"], "--num-experts 4 builds a "
     "mixture-of-experts MLP"),
    (["--qk-layernorm"], "--qk-layernorm builds norms on the queries and keys"),
    (["--multi-latent-attention"], "--multi-latent-attention builds multi-latent attention"),
    (["--softmax-type", "learnable"], "--softmax-type learnable builds a softmax with an offset"),
    (["--window-size", "16,0"], "--window-size 16,0 builds sliding-window attention"),
    (["--quick-geglu"], "--quick-geglu builds another MLP activation"),
])
def test_a_layer_no_family_describes_is_refused_under_a_policy(capsys, corpus, flags, builds):
    line = refused(capsys, [*data_flags(corpus), *flags, "--adacc-policy", "quantize"])
    assert line == (f"pretrain_gpt.py: error: --adacc-policy quantize: {builds}, and Adacc's "
                    f"layer knows the dense GPT and Llama layers only; without a policy "
                    f"(--adacc-policy none) Megatron-LM trains it as it is")


def test_codec_kernels_this_machine_cannot_run_are_refused_in_one_line(capsys, corpus,
                                                                       monkeypatch):
    # The first encode raised a RuntimeError traceback, after the model was built and profiled.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    flags = [*data_flags(corpus), "--adacc-policy", "quantize"]
    assert refused(capsys, [*flags, "--adacc-codec-backend", "triton"]) == (
        "pretrain_gpt.py: error: --adacc-codec-backend triton: codec backend 'triton' needs a "
        "CUDA tensor (got cpu) or TRITON_INTERPRET=1 set before triton is imported; auto "
        "picks kernels that run here")
    monkeypatch.setenv("ADACC_CODEC_BACKEND", "cuda")
    assert refused(capsys, flags) == (
        "pretrain_gpt.py: error: $ADACC_CODEC_BACKEND: unknown codec backend 'cuda'; expected "
        "one of ('auto', 'torch', 'native', 'triton')")


def test_experts_under_tensor_parallelism_alone_are_refused_in_one_line(monkeypatch):
    # megatron-core raised a ValueError traceback in the first training forward, on every rank.
    from megatron_adacc import megatron_lm
    from helpers.pretrain import parse

    monkeypatch.setenv("WORLD_SIZE", "1")
    args = parse("--num-experts", "4", "--disable-bias-linear")
    args.tensor_model_parallel_size = 2  # as two ranks' flags would leave it
    with pytest.raises(megatron_lm.ConfigError) as info:
        megatron_lm.check_args(args)
    assert str(info.value) == ("--num-experts with --tensor-model-parallel-size 2 trains only "
                               "under --sequence-parallel in megatron-core 0.19.2; add it")


def test_multi_latent_attention_on_the_local_spec_is_refused_in_one_line(capsys, corpus):
    # megatron-core's MLA failed the model build with a TypeError from the local core attention.
    assert refused(capsys, [*data_flags(corpus), "--multi-latent-attention",
                            "--position-embedding-type", "rope"]) == (
        "pretrain_gpt.py: error: --multi-latent-attention builds only on Transformer Engine's "
        "spec in megatron-core 0.19.2 (its local core attention takes no k_channels); drop "
        "--transformer-impl local")


def test_experts_with_biases_are_refused_in_one_line(capsys, corpus):
    # megatron-core's local experts failed in the first forward with an autograd RuntimeError.
    assert refused(capsys, [*data_flags(corpus), "--num-experts", "4"]) == (
        "pretrain_gpt.py: error: --num-experts 4 with biased linear layers fails in "
        "megatron-core 0.19.2's local experts; add --disable-bias-linear")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs them")
@pytest.mark.parametrize("flags, needs", [
    (["--log-memory-to-tensorboard"], "reads the GPU's memory"),   # a KeyError in the log
    (["--log-device-memory-used"], "reads the GPU's memory"),      # an AttributeError
    (["--record-memory-history"], "reads the GPU's memory"),       # CUDA's init
    (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"],  # CUDA's init
     "shards over a CUDA device mesh"),
    (["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"], "shards over a CUDA device mesh"),
    (["--cuda-graph-impl", "local"], "captures CUDA graphs"),      # a CUDA stream's init
    (["--check-weight-hash-across-dp-replicas-interval", "1"],     # Tensor.cuda()
     "gathers weights' hashes on the GPU"),
    (["--moe-grouped-gemm"], "runs the experts' grouped GEMMs on the GPU"),  # CUDA's init
    (["--moe-shared-expert-overlap"], "overlaps the shared experts on a CUDA stream"),
])
def test_flags_only_a_gpu_runs_are_refused_without_one(capsys, corpus, flags, needs):
    flag = flags[0] if len(flags) == 1 or flags[1].startswith("--") else " ".join(flags[:2])
    assert refused(capsys, [*data_flags(corpus), *flags]) == (
        f"pretrain_gpt.py: error: {flag} {needs}, and this machine has no GPU; drop it")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs them")
def test_an_asynchronous_save_from_a_persistent_worker_is_refused_without_a_gpu(capsys, corpus,
                                                                               tmp_path):
    # Its worker process divided by the GPU count, 0, and the run hung waiting for it.
    assert refused(capsys, [*data_flags(corpus), "--save", str(tmp_path), "--async-save",
                            "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]) == (
        "pretrain_gpt.py: error: --async-save --use-persistent-ckpt-worker saves from a worker "
        "process on a GPU, and this machine has no GPU; drop them")


# Each ended in a traceback: megatron-core checks them with a ValueError, in its optimizer's
# config, by an ImportError while building the optimizer, or in the first forward.
@pytest.mark.parametrize("flags, message", [
    pytest.param(["--fp4-format", "e2m1"], "--fp4-format requires Transformer Engine >= "
                 "2.7.0.dev0 for NVFP4BlockScaling support.",
                 marks=pytest.mark.skipif(importlib.util.find_spec("transformer_engine")
                                          is not None, reason="installed")),
    (["--use-precision-aware-optimizer"],
     "--use-precision-aware-optimizer only supported with distributed optimizer"),
    pytest.param(["--optimizer", "muon"], "--optimizer muon needs the emerging-optimizers "
                 "package, which is not installed (pip install emerging-optimizers)",
                 marks=pytest.mark.skipif(importlib.util.find_spec("emerging_optimizers")
                                          is not None, reason="installed")),
    pytest.param(["--enable-ft-package"], "--enable-ft-package needs the nvidia-resiliency-ext "
                 "package, which is not installed (pip install nvidia-resiliency-ext)",
                 marks=pytest.mark.skipif(importlib.util.find_spec("nvidia_resiliency_ext")
                                          is not None, reason="installed")),
    pytest.param(["--num-experts", "2", "--disable-bias-linear", "--moe-router-fusion"],
                 "--moe-router-fusion needs the transformer-engine package, which is not "
                 "installed (pip install transformer-engine)",
                 marks=pytest.mark.skipif(importlib.util.find_spec("transformer_engine")
                                          is not None, reason="installed")),
    pytest.param(["--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "local"],
                 "--non-persistent-ckpt-type local needs the nvidia-resiliency-ext package, "
                 "which is not installed (pip install nvidia-resiliency-ext)",
                 marks=pytest.mark.skipif(importlib.util.find_spec("nvidia_resiliency_ext")
                                          is not None, reason="installed")),
    # Megatron-LM's default layers: their spec held None for each missing class
    pytest.param(["--transformer-impl", "transformer_engine"],
                 "--transformer-impl transformer_engine (Megatron-LM's default) needs the "
                 "transformer-engine package, which is not installed; add --transformer-impl "
                 "local (megatron-core's own layers), or pip install transformer-engine",
                 marks=pytest.mark.skipif(importlib.util.find_spec("transformer_engine")
                                          is not None, reason="installed")),
    # megatron-core asserts these only while it builds the layers
    (["--num-experts", "2", "--disable-bias-linear", "--moe-token-dispatcher-type", "flex"],
     "DeepEP dispatcher requires TPxEP > 1"),
    (["--attention-backend", "flash", "--attention-dropout", "0", "--window-size", "8,0"],
     "--attention-backend flash does not support window attention yet; use --attention-backend "
     "unfused"),
])
def test_megatron_cores_own_checks_past_the_parser_are_one_line(capsys, corpus, flags, message):
    assert refused(capsys, [*data_flags(corpus), *flags]) == f"pretrain_gpt.py: error: {message}"


@pytest.mark.skipif(importlib.util.find_spec("nvidia_resiliency_ext") is not None,
                    reason="installed")
def test_a_gpus_asynchronous_save_names_the_package_of_its_default_strategy(monkeypatch):
    # On a GPU the persistent worker saves with nvidia-resiliency-ext unless told mcore; the
    # flags are set past the parser, as a GPU's would be.
    from helpers.pretrain import parse

    monkeypatch.setenv("WORLD_SIZE", "1")
    args = parse()
    args.async_save = args.use_persistent_ckpt_worker = True
    args.async_strategy = "nvrx"  # the parser's default; validate_args resets it without a save
    with pytest.raises(launch.ConfigError) as info:
        launch._check_packages(args)
    assert str(info.value) == ("--async-save --use-persistent-ckpt-worker --async-strategy nvrx "
                               "needs the nvidia-resiliency-ext package, which is not installed "
                               "(pip install nvidia-resiliency-ext)")
    args.async_strategy = "mcore"
    launch._check_packages(args)


@pytest.mark.skipif(importlib.util.find_spec("wget") is not None, reason="wget downloads them")
def test_gpt2s_tokenizer_without_its_files_is_refused_in_one_line(capsys):
    # Megatron-LM's default tokenizer; it died in a traceback asking for the wget package.
    assert refused(capsys, ["--mock-data", "--tokenizer-type", "GPT2BPETokenizer"]) == (
        "pretrain_gpt.py: error: --tokenizer-type GPT2BPETokenizer (Megatron-LM's default) "
        "needs --vocab-file and --merge-file: without them Megatron-LM downloads GPT-2's with "
        "the wget package, which is not installed; data already in token ids (--mock-data) "
        "takes --tokenizer-type NullTokenizer --vocab-size N")


def test_context_parallelism_without_transformer_engine_is_refused_in_one_line():
    # megatron-core asserted it while building the first attention layer, on every rank. (One
    # process cannot be given two context-parallel ranks, so the flags' check is called.)
    from megatron_adacc import megatron_lm

    from helpers.pretrain import parse

    args = parse()
    args.context_parallel_size = 2
    with pytest.raises(megatron_lm.ConfigError) as info:
        megatron_lm.check_args(args)
    assert str(info.value) == ("--context-parallel-size 2 runs only in Transformer Engine's "
                               "attention, and --transformer-impl local has none")


# Megatron-LM's get_batch carries packed sequences' cu_seqlens for the first two, which
# pretrain_gpt.py's forward_step does not pass on; the last two died in the dataset's build.
@pytest.mark.parametrize("flags, message", [
    (["--sft"], "--sft trains on packed sequences, which this pretrain_gpt.py does not feed "
                "the model yet"),
    (["--dataloader-inter-document-masking"], "--dataloader-inter-document-masking trains on "
     "packed sequences, which this pretrain_gpt.py does not feed the model yet"),
    (["--fim-data"], "--fim-data: the NullTokenizer tokenizer has no ids for the FIM tokens "
     "<fim_prefix>, <fim_middle>, <fim_suffix>, <fim_pad>, <|endoftext|>; use a text tokenizer "
     "that has them, or name its own with --fim-prefix-token and the like"),
    (["--dataloader-fast-cache-load"],
     "--data-cache-path must be provided when using --dataloader-fast-cache-load."),
])
def test_dataset_flags_pretrain_gpt_cannot_honour_are_refused_in_one_line(capsys, corpus,
                                                                           flags, message):
    assert refused(capsys, [*data_flags(corpus), *flags]) == f"pretrain_gpt.py: error: {message}"


def test_a_wandb_project_without_a_directory_is_refused_in_one_line(capsys, corpus):
    # Megatron-LM joins --save (None) into wandb's directory: a TypeError traceback.
    assert refused(capsys, [*data_flags(corpus), "--wandb-project", "p"]) == (
        "pretrain_gpt.py: error: --wandb-project writes under --wandb-save-dir, by default "
        "--save's wandb/: give one of them")


def test_a_run_without_a_learning_rate_is_refused(capsys):
    # Megatron-LM has no default --lr and hands None to torch's AdamW (a TypeError).
    assert _main(["--train-iters", "2"]) == 2
    assert capsys.readouterr().err == (
        "pretrain_gpt.py: error: --lr is required: Megatron-LM has no default learning rate\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="nsys's range needs no refusal on a GPU")
def test_profile_for_nsys_is_refused_without_a_gpu(capsys, corpus):
    assert refused(capsys, [*data_flags(corpus), "--profile"]) == (
        "pretrain_gpt.py: error: --profile marks a CUDA profiler range for nsys, and this "
        "machine has no GPU; add --use-pytorch-profiler (and --tensorboard-dir)")


def test_an_empty_bin_is_refused_naming_the_file(tmp_path, capsys, corpus):
    prefix = tmp_path / "e_text_document"
    shutil.copy(f"{corpus}.idx", f"{prefix}.idx")
    Path(f"{prefix}.bin").write_bytes(b"")
    assert refused(capsys, ["--data-path", str(prefix)]) == (
        f"pretrain_gpt.py: error: --data-path {prefix}: {prefix}.bin is empty (no documents); "
        f"make it again with scripts/preprocess_data.py from a non-empty corpus")


@pytest.mark.parametrize("flags, message", [
    (["--num-attention-heads", "3", "--hidden-size", "66"],
     "num_attention_heads (3) must be a multiple of tensor_model_parallel_size (2)."),
])
def test_every_dimension_tensor_parallelism_splits_is_checked(monkeypatch, capsys, corpus,
                                                              flags, message):
    # Megatron-LM checks the heads (QKV's columns, the projection's rows) in validate_args;
    # the vocabulary it pads to a multiple of TP itself. (The old trainer's check of
    # --ffn-hidden-size is megatron-core's TransformerConfig's now, once the model is built.)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as Megatron-LM's scripts export
    line = refused(capsys, [*data_flags(corpus), "--tensor-model-parallel-size", "2", *flags])
    assert line.startswith(f"pretrain_gpt.py: error: {message}")


@pytest.mark.parametrize("text, message", [
    ("sites: {softmax_out: {action: compress, codec: bitmask}}\n",
     "sites.softmax_out: codec 'bitmask' cannot hold softmax_out (attention probabilities "
     "saved by the softmax backward); codecs for it: outlier_int4, channel_int4, asym_int4, "
     "sym_int4, naive_int4"),
    ("sites: {attn_dropout_mask: {action: compress, codec: sym_int4}}\n",
     "sites.attn_dropout_mask: codec 'sym_int4' cannot hold attn_dropout_mask (attention "
     "dropout mask); codecs for it: bitmask"),
    ("sites: {gelu_in: compress\n  ln1_out: [retain\n",
     "not valid YAML (expected ',' or '}', but got ':' at line 2, column 10)"),
])
def test_a_bad_plan_file_is_refused_when_read_naming_file_and_site(tmp_path, capsys, corpus,
                                                                   text, message):
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    with pytest.raises(PlanError) as info:
        Plan.load(plan)
    assert str(info.value) == f"{plan}: {message}"
    line = refused(capsys, [*data_flags(corpus), "--adacc-policy", str(plan)])
    assert line == f"pretrain_gpt.py: error: --adacc-policy {plan}: {message}"


# --- 7. the Python API ------------------------------------------------------------------------

@pytest.mark.parametrize("options, error, message", [
    ({"policy": "auto", "memory_budget": -5}, ValueError,
     "AdaccConfig.memory_budget (--adacc-memory-budget) -5: expected a positive size, e.g. "
     "24GiB (a bare number is bytes)"),
    ({"policy": "auto", "memory_budget": 2.5}, TypeError,
     "AdaccConfig.memory_budget (--adacc-memory-budget) takes a number of bytes (int), a size "
     "such as '2GiB', or None, got 2.5"),
    ({"policy": "auto", "guard_threshold": math.nan}, ValueError,
     "--adacc-tracking-reset-fraction and --adacc-guard-threshold must be positive and "
     "finite, got 0.25 and nan"),
    ({"policy": "auto", "tracking_max_interval": "10"}, TypeError,
     "AdaccConfig.tracking_max_interval (--adacc-tracking-max-interval) takes an integer, "
     "got '10'"),
    ({"policy": "auto", "tracking_sites": "gelu_in"}, TypeError,
     "AdaccConfig.tracking_sites (--adacc-tracking-sites) takes a sequence of site names or "
     "None, got 'gelu_in'"),
    ({"policy": "auto", "profile_repeats": 0}, TypeError,
     "AdaccConfig.profile_repeats (--adacc-profile-repeats) takes a positive integer or None, "
     "got 0"),
    ({"policy": "auto", "strict": 1}, TypeError,
     "AdaccConfig.strict (--adacc-strict) takes True or False, got 1"),
    ({"policy": 3}, TypeError, "AdaccConfig.policy (--adacc-policy) takes a string, got 3"),
    ({"codec_backend": "fast"}, ValueError,
     "--adacc-codec-backend fast: expected one of auto, torch, native, triton"),
])
def test_adacc_config_refuses_wrong_types_and_values_at_construction(options, error, message):
    with pytest.raises(error) as info:
        AdaccConfig(**options)
    assert type(info.value) is error and str(info.value) == message


def test_adacc_config_takes_a_list_of_tracking_sites_as_a_tuple():
    config = AdaccConfig(policy="auto", tracking_sites=["gelu_in"])
    assert config.tracking_sites == ("gelu_in",)


def test_adacc_calls_before_setup_and_a_batch_of_the_wrong_shape_are_refused(distributed):
    adacc = Adacc(AdaccConfig(policy="full-recompute"))
    for call, run in (("metrics", adacc.metrics), ("after_step", lambda: adacc.after_step(1)),
                      ("measure", lambda: adacc.measure().__enter__())):
        with pytest.raises(RuntimeError) as info:
            run()
        assert str(info.value) == f"Adacc.{call}(): call setup() first"
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(TypeError) as info:
        adacc.setup(torch.nn.Linear(2, 2), (tokens,), lambda model, batch: None)
    assert str(info.value) == ("Adacc.setup: batch must be (tokens, labels, loss_mask), three "
                               "tensors, got a tuple of 1")
    with pytest.raises(ValueError) as info:
        adacc.setup(torch.nn.Linear(2, 2), (tokens, tokens, tokens), num_micro_batches=0)
    assert str(info.value) == "Adacc.setup: num_micro_batches must be a positive integer, got 0"


def test_adacc_setup_refuses_auto_on_a_model_under_megatrons_full_recompute(distributed):
    from types import SimpleNamespace

    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(recompute_granularity="full")
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError) as info:
        Adacc(AdaccConfig(policy="auto", memory_budget="1GiB")).setup(
            model, (tokens, tokens, tokens))
    assert str(info.value) == ("--recompute-granularity full keeps only each layer's input, "
                               "which leaves --adacc-policy auto nothing to plan; drop it "
                               "(auto's plans include full recompute)")


# --- 1. an interrupt -------------------------------------------------------------------------

@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_ends_the_run_in_one_line_with_exit_130(tmp_path, corpus, signum, status):
    run = forked.start([PRETRAIN, *TINY, *data_flags(corpus), "--train-iters", "100000",
                        "--log-interval", "1", "--save", "ck", "--save-interval", "2"],
                       cwd=tmp_path, env=child_env())
    try:
        run.wait_for_line(" iteration        3/")  # a checkpoint is certainly written
        os.kill(run.pid, signum)
        done = run.wait(timeout=120)
    finally:
        run.kill()
    err = done.stderr
    assert done.returncode == status
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    saved = launch.latest_checkpoint(tmp_path / "ck")
    assert saved is not None and saved % 2 == 0
    assert last.startswith("pretrain_gpt.py: interrupted at iteration ")
    assert last.endswith(f"; last checkpoint: iteration {saved} in ck (resume with --load ck)")


def test_an_interrupt_lost_where_it_arrived_still_ends_the_run_after_that_step(
        corpus, capsys, monkeypatch):
    # Code that calls back into Python from C may clear an exception raised in the callback
    # (a full suite run once saw a run train on past its Ctrl-C): here the second step
    # swallows the KeyboardInterrupt its SIGINT raised.
    from megatron.training import get_args, training

    step = training.train_step

    def swallowing_step(*args, **kwargs):
        if get_args().curr_iteration == 1:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler raises in here
            except KeyboardInterrupt:
                pass
        return step(*args, **kwargs)

    monkeypatch.setattr(training, "train_step", swallowing_step)
    assert _main([*TINY, *data_flags(corpus), "--train-iters", "5"]) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "pretrain_gpt.py: interrupted at iteration 2; no checkpoint saved"


def test_the_demo_corpus_directory_is_checked_when_the_corpus_must_be_written(
        tmp_path, capsys, monkeypatch):
    (tmp_path / "a_file").write_text("x")
    monkeypatch.setenv("ADACC_DATA_DIR", str(tmp_path / "a_file" / "data"))
    line = refused(capsys, [])
    assert line == (f"pretrain_gpt.py: error: $ADACC_DATA_DIR (the demo corpus, no "
                    f"--data-path) {tmp_path}/a_file/data/demo-bytes: {tmp_path}/a_file "
                    f"is a file, so the directory cannot be created")
    assert files_under(tmp_path) == ["a_file"]


def test_a_run_shuts_down_the_process_groups_it_set_up(tmp_path, corpus):
    # What pretrain_gpt.main sets up it tears down, on success and on refusal alike: a
    # process group left to the interpreter's exit aborted pipeline runs now and then.
    script = (
        "import sys, torch.distributed as dist\n"
        "from megatron.core import parallel_state\n"
        "import pretrain_gpt\n"
        f"flags = {[*TINY, *data_flags(corpus), '--train-iters', '2']!r}\n"
        "codes = [pretrain_gpt.main(flags), pretrain_gpt.main(flags + ['--split', 'abc'])]\n"
        "print(codes, dist.is_initialized(), parallel_state.model_parallel_is_initialized())\n")
    done = forked.run(["-c", script], cwd=tmp_path, env=child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "[0, 2] False False", done.stderr[-2000:]


@pytest.mark.parametrize("flag", ["--use-megatron-fsdp", "--use-torch-fsdp2"])
def test_fsdp_under_a_policy_is_refused_in_one_line(flag, monkeypatch):
    # A GPU's flags (a CPU refuses them first): Adacc's budget read DDP's buffers, which the
    # FSDP wrappers do not have. Set past the parser, as on a GPU.
    from megatron_adacc import megatron_lm
    from helpers.pretrain import parse

    monkeypatch.setenv("WORLD_SIZE", "1")
    args = parse("--adacc-policy", "quantize")
    setattr(args, flag[2:].replace("-", "_"), True)
    with pytest.raises(megatron_lm.ConfigError) as info:
        megatron_lm.check_args(args)
    assert str(info.value) == (f"--adacc-policy quantize budgets DistributedDataParallel's "
                               f"buffers, and {flag} shards them its own way, which Adacc does "
                               f"not count yet; drop one of them")


def test_the_pipeline_size_field_names_its_own_flag():
    with pytest.raises(TypeError) as info:
        AdaccConfig(pipeline_model_parallel_size=2.0)
    assert str(info.value) == ("AdaccConfig.pipeline_model_parallel_size "
                               "(--pipeline-model-parallel-size) takes an integer, got 2.0")
    with pytest.raises(ValueError, match="^--pipeline-model-parallel-size must be positive$"):
        AdaccConfig(pipeline_model_parallel_size=0)


def test_the_in_house_builder_refuses_pipeline_stages():
    # Pipeline stages come from Megatron-LM's model provider; models.build builds whole
    # models for benchmarks, examples and tests, and says where stages are built.
    from megatron_adacc.models import build

    config = build.build_transformer_config(num_layers=2, hidden_size=32,
                                            num_attention_heads=4,
                                            pipeline_model_parallel_size=2,
                                            pipeline_dtype=torch.float32)
    with pytest.raises(ValueError) as info:
        build.build_gpt_model(config, 64, 16)
    assert str(info.value) == ("build_gpt_model builds a whole model; train pipeline stages "
                               "with pretrain_gpt.py, whose model provider builds each rank's "
                               "stage")
