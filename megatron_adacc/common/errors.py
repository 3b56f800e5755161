"""The error every entry point turns into one line on stderr and exit status 2."""
from __future__ import annotations


class InputError(ValueError):
    """Bad user input, such as a flag, a config key, or a data, checkpoint or database file.

    The message is one line that names what is wrong and says what to do."""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message; "" when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
