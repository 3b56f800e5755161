"""The ProfileDB: measured ModelCosts kept on disk, so later runs of the same model on the
same machine plan without profiling again.

One SQLite file (stdlib ``sqlite3``), one row per profile, keyed by everything that changes
the measurements: every setting of the model's config, micro-batch and sequence length, the
device, and the code that measured it (a hash of the profiler, runtime and codec sources). A
ProfileDB of another schema, or a file that is not a database at all, is moved aside with a one-line
warning and a fresh database takes its place: a cache must never stop training. Another
application's SQLite database (a mistyped path) is refused with an InputError and left as it
is. Runs sharing the file create its schema under SQLite's write lock, so both find it.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import torch

import megatron_adacc
from megatron_adacc.common.costs import ModelCosts
from megatron_adacc.corpus import default_data_dir
from megatron_adacc.common.errors import InputError

# PRAGMA application_id marks the file as ours ("ADAC"); user_version is the schema.
APPLICATION_ID = 0x41444143
SCHEMA_VERSION = 1
# The sources whose changes invalidate a profile: what measures, what is measured, and the
# modelled terms a profile takes (the backward workspace, the optimizer step).
_MEASURED_CODE = ("profiling/profiler.py", "profiling/clock.py", "profiling/engine_memory.py",
                  "common/costs.py", "common/sites.py", "planning/analytic/sites.py", "runtime",
                  "codecs", "models")


def default_path() -> Path:
    return default_data_dir() / "profiles.sqlite"


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    package = Path(megatron_adacc.__file__).parent
    digest = hashlib.sha1()
    for entry in _MEASURED_CODE:
        path = package / entry
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        for file in files:
            if file.suffix in (".py", ".c"):
                digest.update(file.relative_to(package).as_posix().encode())
                digest.update(file.read_bytes())
    return f"{megatron_adacc.__version__}+{digest.hexdigest()[:12]}"


# GPTModel's own settings beside its TransformerConfig: positions and the output layer.
MODEL_SETTINGS = ("vocab_size", "position_embedding_type", "rotary_percent", "rotary_base",
                  "share_embeddings_and_output_weights")


def profile_key(model, seq_length: int, micro_batch_size: int, device: str,
                attention_backend: str = "unfused", loss: str = "gpt_loss") -> dict[str, Any]:
    """What a profile of ``model`` depends on: every setting of its config and of the GPTModel.

    Also its resolved attention backend (attention.backend_of: the two save different sites),
    the batch, the device and the loss it was profiled with (what that saves is in the
    non-layer bytes). Every config field counts: a hand-picked few let a Llama's layer reuse a
    GPT's profile, and mispredict its bytes."""
    config = model.config
    settings = {field.name: _setting(getattr(config, field.name))
                for field in dataclasses.fields(config)}
    return {
        "config": {name: value for name, value in settings.items() if value is not _UNKEYED},
        "model": {name: _setting(getattr(model, name, None)) for name in MODEL_SETTINGS},
        "attention_backend": attention_backend,
        "loss": loss,
        "seq_length": seq_length,
        "micro_batch_size": micro_batch_size,
        "device": device,
        "code_version": code_version(),
    }


_UNKEYED = object()  # a setting that is no value (a process group, the timers): left out


