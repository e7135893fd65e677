"""How long ago a time was, in words an on-call engineer reads at a glance."""

from __future__ import annotations


def ago(seconds: float) -> str:
    """``seconds`` in the largest whole unit: "45 s ago", "3 min ago", "2 h ago", "in 5 s".

    Negative seconds are in the future (another host's clock ahead): "in …",
    never a negative age. Shared by ``outbox trace`` and the console.
    """
    future, seconds = seconds < 0, abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            text = f"{int(seconds // size)} {unit}"
            break
    else:
        text = f"{int(seconds)} s"
    return f"in {text}" if future else f"{text} ago"
