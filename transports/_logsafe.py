"""Log lines that the text inside them cannot forge.

Keys, topics, consumer groups, header values and error messages come from
clients. Logged as they are, a key ``"k\\nINFO outbox.relay all clear"`` writes
a second, false line into every log file and terminal; a right-to-left
override turns a line around on screen; a lone surrogate makes a UTF-8 stream
handler fail to write the record at all. ``safe_logger(name)`` returns the
named logger with ``EscapeControls`` attached, and every logger of this
distribution is made through it, so escaping is one mechanism at the lowest
layer rather than a rule every log call must remember.

The filter rewrites a record's arguments and its exception text before any
handler sees them; the format string (ours, never a client's) is left alone.
Control characters, line and paragraph separators, bidirectional controls and
lone surrogates become ``\\xNN`` / ``\\uNNNN`` escapes; everything printable,
any script, any emoji, stays as it is.
"""

from __future__ import annotations

import logging
import traceback
import unicodedata
from collections.abc import Mapping

# Format characters that reorder what follows them on screen (the "Trojan Source" set).
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})


def escape_controls(text: str) -> str:
    """``text`` with every character that could break or reorder a log line escaped."""
    if text.isprintable():  # the common case: one C-level scan, no copy
        return text
    return "".join(
        _escape(ch) if ch in _BIDI or unicodedata.category(ch) in _ESCAPED_CATEGORIES else ch
        for ch in text
    )


_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _SHORT:
        return _SHORT[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class _Escaped:
    """An argument shown through ``%s`` or ``%r`` with its control characters escaped."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __str__(self) -> str:
        return escape_controls(str(self.value))

    def __repr__(self) -> str:
        return escape_controls(repr(self.value))


def _safe_arg(value: object) -> object:
    # A subclass is shown as the value it holds: its own __str__ could say anything.
    if isinstance(value, str):
        return escape_controls(value if type(value) is str else str.__str__(value))
    if value is None or type(value) in _NUMBERS:  # numbers keep %d / %.1f working
        return value
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return _Escaped(value)


_NUMBERS = frozenset({int, float, bool})


class EscapeControls(logging.Filter):
    """Escape client-controlled text in a record's arguments and exception; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(_safe_arg(a) for a in args)
        elif isinstance(args, Mapping):
            record.args = {k: _safe_arg(v) for k, v in args.items()}
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = _exception_text(record.exc_info[1])
        return True


def _exception_text(exc: BaseException) -> str:
    """The traceback as ``logging`` prints it, with each exception's own message and notes escaped.

    The texts are escaped in ``TracebackException``'s captured copy before it is
    formatted: a group's members are printed with a ``|`` before each line, so a
    message cannot be found again in the formatted text.
    """
    report = traceback.TracebackException.from_exception(exc)
    seen: set[int] = set()
    waiting = [report]
    while waiting:  # every exception traceback prints: causes, contexts, a group's members
        current = waiting.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        captured = getattr(current, _CAPTURED_STR, None)
        if isinstance(captured, str):
            setattr(current, _CAPTURED_STR, escape_controls(captured))
        notes = current.__notes__  # printed one per line after the message
        if isinstance(notes, list):
            current.__notes__ = [escape_controls(n) if isinstance(n, str) else n for n in notes]
        waiting.extend(e for e in (current.__cause__, current.__context__) if e is not None)
        waiting.extend(current.exceptions or ())
    return "".join(report.format()).rstrip("\n")


_CAPTURED_STR = "_str"
"""Where CPython's ``TracebackException`` keeps ``str(exc)`` (not in its type stubs)."""
_FILTER = EscapeControls()


def safe_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with ``EscapeControls`` attached (once)."""
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger

