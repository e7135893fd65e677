"""Serving the console with uvicorn until Ctrl-C or SIGTERM, then exiting 0 without a traceback.

uvicorn handles SIGINT/SIGTERM itself while it serves, then restores the
previous handlers and raises the signal again so the caller hears of it. Left
as they are, that second delivery ends the process with a KeyboardInterrupt
traceback (status 130), or, after PySpark ran in the same process (the demo's
audit), in PySpark's own SIGINT handler mid-shutdown. A stop asked for is
not an error: the re-raised signal is swallowed here. A signal that arrives
before uvicorn took its handlers (start-up) asks the server to stop, too.
"""

from __future__ import annotations

import signal
from typing import Any


def serve_until_stopped(server: Any) -> None:
    """``server.run()`` (a ``uvicorn.Server``) with SIGINT and SIGTERM ending it quietly."""
    def stop(*_: object) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