def _setting(value):
    """``value`` as JSON that is the same in every process, or _UNKEYED."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        items = [_setting(item) for item in value]
        return _UNKEYED if any(item is _UNKEYED for item in items) else items
    if isinstance(value, functools.partial):
        inner = [_setting(item) for item in (value.func, *value.args, *value.keywords.values())]
        return _UNKEYED if any(item is _UNKEYED for item in inner) else inner
    if callable(value) and hasattr(value, "__qualname__"):  # e.g. the MLP's activation
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return _UNKEYED


def _key_id(key: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _warn(message: str) -> None:
    print(f"adacc: {message}", file=sys.stderr, flush=True)


class _NotOurs(Exception):
    pass


class ProfileDB:
    """``get(key)`` -> ModelCosts or None; ``put(key, costs)``. Raises only on another
    application's database (InputError)."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_path()

    def get(self, key: dict[str, Any]) -> ModelCosts | None:
        row = self._run(lambda db: db.execute(
            "SELECT costs FROM profiles WHERE key_id = ?", (_key_id(key),)).fetchone())
        if not row:
            return None
        try:
            return ModelCosts.from_json(row[0])
        except (ValueError, KeyError, TypeError) as exc:  # CostsError is a ValueError
            _warn(f"profile database {self.path}: unreadable profile ({exc}); profiling again")
            return None

    def put(self, key: dict[str, Any], costs: ModelCosts) -> None:
        def write(db):
            with db:
                db.execute("INSERT OR REPLACE INTO profiles VALUES (?, ?, ?, ?)",
                           (_key_id(key), json.dumps(key, sort_keys=True), costs.to_json(),
                            time.time()))
        self._run(write)

    # --- the file ---------------------------------------------------------------------------
    def _run(self, action):
        """``action(connection)``, after making sure the file is ours; a bad file is moved
        aside once and the action retried on a fresh one. Other errors (locked, read-only,
        out of space) only warn: the run goes on without the cache."""
        for attempt in (1, 2):
            try:
                db = self._open()
            except (OSError, sqlite3.Error) as exc:
                _warn(f"profile database {self.path}: {exc}; not caching")
                return None
            try:
                self._check(db)
                return action(db)
            except sqlite3.OperationalError as exc:
                _warn(f"profile database {self.path}: {exc}; not caching")
                return None
            except (sqlite3.DatabaseError, _NotOurs) as exc:
                if attempt == 2 or not self._move_aside(str(exc)):
                    return None
            finally:
                db.close()
        return None

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return sqlite3.connect(self.path, timeout=30)

    @staticmethod
    def _header(db: sqlite3.Connection) -> tuple[int, int, int]:
        # One statement, so one snapshot: read as three, a run creating the schema alongside
        # could commit between them (application_id still 0, its tables already there), and
        # the file looked like another application's.
        return db.execute("SELECT (SELECT application_id FROM pragma_application_id), "
                          "(SELECT user_version FROM pragma_user_version), "
                          "(SELECT count(*) FROM sqlite_master)").fetchone()

    def _check(self, db: sqlite3.Connection) -> None:
        application_id, version, tables = self._header(db)
        if application_id == 0 and version == 0 and tables == 0:  # new, empty file
            # Under the write lock, read again: a run started alongside may have just
            # created the schema.
            db.execute("BEGIN IMMEDIATE")
            try:
                application_id, version, tables = self._header(db)
                if application_id == 0 and version == 0 and tables == 0:
                    db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                    db.execute("CREATE TABLE profiles (key_id TEXT PRIMARY KEY, key TEXT NOT "
                               "NULL, costs TEXT NOT NULL, created REAL NOT NULL)")
                    application_id, version = APPLICATION_ID, SCHEMA_VERSION
                db.execute("COMMIT")
            except BaseException:
                db.rollback()
                raise
        if application_id != APPLICATION_ID:
            raise InputError(
                f"profile database {self.path} is another application's SQLite database "
                f"({tables} tables, application_id {application_id}); left untouched: point "
                f"--adacc-profile-db at a new file"
            )
        if version != SCHEMA_VERSION:
            raise _NotOurs(f"schema version {version}, this version reads {SCHEMA_VERSION}")

    def _move_aside(self, reason: str) -> bool:
        aside = self.path.with_name(f"{self.path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}")
        try:
            self.path.replace(aside)
        except OSError as exc:
            _warn(f"profile database {self.path}: {reason}; cannot move it aside "
                  f"({exc.strerror or exc}); not caching")
            return False
        _warn(f"profile database {self.path}: {reason}; moved it to {aside.name} and started "
              f"a new one")
        return True
