"""The SparkSession the jobs run in: ``local[*]`` unless something else is configured.

Under ``spark-submit`` the master and resources come from the command line and
are left alone; run as a plain Python program the jobs start a local session.
Either way the session works in UTC, so the timestamps read from the
databases (stored in UTC) are never shifted by the machine's time zone.

Two things a first cluster run trips over are settled here: the executors'
Python (``PYSPARK_PYTHON``, this interpreter unless set) is checked with one
tiny task on a non-local master, so a node without the package is named in
one sentence rather than by an executor's ``No module named …``; and Spark's
logging stays at ``log_level`` (WARN) from the start, with the JVM's start-up
notices filtered out of a locally launched driver's stderr (see ``_noise``).

Spark's Kafka source (the wire audit reads the topic through it) is not part of
PySpark: a session this module starts gets the jars ``scripts/setup`` fetched (or
``OUTBOX_SPARK_KAFKA_JARS``) whenever this machine has them. A cluster brings
them itself (``--packages``, ``spark.jars``); ``require_kafka_source`` names
what to do when they are missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping

from py4j.protocol import Py4JError
from pyspark import SparkConf, SparkContext
from pyspark.errors import PySparkException
from pyspark.java_gateway import launch_gateway
from pyspark.sql import SparkSession

from ..core._errors import ConfigurationError
from . import _classcache as classcache
from ._noise import LEVELS, forward_filtered
from ._source import TableSource

DEFAULT_MASTER = "local[*]"
SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"
SessionFactory = Callable[[], SparkSession]
EXECUTOR_MODULES = ("outbox", "sqlalchemy", "pyarrow", "pandas")
_checked: set[str] = set()  # application ids whose executors were probed
DRIVER_JAVA_OPTIONS = "spark.driver.extraJavaOptions"
DRIVER_JAVA_OPTIONS_ENV = "OUTBOX_SPARK_DRIVER_JAVA_OPTIONS"
# The driver JVM a job launches compiles with C1 only: a job is mostly first
# runs of code, where C2's compile time is not paid back (a 20,000-row audit
# runs several seconds faster, a 1,000,000-row one no slower). A driver given
# its own options, or OUTBOX_SPARK_DRIVER_JAVA_OPTIONS (may be empty), keeps them.
FAST_START = "-XX:TieredStopAtLevel=1"
KAFKA_SOURCE_JARS_ENV = "OUTBOX_SPARK_KAFKA_JARS"
KAFKA_SOURCE_CLASS = "org.apache.spark.sql.kafka010.KafkaSourceProvider"
KAFKA_SOURCE_MARKER = "spark-sql-kafka-0-10_*.jar"
KAFKA_SOURCE_HINT = (
    "Spark's Kafka source is not on this Spark's class path: run scripts/setup (it fetches "
    "spark-sql-kafka-0-10 into .jvm/spark-kafka), set OUTBOX_SPARK_KAFKA_JARS to a folder of its "
    "jars, or start Spark with --packages org.apache.spark:spark-sql-kafka-0-10_2.13:VERSION "
    '(docs/spark.md, "The wire audit")'
)


def spark_session(
    master: str | None = None,
    *,
    app_name: str = "outbox",
    config: Mapping[str, str] | None = None,
    log_level: str = "WARN",
    data_source: bool = True,
) -> SparkSession:
    """Return the active session, or build one, with the outbox data source registered.

    ``master`` overrides the configured master (``spark.master`` from
    ``spark-submit`` or ``SPARK_MASTER``); with neither, ``local[*]`` is used.
    ``config`` adds settings for a new session, e.g. ``spark.ui.enabled``.
    ``log_level`` (``ERROR``, ``WARN``, ``INFO``, ``DEBUG``) is Spark's log
    level from its start; below WARN the JVM's start-up notices are shown too.
    ``data_source=False`` leaves ``spark.read.format("outbox_table")`` out: the
    jobs do not read through it, and registering it makes Spark start a Python
    process to look for other data sources (about two seconds).
    Spark's Kafka source goes on a new session's class path whenever this
    machine has its jars (``kafka_source_jars``), whatever the job: a
    process's first job makes the session its later wire audit runs in. An existing session keeps its class
    path (``require_kafka_source`` names what to do then).
    Raises ``ConfigurationError`` when the executors cannot import this package.
    """
    # Python's names too: one OUTBOX_LOG_LEVEL serves the workers and the Spark jobs.
    level = {"WARNING": "WARN", "CRITICAL": "ERROR"}.get(log_level.upper(), log_level.upper())
    if level not in LEVELS:
        raise ConfigurationError(f"log level must be one of {', '.join(LEVELS)}, got {log_level!r}")
    active = SparkSession.getActiveSession()
    if active is not None and master is None:
        spark = active
    else:
        # Executors must run an interpreter that has this package installed, not
        # whatever "python3" is first on their PATH; spark-submit's
        # spark.pyspark.python or a user's PYSPARK_PYTHON wins.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        chosen = master or _configured_master()
        settings = {
            "spark.sql.session.timeZone": "UTC",
            "spark.sql.execution.arrow.pyspark.enabled": "true",
            "spark.ui.showConsoleProgress": "false",  # the CLI draws its own progress on stderr
            **(config or {}),
        }
        if (chosen or "").startswith("local"):
            # A local session talks only to itself: bind to loopback, not the host's address.
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        if chosen is not None:
            settings["spark.master"] = chosen
        if not _under_spark_submit():
            # Always when this machine has the jars: the first job of a process makes its session,
            # and a wire audit later in the same process must find the source on its class path.
            settings = _with_kafka_source(settings)
        spark = _build(app_name, settings, level)
    if data_source:
        spark.dataSource.register(TableSource)
    _check_executors(spark)
    return spark


def session_from(spark: SparkSession | SessionFactory | None) -> SparkSession:
    """The session a job runs in: the one given, one built by the given function, or the default.

    A given session or function decides its class path itself.
    """
    if spark is None:
        return spark_session()
    if isinstance(spark, SparkSession):
        return spark
    return spark()


def kafka_source_jars() -> list[str]:
    """The jars of Spark's Kafka source on this machine, or none.

    The folder ``OUTBOX_SPARK_KAFKA_JARS`` names, else ``.jvm/spark-kafka/libs``
    of the nearest checkout (``scripts/jvm/fetch spark-kafka``).
    """
    from ..testing._kafka_libs import bundle_libs  # the same lookup as the broker's jars

    libs = bundle_libs("spark-kafka", KAFKA_SOURCE_JARS_ENV, KAFKA_SOURCE_MARKER)
    return sorted(str(jar) for jar in libs.glob("*.jar")) if libs is not None else []


def _with_kafka_source(settings: Mapping[str, str]) -> dict[str, str]:
    """``settings`` with the Kafka source's jars added to ``spark.jars``, unless packages bring it."""
    if "spark.jars.packages" in settings:
        return dict(settings)
    given = [jar for jar in settings.get("spark.jars", "").split(",") if jar]
    jars = given + [jar for jar in kafka_source_jars() if jar not in given]
    return {**settings, "spark.jars": ",".join(jars)} if jars else dict(settings)


