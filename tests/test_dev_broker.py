"""``outbox dev-broker`` as a newcomer runs it: a real process whose printed address carries records."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer


def _reading(process: subprocess.Popen[str]) -> queue.Queue[str]:
    """The process's stdout lines, read by a thread: a silent process cannot block the test."""
    assert process.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in iter(process.stdout.readline, "")],
                     daemon=True).start()
    return lines


def _first_line_with(lines: queue.Queue[str], pattern: str, deadline: float) -> re.Match[str]:
    """Take lines until one matches ``pattern``; fail at ``deadline``."""
    seen = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        seen.append(line)
        if found := re.search(pattern, line):
            return found
    raise AssertionError(f"no line matching {pattern!r} in {seen!r} ")


@pytest.mark.any_kafka
def test_dev_broker_carries_a_record_and_stops_cleanly_on_sigterm():
    process = subprocess.Popen([sys.executable, "-m", "outbox", "dev-broker"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = _reading(process)
        servers = _first_line_with(lines, r"export OUTBOX_BOOTSTRAP_SERVERS=(\S+)",
                                   time.monotonic() + 30).group(1)
        assert re.fullmatch(r"[\w.-]+:\d+(,[\w.-]+:\d+)*", servers)
        topic, value = f"dev-{uuid.uuid4().hex[:8]}", uuid.uuid4().bytes
        producer = Producer({"bootstrap.servers": servers})
        producer.produce(topic, value, key=b"k")
        assert producer.flush(10) == 0
        del producer  # destroyed now: no client of the test reconnects to the stopped broker
        consumer = Consumer({"bootstrap.servers": servers, "group.id": "dev",
                             "auto.offset.reset": "earliest"})
        consumer.subscribe([topic])
        deadline, got = time.monotonic() + 20, None
        while got is None and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                got = message.value()
        consumer.close()
        assert got == value
        process.send_signal(signal.SIGTERM)
        # Not communicate(): it would read stdout too, racing the reader thread for the last line.
        process.wait(timeout=15)
        assert process.stderr is not None
        err = process.stderr.read()
        assert process.returncode == 0, err
        assert _first_line_with(lines, "dev-broker stopped", time.monotonic() + 5)
        assert "Traceback" not in err
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_dev_broker_prints_commands_that_parse():
    """What it tells a newcomer to run is a valid command line of this CLI."""
    from _doc_commands import parse_error

    from outbox.cli._dev_broker import usage

    commands = [line.strip() for line in usage("127.0.0.1:9092").splitlines()
                if line.strip().startswith("outbox ")]
    assert len(commands) == 2
    for command in commands:
        assert parse_error(command) is None, command
