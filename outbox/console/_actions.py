"""The actions: POSTs that change state, each after ``Context.actor``'s checks and recorded.

Every action needs an operator, a valid CSRF token and a reason; it calls the
owning module's admin API with ``by``/``reason`` where that API keeps them
(a failed row's ``last_error``, a discarded message's ``inbox_messages`` note)
and always writes one line to the ``outbox.console.audit`` log naming who,
what, why and the outcome.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.datastructures import FormData
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ..core._errors import ConfigurationError
from ..core._validation import listed_message_id
from ..inbox import DiscardRefusedError, NotParkedError, ParkedActions
from ..relay import retry_failed, skip_failed
from ._authenticator import SESSION_COOKIE, client_of
from ._context import Context, audit, group_of
from ._groups import database_index
from ._links import base, console_path, cookie_path, link
from ._reads import Unreadable
from ._refused import Refused

Handler = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")
MAX_FORM_ITEMS = 1000


async def _form(request: Request, max_fields: int = MAX_FORM_ITEMS + 10) -> FormData:
    # The body is already bounded (``_limits.BodyLimit``); this bounds the fields parsed from it.
    try:
        return await request.form(max_files=0, max_fields=max_fields)
    except ClientDisconnect:  # hung up (or cut off by the request deadline) mid-body: not our error
        raise Refused(400, "the request ended before its body did") from None


def _back(request: Request, form: FormData, default: str) -> str:
    """Where the result page links back to: a path of this console only (``_links.console_path``)."""
    return console_path(str(form.get("back") or ""), base(request)) or default


def _done(ctx: Context, request: Request, form: FormData, lines: list[str], *, status: int = 200,
          default: str = "") -> Response:
    # Red when the action did not fix what it was for (a replay that left its key parked).
    return ctx.render(request, "result.html", status=status, lines=lines, ok=status < 400,
                      back=_back(request, form, default or base(request) + "/"))


def failed_action(ctx: Context, action: str) -> Handler:
    """Retry or skip the selected failed outbox rows."""
    change = {"retry": retry_failed, "skip": skip_failed}[action]

    async def act(request: Request) -> Response:
        form = await _form(request)
        who, reason = ctx.actor(request, form)
        # Named as listed (a UUID in any spelling is one id), in the audit line too: a search of the
        # log for the id `outbox failed list` shows finds who retried or skipped it and why.
        ids = [listed_message_id(str(i)) for i in form.getlist("message_id")]
        if not ids:
            raise Refused(400, "select at least one failed row")
        what = f"{action} failed rows {ids}{_of_tenant(ctx)} by {who} ({reason})"

        def act_and_record() -> int:
            try:
                n = change(ctx.outbox, ids, by=who, reason=reason)
            except ConfigurationError as exc:
                audit.info("%s: refused: %s", what, exc)
                raise Refused(409, str(exc)) from None
            audit.info("%s: %d changed", what, n)
            return n

        n = await _acted(ctx, 0, what, act_and_record)
        verb = "retried (pending again)" if action == "retry" else "skipped (never sent)"
        return _done(ctx, request, form, [f"{n} failed row(s) {verb} by {who}: {reason}"],
                     default=f"{base(request)}/failed")
    return act


def replay(ctx: Context) -> Handler:
    """Replay the selected parked keys of a group, each in seq order, with the app's handlers."""
    async def act(request: Request) -> Response:
        form = await _form(request)
        who, reason = ctx.actor(request, form)
        group = group_of(request.query_params)
        index = database_index(request.query_params, ctx.databases)
        database = ctx.databases[index].name
        inbox = ctx.inboxes.get((index, group))
        if inbox is None:
            raise Refused(409, f"replay runs group {group}'s handlers: start the console with "
                               f"--app MODULE:ATTRIBUTE naming that Inbox on {database} "
                               f"(or pass it to create_app)")
        lanes = [_lane(v) for v in form.getlist("lane")]
        if not lanes:
            raise Refused(400, "select at least one parked key")
        actions = ParkedActions(inbox, audit=audit, where=database)
        replayed = await _acted(ctx, index, f"replay group {group} in {database} by {who} ({reason})",
                                lambda: actions.replay(lanes, by=who, reason=reason))
        lines = []
        for done in replayed:
            if done.result is None:
                lines.append(f"{done.name}: nothing parked (replayed or discarded meanwhile?)")
            elif done.result.unparked:
                lines.append(f"{done.name}: applied {done.result.applied}, key unparked")
            else:
                lines.append(f"{done.name}: applied {done.result.applied}, still parked "
                             f"{done.result.remaining}, stopped: {done.result.error}")
        lines.append(f"replayed by {who}: {reason}")
        failed = not all(done.unparked for done in replayed)
        return _done(ctx, request, form, lines, status=409 if failed else 200,
                     default=link(base(request), "/parked", group=group, db=index or None))
    return act


