"""Argument types of the benchmarks' command lines: a bad value is refused by argparse
(exit code 2, the option named) before anything is measured, rather than after."""

import argparse
import math
import os


def output_file(path: str) -> str:
    """A result file's path (``--json``): its directory must exist and be writable, and
    the path must not be a directory, so that a long benchmark never ends unable to
    write its result."""
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a directory; give a file name")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(
            f"the directory {directory} does not exist; create it first or choose another file"
        )
    if not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"the directory {directory} is not writable")
    return path


def _positive(text: str, kind: type, a_value: str, a_positive_value: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {a_value}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not {a_positive_value}")
    return value


def positive_int(text: str) -> int:
    """A count >= 1."""
    return _positive(text, int, "an integer", "a positive integer")


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _positive(text, float, "a number", "a finite positive number")
