"""This release's version: ``outbox.__version__`` and ``outbox --version``.

It comes from the installed distribution's metadata, so it can never disagree
with what pip reports. A source tree that was never installed (``PYTHONPATH``
pointing at a checkout) has no metadata: then pyproject.toml beside the
package says it, marked ``+source``, and without that ``0+unknown``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path

DISTRIBUTION = "transactional-outbox"


@functools.cache
def version() -> str:
    """The installed distribution's version, or the source tree's, or ``0+unknown``."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return source_version(Path(__file__).resolve().parents[1] / "pyproject.toml")


def source_version(pyproject: Path) -> str:
    """``<version>+source`` from a checkout's pyproject.toml, if it is this project's."""
    try:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return "0+unknown"
    if project.get("name") != DISTRIBUTION or not isinstance(project.get("version"), str):
        return "0+unknown"
    return f"{project['version']}+source"
