"""The inbox in front of a FastStream Kafka subscriber, for services that already run FastStream.

``subscribe(broker, inbox)`` adds one subscriber for the inbox's topics whose
body is ``Inbox.handle``; ``sweeping(inbox)`` parks gaps that never fill while
the app runs. The handlers stay registered on the inbox (``@inbox.handler``),
so replay, discard and the sweep run them outside FastStream too. See the
FastStream section of docs/consumer.md.
"""

try:
    import faststream  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        'outbox.faststream needs FastStream: pip install "transactional-outbox[faststream]" '
        '(confluent-kafka), or faststream[kafka] for the aiokafka broker'
    ) from exc

from ._records import record_of
from ._subscriber import subscribe
from ._sweep import sweeping

__all__ = ["record_of", "subscribe", "sweeping"]
