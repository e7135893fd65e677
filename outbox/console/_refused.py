"""``Refused``: a request the console will not serve, and why."""

from __future__ import annotations


class Refused(Exception):
    """A request the console will not serve; becomes an escaped error page with ``status``."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
