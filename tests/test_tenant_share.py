"""``--tenant-share K/N``: several fleet processes serve each tenant from one of them.

The shares of one source partition its tenants whatever they are; a tenant's share is its name's
and nothing else's (not the order, not the other tenants, not the process or the release); what the
command cannot use is refused in one line before anything connects.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_tenant_switching import _fleet_command
from typer.testing import CliRunner

from outbox import ConfigurationError
from outbox.cli import app
from outbox.tenants import MAX_TENANT_NAME, Tenant, TenantShare, from_file, share_of, shared

NAMES = st.from_regex(rf"[A-Za-z0-9_][A-Za-z0-9_.\-]{{0,{MAX_TENANT_NAME - 1}}}", fullmatch=True)


@given(names=st.lists(NAMES, unique=True, max_size=60), count=st.integers(1, 64), data=st.data())
def test_the_shares_of_a_source_serve_each_of_its_tenants_once(names: list[str], count: int,
                                                              data: st.DataObject) -> None:
    tenants = [Tenant(name=name, schema=f"s{i}") for i, name in enumerate(names)]
    shares = [shared(lambda: tenants, TenantShare(index, count))() for index in range(count)]
    served = [tenant for share in shares for tenant in share]
    assert sorted(t.name for t in served) == sorted(names)  # every tenant, none twice
    for share in shares:  # in the source's order
        assert share == [t for t in tenants if t in share]
    # A tenant's share is its name's: the same in any order, beside any other tenants.
    others = data.draw(st.permutations(tenants[: len(tenants) // 2]))
    for index in range(count):
        again = shared(lambda: others, TenantShare(index, count))()
        assert {t.name for t in again} == {t.name for t in shares[index] if t in others}


def test_a_tenants_share_is_the_same_in_every_release() -> None:
    """The digest is fixed (BLAKE2b of the name, 8 bytes, big-endian, modulo the count): processes of
    two releases during an upgrade must agree. Changed, these values move tenants between processes."""
    assert [share_of(name, 2) for name in ("acme", "globex", "initech", "t_000", "t_001")] == [1, 0, 0, 1, 1]
    assert [share_of(name, 7) for name in ("acme", "globex", "initech", "t_000", "t_001")] == [4, 6, 5, 3, 3]
    assert share_of("acme", 1) == 0


def test_a_source_listing_a_tenant_twice_is_refused_in_every_share(tmp_path) -> None:
    """Not only in the process whose share holds the duplicate: each would otherwise serve another
    reading of the source."""
    spec = tmp_path / "tenants.json"
    spec.write_text(json.dumps(["acme", "globex", "acme"]))
    for index in range(3):
        with pytest.raises(ConfigurationError, match="listed twice"):
            shared(from_file(spec), TenantShare(index, 3))()


@pytest.mark.parametrize("text, says", [
    ("2/2", "tenant share 2 of 2: give 0 to 1"),
    ("0/0", "count 0: give 1 to 1024"),
    ("0/1025", "count 1025: give 1 to 1024"),
    ("-1/2", "give K/N"), ("1", "give K/N"), ("1/2/3", "give K/N"), ("a/b", "give K/N"),
    ("\uff11/2", "give K/N"),  # full-width: str.isdigit takes it, the option does not
])
def test_a_share_that_is_not_k_of_n_is_refused_naming_it(text: str, says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        TenantShare.parse(text)


def test_the_fleet_command_serves_its_share_of_the_tenants(tmp_path, monkeypatch) -> None:
    """The command's fleet reads the whole source and serves the share (``TenantRelay(share=)``)."""
    given: list[object] = []
    for share in ("0/2", "1/2"):
        _fleet_command(tmp_path, monkeypatch, lambda fleet: given.append(fleet.share),
                       "--tenant-share", share)
    _fleet_command(tmp_path, monkeypatch, lambda fleet: given.append(fleet.share))
    assert given == [TenantShare(0, 2), TenantShare(1, 2), None]


def test_a_share_of_a_bool_or_a_list_source_is_taken_as_what_it_is() -> None:
    """``True`` is an int to Python, not a share number; a plain list is a source like any other."""
    given: list[tuple[Any, Any]] = [(True, 2), (0, True), (0.0, 2)]  # what untyped callers may pass
    for index, count in given:
        with pytest.raises(ConfigurationError):
            TenantShare(index, count)
    assert [t.name for t in shared(["acme", "globex"], TenantShare(0, 2))()] == ["globex"]


@pytest.mark.parametrize("args, says", [
    (["--tenant-share", "0/2"], "needs --tenants"),
    (["--tenants", "acme", "--tenant-share", "2/2"], "tenant share 2 of 2"),
    (["--tenants", "acme", "--tenant-share", "half"], "give K/N"),
])
def test_a_share_the_command_cannot_use_is_refused_in_one_line(tmp_path, args, says) -> None:
    """Before anything connects (the broker here answers nothing)."""
    result = CliRunner().invoke(app, ["relay", "--db", f"sqlite:///{tmp_path / 'r.db'}",
                                      "--bootstrap-servers", "127.0.0.1:9", *args])
    assert result.exit_code == 2, result.output
    assert says in result.output and "--tenant-share" in result.output, result.output
