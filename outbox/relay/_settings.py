"""``RelaySettings``: a relay's tuning, checked when it is made, each bad value named by its field."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

import tenacity

from ..core._cloudevents import CloudEvents
from ..core._errors import ConfigurationError
from ..core._validation import validate_topic
from ._exactly_once import DEFAULT_PROGRESS_TOPIC

DEFAULT_BACKOFF = tenacity.wait_exponential_jitter(multiplier=0.2, max=30, jitter=0.2)
"""Delay before a row's attempt n+1: 0.2 s doubling to 30 s, plus up to 0.2 s of jitter."""

MAX_BATCH_SIZE = 100_000

DEFAULT_MAX_BATCH_BYTES = 64 * 2**20
"""Bytes of payload and headers a batch holds at most, plus one row (``max_batch_bytes``).

A batch's memory was its rows times their size: 5,000 rows of a megabyte are five gigabytes,
twice (rows, then records). 64 MiB leaves every batch of typical events whole (5,000 rows of
13 KB) and bounds one of large ones; the first row always comes, whatever its size. The database
counts the bytes in the fetch itself (``RelayStatements.fetch``), so the rows it leaves out never
cross the wire."""

MAX_MAX_BATCH_BYTES = 2**40

DEFAULT_BATCH_SIZE = 5000
"""Rows a relay fetches, sends and marks together by default (``batch_size``).

A batch's fixed cost (the fetch's round trips, the wait for the last acknowledgement, the
marking write) is paid per batch: draining 100,000 rows took 3.1 s in batches of 1,000 and
2.4 s in batches of 5,000 (docs/benchmarks.md, the race with Debezium: 32,000 against 41,600
msg/s, where Debezium's defaults, ``max.batch.size`` 2048, made 20,600-37,700). A relay that
keeps up fetches a few rows a batch whatever this is; it only counts under a backlog. What it
costs there, each in proportion: a batch's memory (rows x their size, twice for rows and
records, up to ``max_batch_bytes``), the rows a crash sends again (up to
three batches: the one in flight and two outcome writes), an exactly-once transaction's size
and its progress record (three batches' ids and the records' positions,
``_progress.check_progress_fits``). A fleet of
tenants keeps 1,000 (``TenantRelay``): its workers take tenants in turn, a batch at a time."""


def default_worker_id() -> str:
    """Host, pid and a random suffix: unique among the relays of one database."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


MAX_SECONDS = 365 * 24 * 3600.0
"""The longest interval a relay takes (a year). Past it the waits and lease times stop being
numbers Python and the database can hold (``Event.wait`` refuses more than ~292 years,
``timedelta`` ~2.7 million years), and ``inf`` would be a lease no dead relay ever loses: refused
here by name rather than at the first lease round."""


def _positive_seconds(name: str, value: object) -> float:
    if (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
            or not value <= MAX_SECONDS):
        raise ConfigurationError(f"{name} must be positive seconds up to {MAX_SECONDS:.0f} (a year), "
                                 f"got {value!r:.80}")
    return float(value)


@dataclass(frozen=True)
class RelaySettings:
    """How one ``Relay`` works; ``Relay(…)``'s keywords of the same names build one.

    Every field is checked here, once: a bad value raises ``ConfigurationError``
    naming the field before the relay touches the database. Seconds are kept as
    floats; an empty ``worker_id`` gets the default.
    """

    batch_size: int = DEFAULT_BATCH_SIZE
    """Rows fetched, sent and marked together (1 to 100,000; ``DEFAULT_BATCH_SIZE``)."""
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES
    """Bytes of payload and headers a batch takes at most, plus one row (``DEFAULT_MAX_BATCH_BYTES``)."""
    worker_id: str = field(default_factory=default_worker_id)
    """Unique among the relays of one database; at most 200 characters."""
    lease_ttl: float = 10.0
    """Seconds a shard lease lives without renewal."""
    poll_interval: float = 0.5
    """Seconds between fetches when nothing wakes the relay; also the first pause after a failed batch."""
    backoff: tenacity.wait.wait_base = DEFAULT_BACKOFF
    """tenacity wait strategy: the delay before a row's attempt n+1."""
    backlog_metrics: bool = False
    """Keep the pending-by-topic and oldest-pending gauges up to date (one GROUP BY per lease period)."""
    wheel_tick: float = 0.02
    """Resolution, in seconds, of the timers of rows waiting for a retry."""
    key_stuck_after: float = 300.0
    """Seconds a key's head may keep being retried before one ``key_stuck`` alert."""
    exactly_once: bool = False
    """Each shard's batch one Kafka transaction with its progress record (``_exactly_once``): no
    crash or zombie relay puts a record on the wire twice for read_committed consumers."""
    progress_topic: str = DEFAULT_PROGRESS_TOPIC
    """Exactly-once mode: the compacted topic of the shards' progress records (created if missing)."""

    def __post_init__(self) -> None:
        size = self.batch_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_BATCH_SIZE:
            raise ConfigurationError(f"batch_size must be an int from 1 to {MAX_BATCH_SIZE}, got {size!r}")
        octets = self.max_batch_bytes
        if isinstance(octets, bool) or not isinstance(octets, int) or not 1 <= octets <= MAX_MAX_BATCH_BYTES:
            raise ConfigurationError(
                f"max_batch_bytes must be an int from 1 to {MAX_MAX_BATCH_BYTES} (2**40), got {octets!r:.80}")
        for name in ("lease_ttl", "poll_interval", "wheel_tick", "key_stuck_after"):
            object.__setattr__(self, name, _positive_seconds(name, getattr(self, name)))
        if not isinstance(self.exactly_once, bool):
            raise ConfigurationError(f"exactly_once must be True or False, got {self.exactly_once!r}")
        validate_topic(self.progress_topic)
        if not callable(self.backoff):
            raise ConfigurationError(f"backoff must be a tenacity wait strategy, got {self.backoff!r}")
        if self.worker_id == "":
            object.__setattr__(self, "worker_id", default_worker_id())
        if not isinstance(self.worker_id, str) or len(self.worker_id) > 200:
            raise ConfigurationError(
                f"worker_id must be a str of at most 200 characters: {self.worker_id!r}")


def cloudevents_mode(setting: CloudEvents | bool) -> CloudEvents | None:
    """``cloudevents=``: True for the default source, a ``CloudEvents`` for a chosen one, False for none."""
    if setting is True:
        return CloudEvents()
    if setting is False or setting is None:
        return None
    if isinstance(setting, CloudEvents):
        return setting
    raise ConfigurationError(f"cloudevents must be True, False or a CloudEvents, got {setting!r:.80}")