def require_kafka_source(spark: SparkSession) -> None:
    """Raise ``ConfigurationError`` (one line: what to run) unless Spark can load its Kafka source."""
    assert spark.sparkContext._jvm is not None
    jvm = spark.sparkContext._jvm
    try:
        # The class loader Spark's data source lookup uses: spark.jars land in it.
        loader = jvm.org.apache.spark.util.Utils.getContextOrSparkClassLoader()
        jvm.java.lang.Class.forName(KAFKA_SOURCE_CLASS, False, loader)
    except Py4JError:
        raise ConfigurationError(KAFKA_SOURCE_HINT) from None


def _build(app_name: str, settings: Mapping[str, str], level: str) -> SparkSession:
    """Start the SparkContext at ``level`` (its first lines are logged before that applies)."""
    settings = {"spark.log.level": level, **settings}
    mapped = dump = None
    if SparkContext._active_spark_context is None and not _under_spark_submit() \
            and DRIVER_JAVA_OPTIONS not in settings:
        options = os.environ.get(DRIVER_JAVA_OPTIONS_ENV)
        if options is None:
            options, mapped, dump = classcache.java_options(FAST_START, settings)
        settings[DRIVER_JAVA_OPTIONS] = options
    if SparkContext._active_spark_context is None:
        try:
            context = _start_context(app_name, settings, level)
        except PySparkException:
            if mapped is None:
                raise
            classcache.discard(mapped)  # a damaged class archive: start without it
            settings[DRIVER_JAVA_OPTIONS] = FAST_START
            context = _start_context(app_name, settings, level)
        classcache.finish_at_exit(getattr(context._gateway, "proc", None), dump)
        if not context.getConf().contains(SHUFFLE_PARTITIONS):
            # Spark's 200 shuffle partitions cost seconds of task overhead per
            # stage on small inputs; a few per core keep big ones spread too.
            settings[SHUFFLE_PARTITIONS] = str(2 * context.defaultParallelism)
    builder = SparkSession.builder.appName(app_name)
    for name, value in settings.items():
        builder = builder.config(name, value)
    return builder.getOrCreate()


