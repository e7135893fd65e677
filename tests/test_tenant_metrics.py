"""Metrics by tenant: the label bound, the tenant bound first, gauges combined, both modes at once."""

from __future__ import annotations

from typing import Any

import pytest
from _relay_helpers import ScriptedTransport, publish
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from outbox import ConfigurationError, Disposition, Outbox, Relay, create_engine, relay_metrics
from outbox.inbox import InboxMetrics, tenant_inbox_metrics
from outbox.relay import tenant_relay_metrics
from outbox.tenants import OTHER_TENANTS, TenantLabels

names = st.sampled_from(["acme", "globex", "initech", "umbrella", "hooli", "_other", "a.b-c_1"])


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


@given(seen=st.lists(names, max_size=30), max_tenants=st.integers(1, 4))
def test_the_first_max_tenants_keep_their_name_and_the_rest_share_other(seen: list[str], max_tenants: int
                                                                         ) -> None:
    labels = TenantLabels(max_tenants=max_tenants)
    given_out: dict[str, str] = {}
    for tenant in seen:
        label = labels(tenant)
        kept = {v for v in given_out.values() if v != OTHER_TENANTS}
        expected = given_out.get(tenant) or (
            tenant if tenant == OTHER_TENANTS or len(kept) < max_tenants else OTHER_TENANTS)
        assert label == expected
        given_out[tenant] = label
    assert len(labels.kept) <= max_tenants
    assert labels.kept == {v for v in given_out.values() if v != OTHER_TENANTS}


def test_a_label_function_is_bounded_too_and_a_bad_answer_is_named() -> None:
    labels = TenantLabels(max_tenants=2, label=lambda name: name.split("-")[0])
    assert [labels(t) for t in ("eu-acme", "eu-globex", "us-acme", "ap-acme")] == ["eu", "eu", "us", "_other"]
    with pytest.raises(ConfigurationError, match="gave 'a b' for tenant 'x'"):
        TenantLabels(label=lambda name: "a b")("x")
    bad_bounds: list[Any] = [0, -1, True, 2.5, None]
    for bad in bad_bounds:
        with pytest.raises(ConfigurationError, match="max_tenants"):
            TenantLabels(max_tenants=bad)


def test_relay_families_bind_the_tenant_first_and_past_the_bound_share_other() -> None:
    registry = CollectorRegistry()
    fleet = tenant_relay_metrics(TenantLabels(max_tenants=2), registry)
    acme, globex, initech, hooli = (fleet.for_tenant(t) for t in ("acme", "globex", "initech", "hooli"))
    assert fleet.for_tenant("acme") is acme
    for metrics, count in ((acme, 3), (globex, 5), (initech, 7), (hooli, 11)):
        metrics.published.labels("orders").inc(count)
        metrics.outages.labels("database").inc()
        metrics.batch_duration.observe(0.1)
    name = "outbox_tenant_relay_published_total"
    assert value(registry, name, tenant="acme", topic="orders") == 3
    assert value(registry, name, tenant="globex", topic="orders") == 5
    assert value(registry, name, tenant="_other", topic="orders") == 18  # initech + hooli
    assert value(registry, name, tenant="initech", topic="orders") is None
    assert value(registry, "outbox_tenant_relay_outages_total", tenant="_other", dependency="database") == 2
    assert value(registry, "outbox_tenant_relay_batch_seconds_count", tenant="acme") == 1
    assert value(registry, "outbox_relay_published_total", topic="orders") is None  # plain ones untouched
    tenants = {s.labels["tenant"] for m in registry.collect() for s in m.samples if "tenant" in s.labels}
    assert tenants == {"acme", "globex", "_other"}


def test_gauges_of_tenants_sharing_a_series_combine_and_a_forgotten_tenant_stops_counting() -> None:
    registry = CollectorRegistry()
    fleet = tenant_relay_metrics(TenantLabels(max_tenants=1), registry)
    acme, globex, initech = (fleet.for_tenant(t) for t in ("acme", "globex", "initech"))
    shards = {t: m.shards_owned.labels("w") for t, m in (("acme", acme), ("globex", globex),
                                                         ("initech", initech))}
    shards["acme"].set(16)
    shards["globex"].set(16)
    shards["initech"].set(4)
    shards["globex"].set(8)  # a tenant's new value replaces its old one, not the other tenants'
    globex.oldest_pending_age.set(30)
    initech.oldest_pending_age.set(5)
    assert value(registry, "outbox_tenant_relay_shards_owned", tenant="acme", worker="w") == 16
    assert value(registry, "outbox_tenant_relay_shards_owned", tenant="_other", worker="w") == 12
    assert value(registry, "outbox_tenant_relay_oldest_pending_age_seconds", tenant="_other") == 30  # max
    fleet.forget("globex")
    assert value(registry, "outbox_tenant_relay_shards_owned", tenant="_other", worker="w") == 4
    assert value(registry, "outbox_tenant_relay_oldest_pending_age_seconds", tenant="_other") == 5
    fleet.forget("acme")
    assert value(registry, "outbox_tenant_relay_shards_owned", tenant="acme", worker="w") is None


def test_without_a_tenant_label_tenants_feed_the_plain_families_and_gauges_still_add_up() -> None:
    registry = CollectorRegistry()
    fleet = tenant_relay_metrics(None, registry)
    acme, globex = fleet.for_tenant("acme"), fleet.for_tenant("globex")
    acme.pending.labels("orders").set(10)
    globex.pending.labels("orders").set(5)
    acme.pending.labels("orders").set(1)
    acme.published.labels("orders").inc(2)
    globex.published.labels("orders").inc(3)
    assert value(registry, "outbox_relay_pending", topic="orders") == 6
    assert value(registry, "outbox_relay_published_total", topic="orders") == 5
    assert not [m for m in registry.collect() if m.name.startswith("outbox_tenant_")]
    with pytest.raises(ConfigurationError, match="tenant name"):
        fleet.for_tenant("no spaces")


