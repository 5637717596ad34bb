"""What every command of the `cuflash` command line shares: argparse types that check their values,
a parser whose errors are one line, a progress line, and run_guarded, where every command ends:
one line on stderr and exit status 2 for a problem, 130 for Ctrl-C, 141 quietly for a closed pipe."""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .datafiles import DataError, check_room
from .errors import FlashAttentionError

# The sweeps' passes (cuflash bench, cuflash experiment).
MODES = ("fwd", "bwd", "fwd+bwd")
# Seconds a command runs before its progress line shows (short runs print none).
PROGRESS_AFTER_S = 3.0


class CommandError(Exception):
    """A problem a command reports in one line, with exit status 2."""


# -- arguments ----------------------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    """argparse with errors in one line (`prog: error: message`, exit status 2) and each option's
    default, where it has one, at the end of its help."""

    def add_argument(self, *args, **kwargs):
        default, text = kwargs.get("default"), kwargs.get("help")
        if default is not None and default is not False and default != argparse.SUPPRESS \
                and text != argparse.SUPPRESS:
            kwargs["help"] = f"{text or ''} (default: %(default)s)".lstrip()
        return super().add_argument(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _integer(item: str, low: int, high: int | None, given: str, accepted: str) -> int:
    try:
        value = int(item)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"got {given!r}; accepted: {accepted}")
    return value


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer from low (to high)."""
    accepted = f"an integer from {low} to {high}" if high is not None else f"an integer >= {low}"
    return lambda text: _integer(text, low, high, text, accepted)


def integers(low: int, high: int | None = None) -> Callable[[str], list[int]]:
    """An argparse type: integers from low (to high), separated by commas."""
    accepted = (f"integers from {low} to {high}" if high is not None else f"integers >= {low}") \
        + ", separated by commas"
    return lambda text: [_integer(item, low, high, text, accepted) for item in text.split(",")]


def head_dims(high: int) -> Callable[[str], list[tuple[int, int]]]:
    """An argparse type: head dims from 1 to high, separated by commas, each D (q, k and v) or D:Dv (q's
    and k's, then v's, as DeepSeek's MLA 192:128); as (D, Dv) pairs."""
    accepted = f"head dims from 1 to {high}, each D or D:Dv (v's head dim after the colon), separated by commas"

    def pair(item: str, text: str) -> tuple[int, int]:
        d, _, dv = item.partition(":")
        return _integer(d, 1, high, text, accepted), _integer(dv or d, 1, high, text, accepted)
    return lambda text: [pair(item, text) for item in text.split(",")]


def head_dims_text(dims: tuple[int, int]) -> str:
    """A (D, Dv) pair as head_dims reads it: D, or D:Dv where they differ."""
    return str(dims[0]) if dims[0] == dims[1] else f"{dims[0]}:{dims[1]}"


def names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: one or more of `choices`, separated by commas."""
    def parse(text: str) -> list[str]:
        items = text.split(",")
        for item in items:
            if item not in choices:
                raise argparse.ArgumentTypeError(f"{item!r} is not one of {', '.join(choices)} "
                                                 f"(one or more, separated by commas)")
        return items
    return parse


def positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"got {text!r}; accepted: a number > 0")
    return value


def out_folder(text: str) -> Path:
    """An argparse type: a folder that exists, or can be made, and takes new files (nothing is made yet)."""
    try:
        check_room(Path(text), {})
    except DataError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return Path(text)


# -- how every command ends ---------------------------------------------------------------------------

class Progress:
    """A progress line on stderr, rewritten in place, once `after_s` seconds (default PROGRESS_AFTER_S)
    have passed; ended with a newline when the block it is used in ends, so that whatever follows
    (an error, say) starts a line of its own."""

    def __init__(self, after_s: float | None = None):
        self.after_s = PROGRESS_AFTER_S if after_s is None else after_s
        self.start, self.width = time.monotonic(), 0

    def __call__(self, text: str) -> None:
        if time.monotonic() - self.start >= self.after_s:
            self.width = max(self.width, len(text))
            print(f"\r{text:{self.width}s}", end="", file=sys.stderr, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.width:
            print(file=sys.stderr)


def _silence_stdout() -> None:
    """Points stdout's descriptor at /dev/null, so that the flush at exit does not meet the closed pipe again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # (not a file: nothing is flushed to a descriptor)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def run_guarded(prefix: str, command: Callable[[], int]) -> int:
    """command()'s exit status. What it raises ends here: a bad input, a folder it cannot use or a
    FlashAttentionError as one line `prefix: error: message` and 2; Ctrl-C as one line and 130; a
    closed stdout quietly, with 141 (128 + SIGPIPE, as a tool the signal ends); argparse's exits
    (help, version, a bad argument: printed already) with their status."""
    try:
        try:
            status = command()
        except SystemExit as exc:
            status = int(exc.code or 0)
        sys.stdout.flush()  # (a reader that went away shows here, not in the flush at exit)
        return status
    except BrokenPipeError:
        _silence_stdout()
        return 141
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except (CommandError, DataError, FlashAttentionError, OSError, torch.OutOfMemoryError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"{prefix}: error: {message}", file=sys.stderr)
        return 2
