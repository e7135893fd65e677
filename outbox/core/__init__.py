"""The shared floor: what the producer, the relay and the inbox all stand on.

Private modules, re-exported by ``outbox`` where they are public. By role:

- the database: ``_engine`` (engines with the isolation we need), ``_tables``
  (the tables and their statuses), ``_schema`` (schema version, shards,
  upgrades), ``_mysql``, ``_pg_arrays``, ``_notify`` (what NOTIFY says),
  ``_identity`` (a database known by what its server says), ``_sharding``;
- the message: ``_envelope``, ``_wire`` (envelope ↔ record),
  ``_cloudevents``, ``_events`` (typed events), ``_foreign`` (records another
  producer writes), ``_validation`` (checks on every message);
- running: ``_errors``, ``_alerts``, ``_outage`` (a dependency that is down),
  ``_stopping`` (threads and signals), ``_slots`` (what a hung database may
  hold), ``_wheel`` (the timing wheel), ``_tracing``, ``_gc``, ``_secrets``
  (what of a URL may be shown);
- tenants: ``_tenant``, ``_tenant_labels``, ``_schema_claims``,
  ``_metric_views``;
- for the commands and the console: ``_age``, ``_terminal``.

Nothing here imports the producer, the relay, the inbox or anything above them.
"""
