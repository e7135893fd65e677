"""``--dist loadgroup`` under pytest 9: the group back into each grouped test's node id.

pytest-xdist (3.8) tells the controller a test's group by renaming it ``ID@GROUP`` in the
worker, through ``item._nodeid``; pytest 9 reads a node's id from ``item._id`` instead, so the
rename is lost, every test is its own unit and a group's tests run on every worker at once:
three Spark sessions instead of one, up to nine Kafka JVMs of three clusters at once, the
``timing`` tests beside each other (docs/testing.md). This plugin makes the rename where pytest
reads it, after pytest-xdist's own hook (a no-op where that one worked). ``tests/conftest.py``
registers it; a module of its own so that a test can load it alone (``-p _xdist_groups``,
``tests/test_xdist_groups.py``).
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):  # set in xdist's workers only
        return
    for item in items:
        names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                        for mark in item.iter_markers("xdist_group")})
        suffix = f"@{'_'.join(names)}"
        if not names or item.nodeid.endswith(suffix):
            continue
        node_id = getattr(item, "_id", None)
        if node_id is None:
            item._nodeid = item.nodeid + suffix  # type: ignore[attr-defined]
        else:
            item._id = type(node_id).parse(item.nodeid + suffix)  # type: ignore[attr-defined]
