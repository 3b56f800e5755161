"""README.md and the parsers agree: every flag Adacc adds to pretrain_gpt.py and every flag of
``adacc plan`` is documented, and every flag the README's flag table names is one that
pretrain_gpt.py accepts (Megatron-LM's parser with Adacc's flags)."""
import argparse
import re

import pytest

from megatron_adacc import launch, megatron_lm
from megatron_adacc.cli import _build_parser

from helpers import ROOT

README = (ROOT / "README.md").read_text()


def _flags(parser) -> set[str]:
    flags = set()
    for action in parser._actions:
        if hasattr(action, "choices") and isinstance(action.choices, dict):  # sub-commands
            for sub in action.choices.values():
                flags |= _flags(sub)
        flags |= {option for option in action.option_strings if option.startswith("--")}
    return flags - {"--help"}


def _adacc_flags() -> argparse.ArgumentParser:
    return megatron_lm.add_arguments(argparse.ArgumentParser())


@pytest.mark.parametrize("name, parser", [("pretrain_gpt.py's Adacc flags", _adacc_flags()),
                                          ("adacc plan", _build_parser())])
def test_every_flag_is_in_the_readme(name, parser):
    flags = _flags(parser)
    assert len(flags) > 10
    # A flag counts as mentioned where it stands alone: "--lr" is not found in "--lr-decay".
    missing = sorted(flag for flag in flags
                     if not re.search(re.escape(flag) + r"(?![\w-])", README))
    assert missing == [], f"{name}: flags missing from README.md: {missing}"


def test_every_flag_of_the_readmes_table_is_pretrain_gpts():
    table = [line for line in README.splitlines() if re.match(r"\| [\w ]+ \| `--", line)]
    named = {flag for line in table for flag in re.findall(r"--[\w-]+", line)}
    assert len(named) > 30
    unknown = sorted(named - _flags(launch.build_parser()))
    assert unknown == [], f"README.md's flag table names flags pretrain_gpt.py refuses: {unknown}"
