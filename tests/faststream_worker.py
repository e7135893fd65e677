"""A FastStream consumer for the tests: ``python tests/faststream_worker.py DB SERVERS TOPIC GROUP``.

A FastStream app whose one subscriber is the inbox (``outbox.faststream.subscribe``)
with the test handler ``apply_effect``, and the sweep in its lifespan. With
``--block-seq N`` the handler prints ``blocked`` and hangs at seq N, before
its transaction commits, for a test that kills the process there. With
``--async`` the Inbox is built on an AsyncEngine; ``--broker aiokafka`` uses FastStream's aiokafka broker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from faststream import FastStream
from faststream.confluent import KafkaBroker as ConfluentBroker
from faststream.kafka import KafkaBroker as AiokafkaBroker

from outbox import Inbox, create_engine
from outbox.faststream import subscribe, sweeping
from tests.inbox_support import apply_effect, for_inbox, inbox_bind
from tests.inbox_worker import TEST_CONSUMER_SETTINGS

AUTO_COMMIT_INTERVAL_MS = 500
"""The clients' auto-commit interval (default 5 s). ``subscribe`` commits itself and turns auto-commit
off; were it on (FastStream's default ``AckPolicy.ACK_FIRST``), a record would be committed on
receipt within this interval, which is how long a test must wait to see it was not."""

# The inbox workers' consumer settings (a killed consumer's partitions move on after 4 s), reading
# a new group's topic from its start.
TEST_SUBSCRIBER_SETTINGS = {"auto_offset_reset": "earliest",
                            "auto_commit_interval_ms": AUTO_COMMIT_INTERVAL_MS, **TEST_CONSUMER_SETTINGS}


BROKERS = {"confluent": ConfluentBroker, "aiokafka": AiokafkaBroker}
"""FastStream's two Kafka brokers: on confluent-kafka (librdkafka) and on aiokafka."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("servers")
    parser.add_argument("topic")
    parser.add_argument("group")
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument("--broker", choices=sorted(BROKERS), default="confluent")
    parser.add_argument("--block-seq", type=int, default=None)
    parser.add_argument("--session-timeout-ms", type=int, default=None,
                        help="the consumer's session.timeout.ms (TEST_CONSUMER_SETTINGS' otherwise)")
    args = parser.parse_args()

    bind = inbox_bind(create_engine(args.db), "async" if args.asynchronous else "sync")
    inbox = Inbox(bind, group=args.group, retry_backoff=0.01)

    def handler(session, message):  # type: ignore[no-untyped-def]
        if message.seq == args.block_seq:
            print("blocked", flush=True)
            time.sleep(3600)  # until the test kills the process
        apply_effect(session, message)

    inbox.handler(args.topic)(for_inbox(inbox, handler))
    # The test made the topic; creating it through the admin API waits for a controller the mock lacks.
    broker = BROKERS[args.broker](args.servers.split(","), allow_auto_create_topics=False)
    settings = dict(TEST_SUBSCRIBER_SETTINGS)
    if args.session_timeout_ms is not None:
        settings["session_timeout_ms"] = args.session_timeout_ms
    subscribe(broker, inbox, **settings)

    @contextlib.asynccontextmanager
    async def lifespan():  # type: ignore[no-untyped-def]
        async with sweeping(inbox, every=0.5):
            yield

    app = FastStream(broker, lifespan=lifespan)

    @app.after_startup
    async def ready() -> None:
        print("ready", flush=True)

    asyncio.run(app.run())


if __name__ == "__main__":
    main()
