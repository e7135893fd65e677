"""A consumer process for the inbox tests: ``python tests/inbox_worker.py DB SERVERS TOPIC GROUP``.

It runs ``Inbox.run`` with the test handler (``apply_effect``: one business row
under a unique constraint, seq order checked; ``apply_effects`` with
``--batch-handler``) against the session's broker,
until SIGTERM, or until SIGKILL when a test wants to see a crash. With
``--async`` the Inbox is built on an AsyncEngine (aiosqlite, asyncpg) and the
handler is an ``async def`` running the same checks on its AsyncSession.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from outbox import Inbox, create_engine
from tests.inbox_support import apply_effect, apply_effects, for_inbox, inbox_bind
from transports.kafka import KafkaSource

# A short session: a killed consumer's partitions move on after this long instead of the 45 s
# default (the test brokers accept sessions down to 1 s: outbox.testing's TEST_SETTINGS).
TEST_CONSUMER_SETTINGS = {"fetch_max_wait_ms": 10, "session_timeout_ms": 4000,
                          "heartbeat_interval_ms": 500}
KIP_848_SETTINGS = {"fetch_max_wait_ms": 10, "group.protocol": "consumer"}
"""The consumer group protocol of KIP-848 (Kafka 4): the broker assigns, and the session and
heartbeat are the broker's settings (the test brokers': 6 s and 0.5 s), not the consumer's."""

GROUP_PROTOCOLS = {"classic": TEST_CONSUMER_SETTINGS, "consumer": KIP_848_SETTINGS}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("servers")
    parser.add_argument("topic")
    parser.add_argument("group")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--batch-handler", action="store_true",
                        help="register apply_effects with @inbox.batch_handler")
    parser.add_argument("--rejoin-after", type=float, default=None,
                        help="KafkaSource's rejoin_after (seconds out of the group before a new consumer)")
    parser.add_argument("--async", dest="asynchronous", action="store_true",
                        help="build the Inbox on an AsyncEngine, with an async def handler")
    parser.add_argument("--group-protocol", choices=sorted(GROUP_PROTOCOLS), default="classic",
                        help="the consumer group protocol: classic, or KIP-848's consumer")
    parser.add_argument("--session-timeout-ms", type=int, default=None,
                        help="the classic protocol's session.timeout.ms (TEST_CONSUMER_SETTINGS' otherwise)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="worker %(process)d %(name)s: %(message)s")
    for name in ("outbox.inbox", "transports.kafka"):  # assignments, revocations
        logging.getLogger(name).setLevel(logging.INFO)
    engine = create_engine(args.db, pool_size=args.concurrency + 2)
    bind = inbox_bind(engine, "async" if args.asynchronous else "sync", pool_size=args.concurrency + 2)
    inbox = Inbox(bind, group=args.group, concurrency=args.concurrency,
                  batch_size=args.batch_size, retry_backoff=0.01)
    if args.batch_handler:
        inbox.batch_handler(args.topic)(for_inbox(inbox, apply_effects))
    else:
        inbox.handler(args.topic)(for_inbox(inbox, apply_effect))
    rejoin = {} if args.rejoin_after is None else {"rejoin_after": args.rejoin_after}
    settings = dict(GROUP_PROTOCOLS[args.group_protocol])
    if args.session_timeout_ms is not None:
        if args.group_protocol != "classic":
            parser.error("--session-timeout-ms: KIP-848's session is the broker's")
        settings["session_timeout_ms"] = args.session_timeout_ms
    source = KafkaSource(bootstrap_servers=args.servers, group_id=args.group,
                         topics=[args.topic], **rejoin, **settings)
    print("ready", flush=True)
    inbox.run(source)
    print("stopped", flush=True)


if __name__ == "__main__":
    main()