def test_a_single_tenant_relay_and_a_fleet_run_side_by_side_in_one_registry(outbox: Outbox, tmp_path
                                                                              ) -> None:
    """Real ``Relay`` objects, unchanged, feed a tenant's view: every call the relay makes is answered."""
    registry = CollectorRegistry()
    fleet = tenant_relay_metrics(TenantLabels(max_tenants=10), registry)
    publish(outbox, "orders", ["a", "b"])
    single = Relay(outbox, ScriptedTransport(), metrics=relay_metrics(registry), worker_id="w")
    tenant_outbox = Outbox(create_engine(f"sqlite:///{tmp_path / 'acme.db'}"))
    tenant_outbox.create_tables()
    publish(tenant_outbox, "orders", ["a", "b", "c"])
    acme = Relay(tenant_outbox, ScriptedTransport(), metrics=fleet.for_tenant("acme"), worker_id="w")
    for relay in (single, acme):
        relay.refresh_backlog_metrics()
        relay.run_once()
        relay.close()
    assert value(registry, "outbox_relay_published_total", topic="orders") == 2
    assert value(registry, "outbox_tenant_relay_published_total", tenant="acme", topic="orders") == 3
    assert value(registry, "outbox_tenant_relay_shards_owned", tenant="acme", worker="w") == 16
    assert value(registry, "outbox_tenant_relay_batch_seconds_count", tenant="acme") == 1
    assert value(registry, "outbox_tenant_relay_pending", tenant="acme", topic="orders") == 3
    assert value(registry, "outbox_relay_pending", topic="orders") == 2
    assert value(registry, "outbox_tenant_relay_oldest_pending_age_seconds", tenant="acme") is not None


def test_inbox_metrics_per_tenant_bind_tenant_then_group_and_share_other() -> None:
    registry = CollectorRegistry()
    fleet = tenant_inbox_metrics("billing", TenantLabels(max_tenants=1), registry)
    plain = InboxMetrics("billing", registry)  # a single-tenant Inbox in the same process and registry
    acme, globex, initech = (fleet.for_tenant(t) for t in ("acme", "globex", "initech"))
    for metrics in (acme, globex, initech, plain):
        metrics.consumed("orders", 2)
        metrics.counted("orders", Disposition.APPLIED)
        metrics.parked("orders", "failed")
        metrics.ran("orders", 0.01, failed=True)
    acme.parked_keys(1)
    globex.parked_keys(2)
    initech.parked_keys(4)
    plain.parked_keys(9)
    globex.commit_lag("orders", 0, 5)
    initech.commit_lag("orders", 0, 6)
    both = {"group": "billing", "topic": "orders"}
    assert value(registry, "outbox_tenant_inbox_consumed_total", tenant="acme", **both) == 2
    assert value(registry, "outbox_tenant_inbox_consumed_total", tenant="_other", **both) == 4
    assert value(registry, "outbox_tenant_inbox_handled_total", tenant="_other", **both) == 2
    assert value(registry, "outbox_tenant_inbox_parked_total", tenant="_other", reason="failed", **both) == 2
    assert value(registry, "outbox_tenant_inbox_failed_attempts_total", tenant="acme", **both) == 1
    assert value(registry, "outbox_tenant_inbox_parked_keys", tenant="acme", group="billing") == 1
    assert value(registry, "outbox_tenant_inbox_parked_keys", tenant="_other", group="billing") == 6
    assert value(registry, "outbox_tenant_inbox_commit_lag", tenant="_other", partition="0", **both) == 11
    assert value(registry, "outbox_inbox_consumed_total", **both) == 2
    assert value(registry, "outbox_inbox_parked_keys", group="billing") == 9
    fleet.forget("initech")
    assert value(registry, "outbox_tenant_inbox_parked_keys", tenant="_other", group="billing") == 2


def test_an_inbox_without_a_tenant_label_adds_its_tenants_up_in_the_group() -> None:
    registry = CollectorRegistry()
    fleet = tenant_inbox_metrics("audit", None, registry)
    fleet.for_tenant("acme").parked_keys(3)
    fleet.for_tenant("globex").parked_keys(4)
    fleet.for_tenant("globex").consumed("orders")
    assert value(registry, "outbox_inbox_parked_keys", group="audit") == 7
    assert value(registry, "outbox_inbox_consumed_total", group="audit", topic="orders") == 1


def test_a_fresh_registry_gets_fresh_collectors_even_where_a_dead_one_lived() -> None:
    """Collectors are cached per registry; a new registry at a dead one's address must not get its."""
    for _ in range(20):
        registry = CollectorRegistry()
        relay_metrics(registry).published.labels("t").inc()
        tenant_relay_metrics(TenantLabels(), registry).for_tenant("a").published.labels("t").inc()
        tenant_inbox_metrics("g", TenantLabels(), registry).for_tenant("a").consumed("t")
        assert value(registry, "outbox_relay_published_total", topic="t") == 1
        assert value(registry, "outbox_tenant_relay_published_total", tenant="a", topic="t") == 1
        assert value(registry, "outbox_tenant_inbox_consumed_total", tenant="a", group="g", topic="t") == 1
        del registry
