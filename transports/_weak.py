"""Callbacks that hold their owner weakly: for the confluent-kafka clients an owner makes, and for
whatever holds a librdkafka client's owner while its owner holds it.

A client given a bound method of its owner (``error_cb=self._on_error``) makes a cycle, owner →
client → method → owner, so an owner dropped without ``close()`` is freed only by the cycle
collector. confluent-kafka's clients are unsafe there: the collector clears a client (its
callbacks, and the thread-local key its calls use) before destroying it, and does so on whichever
thread allocates, one of librdkafka's own included (confluent-kafka-python issue 1761, segfaults
on collection in a threaded process; a handle destroyed from its own thread aborts). Through
``weakly`` the owner is freed by its reference count, and its clients with it, in the thread that
drops it (``tests/test_transport_kafka_lifetime.py``). A relay's batch runner and its exactly-once
publisher hold each other the same way, transport included, and so use it too, as does a tenant
fleet's registry of tenants, which holds the fleet (and so its transports) through the method that
builds a tenant's step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) as a callback that does not keep its object alive; once the object is gone
    a call does nothing and returns None (its client is being destroyed with it)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    call.__qualname__ = f"weakly({method.__qualname__})"
    return call
