"""Every flag of pretrain_gpt.py and ``adacc plan`` is documented in README.md: the parsers
themselves are read, so a flag added without a word in the README fails here."""
import re
from pathlib import Path

import pytest

from megatron_adacc.training.arguments import build_parser
from megatron_adacc.cli import _build_parser

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _flags(parser) -> set[str]:
    flags = set()
    for action in parser._actions:
        if hasattr(action, "choices") and isinstance(action.choices, dict):  # sub-commands
            for sub in action.choices.values():
                flags |= _flags(sub)
        flags |= {option for option in action.option_strings if option.startswith("--")}
    return flags - {"--help"}


@pytest.mark.parametrize("name, parser", [("pretrain_gpt.py", build_parser()),
                                          ("adacc plan", _build_parser())])
def test_every_flag_is_in_the_readme(name, parser):
    flags = _flags(parser)
    assert len(flags) > 10
    # A flag counts as mentioned where it stands alone: "--lr" is not found in "--lr-decay".
    missing = sorted(flag for flag in flags
                     if not re.search(re.escape(flag) + r"(?![\w-])", README))
    assert missing == [], f"{name}: flags missing from README.md: {missing}"
