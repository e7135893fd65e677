"""Times for a person: "3 min ago", with the absolute UTC time in the element's title."""

from __future__ import annotations

from datetime import UTC, datetime

from markupsafe import Markup, escape

from ..core._age import ago
from ..core._envelope import utcnow


def when(value: datetime | str | None, now: datetime | None = None) -> Markup:
    """``<time datetime=… title="2026-11-25 13:02:11 UTC">3 min ago</time>``; empty for None."""
    if value is None or value == "":
        return Markup("")
    at = datetime.fromisoformat(value) if isinstance(value, str) else value
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    at = at.astimezone(UTC)
    shown = ago(((now or utcnow()) - at).total_seconds())
    return Markup('<time datetime="{}" title="{} UTC">{}</time>').format(
        escape(at.isoformat()), escape(f"{at:%Y-%m-%d %H:%M:%S}"), escape(shown))
