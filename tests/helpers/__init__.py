"""Builders, runners and assertions the tests share; no test module imports another.

conftest.py puts the repository and tests/ first on sys.path, and ``helpers.pretrain.
child_env`` does the same for a test's subprocesses, so ``from helpers.X import ...`` works
in either.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # the repository
TESTS = ROOT / "tests"
