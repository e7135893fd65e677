"""The jobs on a real standalone cluster (master + worker from PySpark's spark-class) agree with local.

Every job here runs as a user runs it on a cluster, in its own process: the
documented ``spark-submit`` command for the audit, ``outbox spark … --master
spark://…`` for archive and replay. Each result is compared with the same job
run on ``local[2]`` over an identical copy of the data. The archive's two
ways of losing rows on a cluster are proved closed: a relative (or any local)
path is refused unless declared shared, and a path declared shared that the
executors do not in fact share deletes nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from _spark_cluster import BIN, Cluster, private_mounts_work, standalone_cluster
from _spark_seed import AS_OF, build, seed, spark_for_tests
from conftest import unavailable

from outbox import OutboxTables
from outbox.spark import REPLAY_HEADER, archive, audit, replay
from outbox.spark._layout import committed_files

# A group of its own: the jobs run on the standalone cluster and in processes of their own, so
# this file need not wait behind the other Spark tests on the worker that holds their session.
pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.xdist_group("spark-cluster")]
TABLES = OutboxTables()
JOB_TIMEOUT = 600


@pytest.fixture(scope="session")
def cluster(java_home, tmp_path_factory):
    with standalone_cluster(tmp_path_factory.mktemp("spark-cluster"), private=private_mounts_work()) as c:
        yield c


@pytest.fixture(scope="module")
def spark(java_home):
    return spark_for_tests()


def run(cluster: Cluster, args: list[str], cwd: Path | None = None,
        **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=cluster.env(**env), capture_output=True, text=True,
                          timeout=JOB_TIMEOUT)


def outbox_spark(cluster: Cluster, *args: str, cwd: Path | None = None, **env: str):
    """``outbox spark ARGS --master spark://…`` in its own process, as a user types it."""
    return run(cluster, [str(BIN / "outbox"), "spark", *args, "--master", cluster.master], cwd, **env)


class Job:
    """A job started on the cluster in its own process, to finish while the same job runs on
    ``local[2]`` in this one (the two over separate copies of the data): the cluster's JVMs
    start while the local job works instead of after it."""

    def __init__(self, cluster: Cluster, args: list[str], output: Path, cwd: Path | None = None) -> None:
        self.args, self.out, self.err = args, output.with_suffix(".out"), output.with_suffix(".err")
        with self.out.open("w") as out, self.err.open("w") as err:  # files: a pipe nobody reads fills
            self.process = subprocess.Popen(args, cwd=cwd, env=cluster.env(), stdout=out, stderr=err,
                                            text=True)

    def finished(self) -> subprocess.CompletedProcess:
        try:
            self.process.wait(JOB_TIMEOUT)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        return subprocess.CompletedProcess(self.args, self.process.returncode, self.out.read_text(),
                                           self.err.read_text())


def outbox_spark_job(cluster: Cluster, *args: str, output: Path, cwd: Path | None = None) -> Job:
    """``outbox_spark`` started, not waited for."""
    return Job(cluster, [str(BIN / "outbox"), "spark", *args, "--master", cluster.master], output, cwd)


def rows(url: str, table: sa.Table) -> list[dict]:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        found = [dict(r) for r in conn.execute(sa.select(table).order_by(*table.primary_key)).mappings()]
    engine.dispose()
    return found