def discard(ctx: Context) -> Handler:
    """Discard one parked message for good; the inbox records who and why."""
    async def act(request: Request) -> Response:
        form = await _form(request)
        who, reason = ctx.actor(request, form)
        group = group_of(request.query_params)
        index = database_index(request.query_params, ctx.databases)
        database = ctx.databases[index].name
        # As listed, as ParkedActions records it: this action's own audit lines (not done) name it so too.
        message_id = listed_message_id(str(form.get("message_id") or ""))
        actions = ParkedActions(ctx.inbox_for_discard(index, group), audit=audit, where=database)

        def discarded() -> None:
            try:
                actions.discard(message_id, by=who, reason=reason)
            except (NotParkedError, DiscardRefusedError) as exc:
                raise Refused(409, str(exc)) from None
            except ValueError as exc:
                raise Refused(400, f"not a message id: {message_id!r} ({exc})") from None

        await _acted(ctx, index, f"discard {message_id} group {group} in {database} by {who} ({reason})",
                     discarded)
        return _done(ctx, request, form, [f"message {message_id} discarded by {who}: {reason}"],
                     default=link(base(request), "/parked", group=group, db=index or None))
    return act


async def _acted(ctx: Context, index: int, what: str, act: Callable[[], T]) -> T:
    """``act()`` (which writes its own audit line) on database ``index``; a database that cannot be
    read is an audit line too, and the 503 page. Past the deadline the action goes on: its own
    audit line says how it ended."""
    try:
        return await ctx.read(index, act, write=True)
    except Unreadable as exc:
        if exc.late:
            audit.info("%s: no answer yet, it goes on (a line will say how it ended): %s", what, exc)
        else:
            audit.info("%s: not done: %s", what, exc)
        raise


def _of_tenant(ctx: Context) -> str:
    """``of tenant NAME`` in an audit line of a console of many tenants (a database's name says it
    for the other actions)."""
    return f" of tenant {ctx.tenant}" if ctx.tenant else ""


def _lane(value: Any) -> tuple[str, str | None]:
    try:
        topic, key = json.loads(str(value))
    except (ValueError, TypeError, RecursionError):  # RecursionError: lists nested ~1000 deep
        raise Refused(400, f"not a parked key: {value!r}") from None
    if not isinstance(topic, str) or not (key is None or isinstance(key, str)):
        raise Refused(400, f"not a parked key: {value!r}")
    return topic, key


# -- signing in with the shared token ------------------------------------------------------

def login(ctx: Context) -> Handler:
    async def page(request: Request) -> Response:
        if request.method == "GET":
            return ctx.render(request, "login.html", error=None, token_login=bool(ctx.operators.token))
        form = await _form(request, max_fields=10)
        ctx.check_csrf(request, form)
        name = str(form.get("name") or "").strip()
        if not ctx.auth.token_sign_in(request, str(form.get("token") or "")):
            return ctx.render(request, "login.html", status=401, error="wrong token",
                              token_login=bool(ctx.operators.token))
        if not name or len(name) > 100 or not name.isprintable():  # NUL: PostgreSQL would refuse each action
            return ctx.render(request, "login.html", status=400, token_login=True,
                              error="give your name (1 to 100 printable characters): actions are recorded "
                                    "with it")
        audit.info("signed in: %r from %s", name, client_of(request))
        response = ctx.render(request, "result.html", lines=[f"signed in as {name}"], ok=True,
                              back=base(request) + "/")
        ctx.auth.sessions.end(request.cookies.get(SESSION_COOKIE))  # a new sign-in replaces the old
        response.set_cookie(SESSION_COOKIE, ctx.auth.sessions.start(name), httponly=True, samesite="strict",
                            secure=request.url.scheme == "https", path=cookie_path(request))
        return response
    return page


def logout(ctx: Context) -> Handler:
    async def act(request: Request) -> Response:
        form = await _form(request, max_fields=10)
        ctx.check_csrf(request, form)
        # Ended on the server: a copy of the cookie taken before is worthless from now on.
        ctx.auth.sessions.end(request.cookies.get(SESSION_COOKIE))
        response = ctx.render(request, "result.html", lines=["signed out"], ok=True,
                              back=base(request) + "/")
        response.delete_cookie(SESSION_COOKIE, path=cookie_path(request))
        return response
    return act
