"""argparse types of relayrl's commands: each turns a bad value into a one-line error naming it."""

from __future__ import annotations

import argparse
from typing import Callable

__all__ = ["int_at_least", "port", "device", "finite_float", "non_negative_float", "positive_float", "fraction",
           "top_k"]


def int_at_least(low: int) -> Callable[[str], int]:
    """argparse type: an integer >= ``low``, refused with the bound otherwise."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not >= {low}")
        return value

    return parse


def port(text: str) -> int:
    """argparse type: a TCP port, 0-65535 (0: any free one)."""
    port = int_at_least(0)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0-65535)")
    return port


def device(text: str) -> str:
    """argparse type: auto, cpu, cuda or cuda:N (what torch accepts for the engines)."""
    import re

    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: give auto, cpu, cuda or cuda:N")
    return text


def finite_float(text: str) -> float:
    """argparse type: a number, neither NaN nor infinite."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} is not >= 0")
    return value


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} is not > 0")
    return value


def fraction(*, zero: bool) -> Callable[[str], float]:
    """argparse type: a number in [0, 1] (``zero``: 0 allowed, as min-p's off) or (0, 1] (top-p)."""
    def parse(text: str) -> float:
        value = non_negative_float(text)
        if not (value <= 1 and (zero or value > 0)):
            raise argparse.ArgumentTypeError(f"{value} is not in {'[0' if zero else '(0'}, 1]")
        return value

    return parse


def top_k(text: str) -> int:
    """argparse type: a top-k, an integer >= 0 (0: off); -1, verl's and vLLM's off, is refused naming relayrl's."""
    if text.strip() == "-1":
        raise argparse.ArgumentTypeError("-1 is how verl and vLLM turn top-k off; relayrl's off is 0")
    return int_at_least(0)(text)


def check_makeable(path, what: str, fix: str) -> None:
    """Refuse (ConfigError, ``what``: the option in the message) a ``path`` that cannot be created: its
    nearest existing ancestor must be a directory this process can write."""
    import os
    from pathlib import Path

    from relayrl.config.loader import ConfigError

    parent = Path(path)
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{what} {path} cannot be made: {parent} is a file; {fix}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path}: {parent} is not writable; {fix}")
