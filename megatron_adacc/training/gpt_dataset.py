"""megatron-core's GPTDataset with two defects of 0.16.1 fixed for users.

- A split that gets no documents (a corpus of a few documents under ``--split 969,30,1``)
  made ``_get_num_epochs`` loop forever at 100 % CPU; here it is an InputError naming the
  dataset and the split.
- The dataset index cache (``<prefix>/cache/GPTDataset_indices``) was written in place, so a
  run reading it while another wrote it, or after a killed write, read truncated arrays.
  Here the indices are built into a private staging directory and published file by file
  with an atomic rename, the description last: megatron treats the cache as present only
  when all four files exist, and by then every array is complete.
"""
from __future__ import annotations

import copy
import os
import shutil
import uuid
from pathlib import Path

from megatron.core.datasets.gpt_dataset import GPTDataset

from megatron_adacc.common.errors import InputError

# megatron's cache files, in publishing order: the description last (see above).
_CACHE_AFFIXES = ("document_index.npy", "sample_index.npy", "shuffle_index.npy",
                  "description.txt")


class SafeGPTDataset(GPTDataset):
    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples,
                 index_split, config):
        if num_samples and len(indexed_indices) == 0:
            split = f" (--split {config.split})" if config.split else ""
            raise InputError(
                f"dataset {dataset_path}: its {index_split.name} split{split} gets none of its "
                f"{len(indexed_dataset)} documents; add documents (in plain text, separate "
                f"them with blank lines) or change --split"
            )
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples,
                         index_split, config)

    def _build_document_sample_shuffle_indices(self):
        config = self.config
        shared = Path(config.path_to_cache or os.path.join(
            self.dataset.path_prefix, "cache", "GPTDataset_indices"))
        base = f"{self.unique_description_hash}-GPTDataset-{self.index_split.name}"
        if all((shared / f"{base}-{affix}").is_file() for affix in _CACHE_AFFIXES):
            return super()._build_document_sample_shuffle_indices()  # megatron loads them
        staging = shared / f".staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.config = copy.copy(config)
        object.__setattr__(self.config, "path_to_cache", str(staging))
        try:
            indices = super()._build_document_sample_shuffle_indices()
            for affix in _CACHE_AFFIXES:
                os.replace(staging / f"{base}-{affix}", shared / f"{base}-{affix}")
        finally:
            self.config = config
            shutil.rmtree(staging, ignore_errors=True)
        return indices


# megatron names the cache directory and files, and hashes the dataset description, after
# type(self).__name__: under megatron's name, caches built before stay valid.
SafeGPTDataset.__name__ = "GPTDataset"
