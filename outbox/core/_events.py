"""Typed events: the event type of a pydantic model class, its versions, aliases and upcasters.

A model published with ``publish()`` is sent with an event type (the
``event_type`` column, the ``outbox-event-type`` header); a typed handler
(``@inbox.handler("orders", OrderPaid)``) is chosen by it. The type is the
class's ``__name__`` unless the class is registered with ``@event``::

    @outbox.event("orders.OrderPaid", version=2, aliases=("OrderPaid",))
    class OrderPaid(pydantic.BaseModel): ...

Version 1 is sent as the name itself, version *n* > 1 as ``{name}.v{n}``: a
version is a new type on the wire, so a consumer that does not know it parks
it (``Reason.UNKNOWN_EVENT``) instead of misreading it. A consumer on version
*n* still reads what older producers wrote: each older version it was given an
upcaster for (``@outbox.upcaster(OrderPaid, from_version=1)``, a function from
the old JSON object to the next version's) and each alias (a type's old name)
reads as the model. docs/producer.md, "Evolving an event", says when a change
needs a version and when it does not (a new optional field does not).

Register at import time, before a handler of the model is registered: an
inbox reads the registry once, when its handler is registered.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pydantic

from ._errors import ConfigurationError
from ._validation import checked_event_type

M = TypeVar("M", bound=type[pydantic.BaseModel])
Upcaster = Callable[[Any], Any]
"""From the JSON value of one version (a dict, as ``json.loads`` made it) to the next version's."""


@dataclass(frozen=True)
class EventSpec:
    """How one model class is named on the wire, and which older forms it reads."""

    model: type[pydantic.BaseModel]
    name: str
    version: int = 1
    aliases: tuple[str, ...] = ()
    upcasters: dict[int, Upcaster] = field(default_factory=dict)
    """``{v: fn}``: ``fn`` turns version ``v``'s JSON into version ``v + 1``'s."""

    @property
    def event_type(self) -> str:
        """What ``publish()`` sends for this model: the name, ``.v{n}`` from version 2 on."""
        return versioned(self.name, self.version)


def versioned(name: str, version: int) -> str:
    return name if version == 1 else f"{name}.v{version}"


_SPECS: dict[type, EventSpec] = {}
_TYPES: dict[type, str] = {}  # model class -> its event type, what publish() looks up


def event(name: str | None = None, *, version: int = 1,
          aliases: Iterable[str] = ()) -> Callable[[M], M]:
    """Register a pydantic model class as an event: its type name, version and old names.

    ``name`` defaults to the class's ``__name__``; ``version`` (1, 2, …) is
    bumped for a change an older consumer would misread, and becomes part of
    the type (``orders.OrderPaid.v2``). ``aliases`` are type names this model
    also reads as itself (the names it had before a rename), never sent.
    """
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= 10_000:
        raise ConfigurationError(f"event version must be an int from 1 to 10000, got {version!r}")
    old_names = tuple(aliases) if not isinstance(aliases, str) else (aliases,)

    def register(model: M) -> M:
        if not (isinstance(model, type) and issubclass(model, pydantic.BaseModel)):
            raise ConfigurationError(f"@outbox.event registers pydantic model classes, got {model!r}")
        spec = EventSpec(model, _checked(name if name is not None else model.__name__),
                         version, tuple(_checked(a) for a in old_names))
        _checked(spec.event_type)
        older = [a for a in spec.aliases if a in {versioned(spec.name, v) for v in range(1, version)}]
        if older:  # an alias is read as is: it would bypass the upcasters of that version
            raise ConfigurationError(
                f"alias(es) {older} of {model.__name__} name its own older version(s): an older "
                "version is read through an upcaster (@outbox.upcaster; one returning its argument "
                "if the JSON did not change), not as an alias")
        _refuse_a_second_class(model, spec.event_type)
        previous = _SPECS.get(model)
        if previous is not None:
            spec.upcasters.update(previous.upcasters)
        _SPECS[model] = spec
        _TYPES[model] = spec.event_type
        return model

    return register


