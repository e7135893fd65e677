"""stdout for lists, status, stats and the demo: wrapped on a terminal, whole lines when redirected.

rich wraps at 80 columns when stdout is not a terminal (a pipe, a file, CI
logs), which cut a long path in two; redirected output keeps each line whole
instead, for grep and for copy-paste.
"""

from __future__ import annotations

import sys

from rich.console import Console

UNWRAPPED = 10_000  # columns for redirected output: wider than any line we print


def stdout_console() -> Console:
    """A console on stdout that wraps only on a terminal; piped output keeps each line whole."""
    if sys.stdout.isatty():
        return Console(highlight=False)
    return Console(width=UNWRAPPED, highlight=False, soft_wrap=True)