def seeded_pair(directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{directory / 'db.db'}"
    seed(build(n=3_000, keys=30), url, url)
    return url


def archived(root: Path) -> list[dict]:
    """Every committed archived row, sorted, without the file it sits in."""
    found = []
    for path in committed_files(root, "outbox_messages"):
        topic, day = (part.split("=", 1)[1] for part in path.parts[-3:-1])
        found += [r | {"topic": topic, "date": day} for r in pq.read_table(path).to_pylist()]
    return sorted(found, key=lambda r: r["id"])


def test_audit_by_spark_submit_on_the_cluster_equals_local(cluster, spark, tmp_path):
    """The docs' spark-submit command: same summary and lists as local; only the report on stdout."""
    sc = build(n=3_000, keys=30)
    producer, consumer = f"sqlite:///{tmp_path / 'orders.db'}", f"sqlite:///{tmp_path / 'billing.db'}"
    seed(sc, producer, consumer)
    shared = tmp_path / "audit-cluster"
    entry = subprocess.run([cluster.python, "-c", "import outbox.spark.__main__ as m; print(m.__file__)"],
                           capture_output=True, text=True, check=True).stdout.strip()

    job = Job(cluster, [str(BIN / "spark-submit"), "--master", cluster.master,
                        "--deploy-mode", "client", entry,
                        "audit", "--outbox-db", producer, "--inbox-db", consumer,
                        "--out", str(shared), "--shared-storage", "--sla", "10m",
                        "--as-of", AS_OF.isoformat()], tmp_path / "submitted")
    try:
        local = audit(producer, consumer, out_dir=tmp_path / "audit-local", sla="10m", as_of=AS_OF,
                      spark=spark)
    finally:
        submitted = job.finished()

    assert submitted.returncode == 1, submitted.stderr[-3000:]  # the scenario loses messages
    assert submitted.stdout == (shared / "report.md").read_text() + "\n"  # nothing but the report
    # SparkContext logs version, OS and Java before spark.log.level applies; then nothing.
    assert submitted.stderr.count(" INFO ") <= 3, submitted.stderr[:3000]
    assert json.loads((shared / "summary.json").read_text()) == local.summary
    assert local.totals["lost"] == sum(len(v) for v in sc.lost.values())
    for name in ("lost", "duplicates", "out_of_order"):
        assert pq.read_table(shared / name).to_pylist() == pq.read_table(local.path(name)).to_pylist()


def test_archive_and_replay_on_the_cluster_equal_local(cluster, spark, tmp_path):
    """Relative archive dir declared shared: resolved on the driver, same rows as local, replayable."""
    on_cluster, on_local = seeded_pair(tmp_path / "c"), seeded_pair(tmp_path / "l")

    job = outbox_spark_job(cluster, "archive", "--db", on_cluster, "--archive-dir", "arch", "--retention",
                           "1d", "--chunk-rows", "700", "--shared-storage", output=tmp_path / "moved",
                           cwd=tmp_path / "c")
    try:
        result = archive(on_local, tmp_path / "l" / "arch", retention="1d", chunk_rows=700, spark=spark)
    finally:
        moved = job.finished()

    assert moved.returncode == 0, moved.stderr[-3000:]
    count = result.archived["outbox_messages"]
    assert count > 2_000
    assert moved.stdout == f"outbox_messages: archived {count:,}, deleted {count:,}\n"
    assert archived(tmp_path / "c" / "arch") == archived(tmp_path / "l" / "arch")
    assert rows(on_cluster, TABLES.messages) == rows(on_local, TABLES.messages)
    assert not list(cluster.work_dir.rglob("*.parquet")), "chunks left in an executor's scratch space"

    job = outbox_spark_job(cluster, "replay", "--archive-dir", "arch", "--db", on_cluster, "--topic",
                           "orders", "--shared-storage", output=tmp_path / "replayed", cwd=tmp_path / "c")
    try:
        again = replay(tmp_path / "l" / "arch", on_local, topic="orders", spark=spark)
    finally:
        replayed = job.finished()

    assert replayed.returncode == 0, replayed.stderr[-3000:]
    assert f"replayed {again.replayed:,} message(s) of orders" in replayed.stdout
    assert again.replayed > 1_000

    def new_messages(url: str) -> list[tuple]:
        return [(r["key"], r["seq"], r["payload"], r["headers"][REPLAY_HEADER])
                for r in rows(url, TABLES.messages) if REPLAY_HEADER in r["headers"]]
    assert new_messages(on_cluster) == new_messages(on_local)
    assert len(new_messages(on_cluster)) == again.replayed


def test_relative_archive_dir_on_a_cluster_is_refused_and_nothing_is_lost(cluster, tmp_path):
    """Issue 17: `--archive-dir arch` on spark:// deleted rows it had written to a worker's scratch."""
    url = seeded_pair(tmp_path)
    before = rows(url, TABLES.messages)

    refused = outbox_spark(cluster, "archive", "--db", url, "--archive-dir", "arch", "--retention", "1d",
                           cwd=tmp_path)

    assert refused.returncode == 2, refused.stdout + refused.stderr[-3000:]
    assert f"archive_dir {tmp_path / 'arch'} is a path on this machine" in refused.stderr
    assert "--shared-storage" in refused.stderr and "Traceback" not in refused.stderr
    assert rows(url, TABLES.messages) == before
    assert not list(cluster.work_dir.rglob("*.parquet"))


def test_a_root_declared_shared_that_is_not_deletes_nothing(cluster, tmp_path):
    """The executors write to their own disk under the same path: the driver's read-back fails first."""
    if not cluster.private:
        unavailable("cannot give the Spark worker its own mount namespace (unshare)")
    url = seeded_pair(tmp_path)
    before = rows(url, TABLES.messages)

    lied = outbox_spark(cluster, "archive", "--db", url, "--archive-dir", str(cluster.private_dir / "arch"),
                        "--retention", "1d", "--shared-storage")

    assert lied.returncode == 1, lied.stdout + lied.stderr[-3000:]
    assert "is not there for the driver" in lied.stderr
    assert "Nothing of this chunk was deleted" in lied.stderr and "Traceback" not in lied.stderr
    assert rows(url, TABLES.messages) == before


def test_executors_without_the_package_are_named(cluster, tmp_path):
    """PYSPARK_PYTHON pointing at a bare interpreter: one sentence naming it, before any work."""
    bare = "/usr/bin/python3"
    # What the bare interpreter lacks, in the environment the cluster's executors inherit: with a
    # source checkout on PYTHONPATH (a dev run) it finds the package but not its dependencies.
    probe = subprocess.run([bare, "-c", "import outbox"], capture_output=True, text=True, env=cluster.env(),
                           cwd=tmp_path)  # not the checkout's root, which "-c" would put on sys.path
    if probe.returncode == 0 or not Path(bare).exists():
        pytest.fail(f"{bare} must exist and lack the package for this test")  # pragma: no cover
    lacking = probe.stderr.strip().splitlines()[-1]  # "ModuleNotFoundError: No module named 'outbox'"
    assert lacking.startswith("ModuleNotFoundError: No module named "), probe.stderr
    url = seeded_pair(tmp_path)

    failed = outbox_spark(cluster, "audit", "--outbox-db", url, "--out", str(tmp_path / "a"),
                          "--shared-storage", PYSPARK_PYTHON=bare)

    assert failed.returncode == 2, failed.stdout + failed.stderr[-3000:]
    assert f"the executors' Python {bare}" in failed.stderr.replace("python3.11", "python3")
    assert f"lacks the outbox environment ({lacking})" in failed.stderr
    assert "Traceback" not in failed.stderr and not (tmp_path / "a").exists()
    assert sys.executable != bare
