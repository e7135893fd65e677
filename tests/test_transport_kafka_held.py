"""What a wait held by an open transaction says (``transports.kafka._held``), without a broker: the case
a single broker cannot show, a settle held at its own empty record (its abort marker dropped, which
takes a three-node cluster and a killed replica), said precisely, and the partitions and offsets
named in every case."""

from __future__ import annotations

from outbox import HeldByOpenTransactionError, RetriableTransportError
from transports.kafka._held import read_held, settle_held


def test_a_settle_held_at_its_own_empty_record_says_the_transaction_is_its_own() -> None:
    """No other transaction can begin at the offset the settle's own record holds: a last stable
    offset there is this id's own transaction (its marker not written yet, or dropped), and the
    message says so, without the other producer nor a hanging transaction to abort."""
    error = settle_held("outbox-abc-0", {("orders", 3): (42, 42)})
    message = str(error)
    assert isinstance(error, HeldByOpenTransactionError) and isinstance(error, RetriableTransportError)
    assert "orders[3] has its last stable offset at 42, the settle's own empty record" in message
    assert "the transaction open there is this id's own" in message
    assert "another producer" not in message and "find-hanging" not in message


def test_a_settle_held_below_its_record_names_both_causes_and_how_to_end_a_hanging_transaction() -> None:
    error = settle_held("outbox-abc-0", {("payments", 2): (7, 19), ("orders", 3): (42, 42)})
    message = str(error)
    assert "'outbox-abc-0'" in message
    assert "payments[2] has its last stable offset at 7, below the empty record the settle aborted at " \
           "offset 19" in message
    assert "another producer's transaction has been open there since before offset 19" in message
    assert "or the broker dropped this id's own abort marker there" in message
    assert "orders[3] has its last stable offset at 42, the settle's own empty record" in message
    assert "abort --topic payments --partition 2 --start-offset 7" in message


def test_a_progress_read_held_says_whose_transaction_it_is_when_it_looked() -> None:
    foreign = str(read_held(b"outbox-abc-0", "outbox-progress", 0, 5, 9, foreign=True))
    assert "outbox-progress[0]" in foreign and "last stable offset is 5, below the end 9" in foreign
    assert "is another producer's" in foreign and "this id's own" not in foreign
    unknown = str(read_held(b"outbox-abc-0", "outbox-progress", 0, 5, 9, foreign=False))
    assert "either another producer's transaction" in unknown and "this id's own" in unknown


def test_a_settle_held_on_several_partitions_says_how_to_end_each_ones_hanging_transaction() -> None:
    """Held below its record on two partitions (another producer's transaction on each, or a hanging
    one): the relay logs the message once per shard (``_shard_producer.held``), so the commands to
    end a hanging transaction must name every partition held, not only the first: once the operator
    ended that one, nothing more is logged while the shard stays held by the other."""
    message = str(settle_held("outbox-abc-0", {("payments", 2): (7, 19), ("orders", 3): (40, 42)}))
    assert "abort --topic payments --partition 2 --start-offset 7" in message
    assert "abort --topic orders --partition 3 --start-offset 40" in message, message
