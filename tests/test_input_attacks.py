"""publish()'s input contract against inputs that are not what they claim to be.

Mappings and str/int subclasses whose methods disagree with what they hold, enum
keys, ints and JSON numbers too large for Python to write or read as text: each
is stored as the value the caller's input equals, or refused by name, never
stored unchecked nor escaping as a bare builtin error.
"""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import InvalidHeadersError, InvalidKeyError, Outbox, UnserializablePayloadError


@pytest.fixture
def outbox(tmp_path) -> Outbox:
    outbox = Outbox(sa.create_engine(f"sqlite:///{tmp_path / 'o.db'}"))
    outbox.create_tables()
    return outbox


def stored(outbox: Outbox) -> list[Any]:
    m = outbox.tables.messages
    assert isinstance(outbox.engine, sa.Engine)
    with outbox.engine.connect() as conn:
        return [tuple(row) for row in conn.execute(sa.select(m.c.key, m.c.headers))]


class ItemsHide(dict[str, str]):
    """A dict whose items() shows a clean header while it holds another."""

    def items(self) -> Any:
        return [("h", "clean")]


class GetitemDiffers(Mapping[str, str]):
    """A Mapping whose items() and [] disagree (dict() of a Mapping reads []):"""

    def __getitem__(self, name: str) -> str:
        return "v\ud800"

    def __iter__(self) -> Iterator[str]:
        return iter(["h"])

    def __len__(self) -> int:
        return 1

    def items(self) -> Any:
        return [("h", "clean")]


class AsciiLie(str):
    def isascii(self) -> bool:
        return True


class Color(str, enum.Enum):  # noqa: UP042 -- not StrEnum: its str() is "Color.RED"
    RED = "red"


class Size(int, enum.Enum):
    LARGE = 3


class Renamed(str):
    def __str__(self) -> str:
        return "another key"


@pytest.mark.parametrize("headers", [ItemsHide({"h": "v\ud800"}), GetitemDiffers()],
                         ids=["dict-subclass", "mapping"])
def test_the_headers_stored_are_the_headers_checked(outbox, headers):
    with outbox.begin() as session:
        outbox.publish(session, "t", b"x", headers=headers)
    assert [json.loads(h) if isinstance(h, str) else h for _, h in stored(outbox)] == [{"h": "clean"}]


@pytest.mark.parametrize("args", [{"headers": {"h": AsciiLie("v\ud800")}},
                                  {"headers": {AsciiLie("h\ud800"): "v"}}])
def test_a_str_subclass_cannot_hide_a_lone_surrogate(outbox, args):
    with pytest.raises(InvalidHeadersError, match="lone surrogate"), outbox.begin() as session:
        outbox.publish(session, "t", b"x", **args)
    assert stored(outbox) == []


@pytest.mark.parametrize("key, text", [(Color.RED, "red"), (Size.LARGE, "3"), (Renamed("k"), "k")],
                         ids=["str-enum", "int-enum", "str-subclass"])
def test_a_key_arrives_as_the_value_it_equals(outbox, key, text):
    with outbox.begin() as session:
        outbox.publish(session, "t", b"x", key=key)
    assert [k for k, _ in stored(outbox)] == [text]


def test_an_int_key_too_long_to_write_is_refused_by_name(outbox):
    for key in (10**5000, -(10**300)):
        with pytest.raises(InvalidKeyError, match="more than 255 digits"), outbox.begin() as session:
            outbox.publish(session, "t", b"x", key=key)
    with outbox.begin() as session:
        outbox.publish(session, "t", b"x", key=10**254)
    assert [k for k, _ in stored(outbox)] == [str(10**254)]


def test_a_json_number_no_consumer_can_read_is_refused_by_name(outbox):
    with pytest.raises(UnserializablePayloadError, match="cannot be read back"), outbox.begin() as session:
        outbox.publish(session, "t", {"n": 10**5000, "id": uuid.uuid4()})
    assert stored(outbox) == []


@pytest.mark.parametrize("name, value", [("max_record_bytes", "lots"), ("max_record_bytes", "-5"),
                                         ("max_record_bytes", "0"), ("incarnation", "garbage"),
                                         ("incarnation", ""), ("shard_count", "0")])
def test_a_meta_row_edited_to_garbage_stops_publish_with_the_row_named(tmp_path, name, value):
    """Taken on trust, a negative limit refuses every message by size, and an incarnation
    that is no UUID reaches every envelope, which every consumer then refuses as broken."""
    from outbox import SchemaError, create_engine
    from outbox.core._schema import new_incarnation, read

    url = f"sqlite:///{tmp_path / 'm.db'}"
    Outbox(create_engine(url)).create_tables()
    outbox = Outbox(create_engine(url))
    meta = outbox.tables.meta
    assert isinstance(outbox.engine, sa.Engine)
    with outbox.engine.begin() as conn:
        conn.execute(sa.delete(meta).where(meta.c.name == name))
        conn.execute(sa.insert(meta).values(name=name, value=value))
    with pytest.raises(SchemaError, match=f"outbox_meta's '{name}' row holds"), outbox.begin() as session:
        outbox.publish(session, "t", b"x")
    assert stored(outbox) == []
    if name == "incarnation":  # the documented repair works on the broken row
        new_incarnation(outbox.engine, outbox.tables)
        with outbox.engine.connect() as conn:
            assert str(uuid.UUID(read(conn, outbox.tables).incarnation))


def test_a_nan_a_models_own_serializer_makes_is_refused(outbox: Outbox) -> None:
    """A field_serializer returning NaN is written as null by pydantic: not the value sent."""
    import pydantic

    from outbox import NonStandardJsonError

    class Price(pydantic.BaseModel):
        cents: int

        @pydantic.field_serializer("cents")
        def as_units(self, cents: int) -> float:
            return cents / 100 if cents >= 0 else float("nan")

    class Order(pydantic.BaseModel):
        price: Price
        note: str | None = None

    with outbox.begin() as session:
        outbox.publish(session, "orders", Order(price=Price(cents=250)))  # a null, and no NaN: sent
        for payload in (Price(cents=-1), Order(price=Price(cents=-1))):
            with pytest.raises(NonStandardJsonError, match="NaN or infinity"):
                outbox.publish(session, "orders", payload)
    m, engine = outbox.tables.messages, outbox.engine
    assert isinstance(engine, sa.Engine)
    with engine.connect() as conn:
        payloads = [json.loads(p) for p in conn.scalars(sa.select(m.c.payload))]
    assert payloads == [{"price": {"cents": 2.5}, "note": None}]
