"""Turn text or JSONL into a megatron-core indexed dataset (.bin/.idx) for --data-path.

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus
    # writes data/corpus_text_document.bin/.idx and prints the flags to train on it:
    # --data-path data/corpus_text_document --tokenizer-type NullTokenizer --vocab-size 257

- JSONL: one object per line, the text under --json-keys (default: text).
- Plain text: documents are separated by blank lines.
- ``--tokenizer-type ByteLevel`` (the default) writes UTF-8 bytes, ids 0-255 and end-of-document
  256: the built-in corpus's format. Megatron-LM reads it with its NullTokenizer at vocabulary 257,
  with no tokenizer files and no network.
- Any of Megatron-LM's tokenizer types is built by megatron-core from Megatron-LM's flags
  (--vocab-file, --merge-file, --tokenizer-model), as pretrain_gpt.py builds it.
- Every document ends in the end-of-document token. A command line of Megatron-LM's own
  tools/preprocess_data.py keeps working: --append-eod and --workers are accepted.
"""
from __future__ import annotations

import argparse
import sys
import time

from megatron_adacc.corpus import ByteTokenizer, read_documents, write_indexed_dataset

BYTES = "ByteLevel"


class _MegatronTokenizer:
    """megatron-core's tokenizer of Megatron-LM's flags, as write_indexed_dataset reads one."""

    def __init__(self, flags: argparse.Namespace):
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

        from megatron_adacc import launch

        args = launch.build_parser().parse_args([])  # Megatron-LM's defaults
        for name in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model",
                     "vocab_size"):
            setattr(args, name, getattr(flags, name))
        args.pad_vocab_size = False
        self._tokenizer = build_tokenizer(args)
        self.eod = self._tokenizer.eod
        self.vocab_size = self._tokenizer.vocab_size

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.tokenize(text))


def _positive(text: str) -> int:
    number = int(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return number


def _training_flags(args: argparse.Namespace) -> str:
    """The tokenizer flags pretrain_gpt.py reads the dataset with."""
    if args.tokenizer_type == BYTES:
        return f"--tokenizer-type NullTokenizer --vocab-size {ByteTokenizer.vocab_size}"
    flags = [f"--tokenizer-type {args.tokenizer_type}"]
    for name in ("vocab_file", "merge_file", "tokenizer_model", "vocab_size"):
        if getattr(args, name) is not None:
            flags.append(f"--{name.replace('_', '-')} {getattr(args, name)}")
    return " ".join(flags)


def main(argv=None) -> int:
    """Write one dataset per JSON key; returns the exit status (2: bad input, one line)."""
    from megatron_adacc import megatron_compat

    megatron_compat.quiet_missing_kernel_notices()
    from megatron.core.tokenizers.utils.build_tokenizer import SUPPORTED_TOKENIZERS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="a .jsonl or plain-text file")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--tokenizer-type", default=BYTES,
                        choices=(BYTES, *SUPPORTED_TOKENIZERS))
    parser.add_argument("--vocab-file", default=None)
    parser.add_argument("--merge-file", default=None)
    parser.add_argument("--tokenizer-model", default=None)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--append-eod", action="store_true",
                        help="Megatron-LM's flag; here every document ends in end-of-document")
    parser.add_argument("--workers", type=_positive, default=1,
                        help="Megatron-LM's flag; this tool tokenises in one process")
    args = parser.parse_args(argv)
    try:
        tokenizer = (ByteTokenizer() if args.tokenizer_type == BYTES
                     else _MegatronTokenizer(args))
        keys = args.json_keys if args.input.endswith((".jsonl", ".json")) else ["text"]
        if len(keys) > 1:
            # A bad line for a later key must not fail the run after an earlier key's
            # dataset is published: read every key through once before writing any.
            for key in keys:
                for _ in read_documents(args.input, key):
                    pass
        for key in keys:
            start = time.perf_counter()
            prefix = f"{args.output_prefix}_{key}_document"
            tokens = write_indexed_dataset(read_documents(args.input, key), tokenizer, prefix)
            print(f"{prefix}: {tokens} tokens in {time.perf_counter() - start:.1f} s "
                  f"(train with --data-path {prefix} {_training_flags(args)})")
    except (ValueError, OSError, ImportError) as exc:  # a tokenizer's missing library too
        print(f"preprocess_data.py: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
