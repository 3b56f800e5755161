"""Builders, runners and assertions that the tests share; no test module imports another.

conftest.py puts the repository and tests/ first on sys.path. ``helpers.pretrain.child_env``
does the same for subprocesses. So ``from helpers.X import ...`` works in both.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # the repository
TESTS = ROOT / "tests"
