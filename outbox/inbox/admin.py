"""The inbox's read-only admin API: what waits in a consumer group, for operators' tools.

What ``outbox status`` (``outbox.ops``) and the web console (``outbox.console``)
read about the inbox, on a plain connection and outside any consumer
transaction: parked and held keys a page at a time, each page keyset-paged on
an index, and a per-group summary. Changing anything (replay, discard) goes
through ``Inbox.replay`` and ``Inbox.discard``, never through here.
"""

from .storage._pages import (
    GroupBacklog,
    HeldLane,
    ParkedLane,
    held_lanes,
    parked_lanes,
    parked_page,
    parked_unkeyed,
    stuck_by_group,
)

__all__ = [
    "GroupBacklog",
    "HeldLane",
    "ParkedLane",
    "held_lanes",
    "parked_lanes",
    "parked_page",
    "parked_unkeyed",
    "stuck_by_group",
]
