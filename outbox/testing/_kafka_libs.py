"""Where the local Apache Kafka's jars (and the other JVM bundles') and a Java runtime are.

``scripts/setup`` fetches the broker's jars from Maven Central into
``.jvm/kafka/libs`` of this checkout (``scripts/jvm/kafka/pom.xml``; the file
``.jvm/kafka/fetched`` marks a complete copy). ``OUTBOX_TEST_KAFKA_LIBS``
names another folder of jars instead: the ``libs/`` of an Apache Kafka 4.x
release works too.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

LIBS_VARIABLE = "OUTBOX_TEST_KAFKA_LIBS"
FETCH_HINT = "run scripts/setup (it fetches the broker's jars from Maven Central into .jvm/kafka)"


def _checkouts() -> list[Path]:
    """The working directory and its parents, then the checkout this package runs from."""
    here = Path.cwd().resolve()
    return [here, *here.parents, Path(__file__).resolve().parents[2]]


def kafka_libs() -> Path | None:
    """The folder of the broker's jars, or None when there is none (``missing()`` says why).

    ``OUTBOX_TEST_KAFKA_LIBS`` when set (a folder holding ``kafka_2.13-*.jar``), else the
    complete ``.jvm/kafka/libs`` of the nearest checkout.
    """
    return bundle_libs("kafka", LIBS_VARIABLE, "kafka_2.13-*.jar")


def bundle_libs(name: str, variable: str, marker: str) -> Path | None:
    """The jars of bundle ``name`` (``scripts/jvm/NAME``), or None when they are not there.

    The folder named by the environment variable ``variable`` when it is set and holds a
    jar matching ``marker``; else the complete ``.jvm/NAME/libs`` of the nearest checkout
    (``.jvm/NAME/fetched`` marks a complete copy).
    """
    if named := os.environ.get(variable):
        libs = Path(named)
        return libs if any(libs.glob(marker)) else None
    for root in _checkouts():
        bundle = root / ".jvm" / name
        if (bundle / "fetched").is_file():
            return bundle / "libs"
    return None


def kafka_version(libs: Path) -> str:
    """The broker's version, read from its jar's name (``kafka_2.13-4.3.0.jar`` → ``4.3.0``)."""
    jar = next(libs.glob("kafka_2.13-*.jar"))
    return jar.name.removeprefix("kafka_2.13-").removesuffix(".jar")


def java() -> str | None:
    """The ``java`` of ``JAVA_HOME``, else the one on PATH, else None."""
    if home := os.environ.get("JAVA_HOME"):
        candidate = Path(home) / "bin" / "java"
        if candidate.is_file():
            return str(candidate)
    return shutil.which("java")


def missing() -> str | None:
    """Why no local Apache Kafka can start here (one line), or None when it can."""
    if java() is None:
        return "no Java runtime for the local Apache Kafka (Kafka 4 needs 17+: openjdk-17-jre-headless)"
    if kafka_libs() is None:
        where = f"in {LIBS_VARIABLE}={named}" if (named := os.environ.get(LIBS_VARIABLE)) else "found"
        return f"no Apache Kafka jars {where}: {FETCH_HINT}, or set {LIBS_VARIABLE} to a folder of them"
    return None
