"""Broker transports for the outbox relay and the inbox.

The protocols here use primitive types only; ``transports.kafka`` (needs the
``kafka`` extra) and ``transports.kafka_python`` (needs ``kafka-python``)
implement them.
"""

from ._protocol import (
    Outcome,
    ReadBack,
    Record,
    RevokeCallback,
    SendResult,
    Source,
    SourceFeatures,
    TransactionalProducer,
    TransactionOutcome,
    TransactionResult,
    Transactions,
    Transport,
    TransportFeatures,
    Uncommitted,
    source_features,
    transport_features,
)

__all__ = ["Outcome", "ReadBack", "Record", "RevokeCallback", "SendResult", "Source", "SourceFeatures",
           "TransactionOutcome", "TransactionResult", "TransactionalProducer", "Transactions",
           "Transport", "TransportFeatures", "Uncommitted", "source_features", "transport_features"]
