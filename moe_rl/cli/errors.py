"""The exit codes, the error a command raises for a mistake its user can fix, and the argument types the
commands share."""

from __future__ import annotations

import argparse

EXIT_USAGE = 2  # a mistake to fix (a retry repeats it)
EXIT_FAULT = 3  # a process died or hung: a launcher's retry resumes from the last checkpoint


class UserError(Exception):
    """An error the user can fix; printed as one line."""


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value
