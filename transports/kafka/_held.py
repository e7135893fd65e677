"""What a wait held by an open transaction says: ``HeldByOpenTransactionError`` and its message.

A partition's last stable offset (where read_committed readers stop) is the first offset of the
oldest transaction open on it, whoever's. A settle (``KafkaTransactionalProducer.settle``) waits for
it to pass the empty record whose abort ends what its id left open; a take-over's read of a shard's
progress (``_read_back``) waits for it to reach the partition's end. Another producer's long
transaction (another shard on a slow broker, an application with long transactions on a shared
topic: up to the broker's ``transaction.max.timeout.ms``, 15 minutes by default) holds either, as
does a marker of the id's own that the broker dropped. Only DescribeProducers (KIP-664), which
confluent-kafka's AdminClient lacks, tells the two apart; so the wait gives up, and the message says
both. Safety does not depend on it: nothing of the id is committed there until it reads past.
"""

from __future__ import annotations

from collections.abc import Mapping

from .._errors import HeldByOpenTransactionError

HELD_FOR = 2.0
"""Seconds a wait stays held at one last stable offset before it asks why: a read looks whose
transaction it is (``_read_back``), a settle gives up (``HeldByOpenTransactionError``). The
coordinator writes an abort's markers milliseconds after it answers; a partition held this long is
held by a transaction that is not ending now."""

ENDS = ("it ends when that producer commits or aborts it, or at its transaction.timeout.ms: 15 minutes at "
        "most by the broker's default transaction.max.timeout.ms")


def hanging_hint(topic: str, partition: int, stable: int) -> str:
    """How an operator finds and ends a transaction hanging past its timeout at ``stable``."""
    return (f"a transaction open longer than transaction.max.timeout.ms is hanging: `kafka-transactions.sh "
            f"--bootstrap-server <broker> find-hanging --broker-id <the partition's leader>` names it, "
            f"`abort --topic {topic} --partition {partition} --start-offset {stable}` ends it")


def settle_held(transactional_id: str,
                held: Mapping[tuple[str, int], tuple[int, int]]) -> HeldByOpenTransactionError:
    """A settle of ``transactional_id`` whose abort was answered, each partition of ``held`` (its last
    stable offset, the offset of the empty record the settle aborted there) not read past yet.

    A last stable offset at the empty record itself is the id's own transaction: no other can begin
    at an offset the settle's record holds (its marker is not written yet, or was dropped). Below it,
    either another producer's transaction open there since before the record, or the id's own marker
    dropped (module doc)."""
    clauses, foreign = [], []
    for (topic, partition), (stable, record) in sorted(held.items()):
        at = f"{topic}[{partition}] has its last stable offset at {stable}"
        if stable == record:
            clauses.append(f"{at}, the settle's own empty record: the transaction open there is this id's "
                           f"own (no other can begin at that offset), its abort marker not written yet or "
                           f"dropped by the broker")
        else:
            foreign.append((topic, partition, stable))
            clauses.append(f"{at}, below the empty record the settle aborted at offset {record}: either "
                           f"another producer's transaction has been open there since before offset "
                           f"{record} ({ENDS}), or the broker dropped this id's own abort marker there")
    hint = "".join(f"; {hanging_hint(*where)}" for where in foreign)  # each partition's: logged once
    return HeldByOpenTransactionError(
        f"the settle of {transactional_id!r} is held by an open transaction (its abort was answered): "
        f"{'; '.join(clauses)}. The id commits nothing there until the partition reads past that record; "
        f"its next producer settles again{hint}")


def read_held(key: bytes, topic: str, partition: int, stable: int, end: int, *,
              foreign: bool) -> HeldByOpenTransactionError:
    """A read of ``key``'s last committed record held at the last stable offset ``stable`` below the
    ``end`` it must reach; ``foreign``: the record there was looked at and is not the key's (another
    producer's transaction), else whose it is is unknown."""
    where = f"{topic}[{partition}]"
    if foreign:
        whose = (f"the transaction open there since offset {stable} is another producer's (its first record "
                 f"is not this id's): {ENDS}")
    else:
        whose = (f"either another producer's transaction has been open there since offset {stable} ({ENDS}), "
                 f"or one of this id's own the broker left open")
    return HeldByOpenTransactionError(
        f"the read of the progress of {key.decode(errors='replace')!r} on {where} is held by an open "
        f"transaction: "
        f"its last stable offset is {stable}, below the end {end} the read must reach; {whose}. The read is "
        f"tried again; {hanging_hint(topic, partition, stable)}", answered=foreign)
