"""``outbox demo``: an orders service and a billing service talking through the outbox.

Both have their own SQLite database; they meet on the embedded Kafka-protocol
broker. The demo proves its claims rather than assuming them: billing enforces
each order's state machine, one order is poisoned and must park and be
replayed, and the relay is SIGKILLed midway.
"""

from ._scenario import run_demo

__all__ = ["run_demo"]