def _start_context(app_name: str, settings: Mapping[str, str], level: str) -> SparkContext:
    conf = SparkConf().setAppName(app_name).setAll(list(settings.items()))
    gateway = None
    if level in ("ERROR", "WARN") and not _under_spark_submit():
        # Start the JVM ourselves so that its output passes through the filter,
        # onto stderr: stdout is the command's (the report), not the JVM's
        # (a crash report, say, would otherwise land among it).
        gateway = launch_gateway(conf, popen_kwargs={"stdout": subprocess.PIPE,
                                                     "stderr": subprocess.STDOUT})
        forward_filtered(gateway.proc.stdout)
    return SparkContext(conf=conf, gateway=gateway)


def _check_executors(spark: SparkSession) -> None:
    """On a non-local master, run one task that imports what the jobs need, naming what is missing."""
    context = spark.sparkContext
    if (context.master or "local").startswith("local") or context.applicationId in _checked:
        return

    def probe(_: object) -> tuple[str, str | None]:  # nested: pickled by value, needs no outbox
        import importlib
        import sys as executor_sys

        for module in EXECUTOR_MODULES:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                return executor_sys.executable, f"{type(exc).__name__}: {exc}"
        return executor_sys.executable, None

    python = os.environ.get("PYSPARK_PYTHON", "python3")
    try:
        executable, missing = context.parallelize([0], 1).map(probe).collect()[0]
    except (Py4JError, PySparkException) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigurationError(
            f"the executors of {context.master} cannot run Python {python!r} ({first[:300]}); "
            "set PYSPARK_PYTHON (or spark.pyspark.python) to an interpreter every node has, "
            'with "transactional-outbox[spark]" installed (see docs/spark.md, "Run on a cluster")'
        ) from None
    if missing is not None:
        raise ConfigurationError(
            f"the executors' Python {executable} (master {context.master}) lacks the outbox "
            f'environment ({missing}); install "transactional-outbox[spark]" and the database '
            "driver there, or ship a packed environment with --archives and point PYSPARK_PYTHON "
            'at it (see docs/spark.md, "Run on a cluster")'
        )
    _checked.add(context.applicationId)


def _under_spark_submit() -> bool:
    return bool(os.environ.get("PYSPARK_GATEWAY_PORT"))


def _configured_master() -> str | None:
    """None under spark-submit (its JVM already knows the master), else SPARK_MASTER or local[*]."""
    if _under_spark_submit():
        return None
    return os.environ.get("SPARK_MASTER") or DEFAULT_MASTER
