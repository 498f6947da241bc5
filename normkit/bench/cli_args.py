"""Argument parsers and the progress line shared by the bench's command lines (cli.py, models.py)."""
from __future__ import annotations

import argparse
import sys


def _list_of(choices, what, allow_none=False):
    def parse(text: str):
        items = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
        if allow_none and items == ("none",):
            return ()
        bad = [t for t in items if t not in choices]
        if bad or not items:
            extra = " (or none)" if allow_none else ""
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {what} from {', '.join(choices)}{extra}, got {text!r}")
        return items
    return parse


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = 0
        if not v > 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return v
    return parse


class _Progress:
    """A tqdm bar on a terminal (when tqdm is installed), else one counted line per step, which
    reads better in a log."""

    def __init__(self, total: int):
        self.total, self.done, self.bar = total, 0, None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, n: int, line: str):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            self.bar.write(line)
        else:
            print(f"[{self.done}/{self.total}] {line}", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