def _refuse_a_second_class(model: type, event_type: str) -> None:
    """Refuse ``event_type`` when another registered class already sends it.

    Two classes under one name on the wire would have a handler of one read
    the other's payloads, silently, whenever their fields happen to fit. The
    same class defined again (a module reloaded, a class made in a function,
    a module run as ``__main__`` and imported too) has the same qualified name
    and module, and is not another class.
    """
    for other, spec in _SPECS.items():
        if spec.event_type == event_type and other is not model and not _same_definition(other, model):
            raise ConfigurationError(
                f"event type {event_type!r} is already sent by {other.__module__}.{other.__qualname__}:"
                f" {model.__module__}.{model.__qualname__} needs another name or version (two "
                "classes under one type would be read as each other)")


def _same_definition(a: type, b: type) -> bool:
    modules = {a.__module__, b.__module__}
    return a.__qualname__ == b.__qualname__ and (len(modules) == 1 or "__main__" in modules)


def upcaster(model: type[pydantic.BaseModel], *, from_version: int) -> Callable[[Upcaster], Upcaster]:
    """Register ``fn(old_json) -> new_json`` taking ``model``'s version ``from_version`` to the next.

    A consumer of ``model`` at version *n* then reads every version from the
    lowest with an unbroken chain of upcasters up to *n*.
    """
    spec = spec_of(model)
    if isinstance(from_version, bool) or not isinstance(from_version, int) \
            or not 1 <= from_version < spec.version:
        raise ConfigurationError(
            f"{model.__name__} is version {spec.version}: an upcaster goes from a version "
            f"1..{spec.version - 1} to the next, got from_version={from_version!r}")

    def register(fn: Upcaster) -> Upcaster:
        if not callable(fn):
            raise ConfigurationError(f"an upcaster must be callable, got {fn!r}")
        spec.upcasters[from_version] = fn
        return fn

    return register


def spec_of(model: type[pydantic.BaseModel]) -> EventSpec:
    """The registered spec of ``model``, or the default one (its ``__name__``, version 1)."""
    spec = _SPECS.get(model)
    if spec is None:
        if not (isinstance(model, type) and issubclass(model, pydantic.BaseModel)):
            raise ConfigurationError(f"an event type is a pydantic model class, got {model!r}")
        spec = EventSpec(model, _checked(model.__name__))
    return spec


def event_type_of(model: type[pydantic.BaseModel]) -> str:
    """The event type ``publish()`` sends for an instance of ``model``: a dict lookup once known."""
    known = _TYPES.get(model)
    if known is None:
        known = spec_of(model).event_type
        if len(_TYPES) < 4096:
            _TYPES[model] = known
    return known


def known_event_type(kind: type) -> str | None:
    """The event type of ``kind`` if it is a model class seen before, else None: one dict lookup."""
    return _TYPES.get(kind)


def _checked(name: object) -> str:
    try:
        return checked_event_type(name)[0]
    except ValueError as exc:
        raise ConfigurationError(f"invalid event type name: {exc}") from None


class EventReader:
    """Reads a message's payload as one model, from every event type the model accepts.

    Built once per typed handler, from the registry as it is then.
    """

    __slots__ = ("accepts", "model")

    def __init__(self, model: type[pydantic.BaseModel]) -> None:
        spec = spec_of(model)
        self.model = model
        chains: dict[str, tuple[Upcaster, ...]] = {spec.event_type: ()}
        for alias in spec.aliases:
            chains.setdefault(alias, ())
        chain: tuple[Upcaster, ...] = ()
        for older in range(spec.version - 1, 0, -1):
            step = spec.upcasters.get(older)
            if step is None:
                break  # no way up from here, nor from any version below it
            chain = (step, *chain)
            chains.setdefault(versioned(spec.name, older), chain)
        self.accepts: Mapping[str, tuple[Upcaster, ...]] = chains

    def read(self, event_type: str, payload: bytes) -> pydantic.BaseModel:
        """The validated model; raises ``pydantic.ValidationError``, or ``UpcastError`` when an
        upcaster raised."""
        chain = self.accepts[event_type]
        if not chain:
            return self.model.model_validate_json(payload)
        data = json.loads(payload)
        for step in chain:
            try:
                data = step(data)
            except Exception as exc:
                # An upcaster is a function of the payload: what it raises on one payload it
                # raises on every retry, so the payload is invalid, not the attempt unlucky.
                raise UpcastError(f"upcaster {getattr(step, '__qualname__', step)!s} raised "
                                  f"{exc!r}") from exc
        return self.model.model_validate(data)


class UpcastError(ValueError):
    """An upcaster raised on a message's payload: the payload is an invalid event."""
