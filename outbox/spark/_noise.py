"""Keep the JVM's start-up notices out of a quiet run's stderr.

A locally launched driver JVM prints, before any logging setting can apply,
``WARNING: Using incubator modules``, log4j's profile notice, the shell's
"Setting default log level" hint and a ``NativeCodeLoader`` warning; later,
a cached partition computed twice logs ``BlockManager: Block rdd_… already
exists``, a WARN about Spark's own bookkeeping. None of them is actionable
for a user of ``outbox spark``; everything else the JVM writes (errors,
warnings, stack traces) passes through unchanged.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import IO

LEVELS = ("ERROR", "WARN", "INFO", "DEBUG")
NOISE = re.compile(
    rb"WARNING: Using incubator modules"
    rb"|Using Spark's default log4j profile"
    rb"|Setting default log level to"
    rb"|Setting Spark log level to"
    rb"|To adjust logging level use sc\.setLogLevel"
    rb"|NativeCodeLoader: Unable to load native-hadoop library"
    rb"|BlockManager: Block rdd_\d+_\d+ already exists on this machine"
)


def forward_filtered(stream: IO[bytes] | None, fd: int = 2) -> None:
    """Copy ``stream`` to file descriptor ``fd`` line by line, minus the start-up notices.

    Runs in a daemon thread until the JVM closes the stream; it must keep
    reading whatever happens, or the JVM would block on a full pipe.
    """
    if stream is None:
        return

    def pump() -> None:
        for line in iter(stream.readline, b""):
            if NOISE.search(line):
                continue
            with contextlib.suppress(OSError):  # stderr gone: keep draining, the JVM must not block
                os.write(fd, line)

    threading.Thread(target=pump, name="spark-stderr", daemon=True).start()
