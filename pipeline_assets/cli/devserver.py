"""``pipeline-assets dev`` and ``dagster-env``: the Dagster UI and daemon on a local PostgreSQL.

1. The pipeline database (PIPELINE_DATABASE_URL, or the embedded server under PIPELINE_HOME),
   migrated before anything runs.
2. Dagster's storage in the ``dagster`` database (PIPELINE_DAGSTER_DATABASE) on that server,
   created if missing; DAGSTER_HOME is PIPELINE_HOME/dagster with a generated dagster.yaml
   (``cli.dagster_instance``) whose ``postgres_url`` reads DAGSTER_PG_URL, set for the child
   processes only: no password is written to disk.
3. ``dagster dev -w workspace.yaml`` in its own session; SIGINT/SIGTERM is forwarded once, and
   run workers still going after it get SIGTERM, then SIGKILL.
``dagster-env`` prints steps 1-2 as ``export`` lines (with PIPELINE_PARTITION_BUCKETS) for Dagster's own
commands. Up as long as Dagster, this process never imports it, numpy or a model's runtime (``prepare``).
"""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

import psycopg

from pipeline_assets.cli.dagster_instance import (
    DAGSTER_URL_ENV,
    REPO,
    RUN_EVENT_SETTINGS,
    instance_yaml,
    sqlalchemy_url,
)
from pipeline_assets.messages import one_line
from pipeline_assets.registry import models
from pipeline_assets.settings import Settings
from pipeline_assets.store import db, embedded_postgres, migrations
from pipeline_assets.store.bucket_rows import fixed_bucket_count

PATH_SETTINGS = ("PIPELINE_SOURCE_DIR",)
STOP_TIMEOUT_SECONDS = 30
BUCKETS_ENV = "PIPELINE_PARTITION_BUCKETS"


def prepare(settings: Settings, home: Path | None = None) -> tuple[dict[str, str], Path]:
    """Databases, DAGSTER_HOME and dagster.yaml; return (child environment, DAGSTER_HOME). Its connection
    registers no vector adapter and a child process learns the configured model's id: no numpy here."""
    home = (home or settings.home_path).resolve()
    pipeline_url = settings.database_url or embedded_postgres.ensure_server(home)
    with db.session(pipeline_url, adapters=False) as conn:  # no vectors here: numpy stays unimported
        # Migrations applied once, before webserver, daemon and runs start; the
        # database's bucket count (fixed by its first use) is what every process uses.
        bucket_count = fixed_bucket_count(conn, settings.partition_buckets)
        # The model columns of embeddings: the registry's active models here, and the configured one
        # (which the first run registers) in ``setup_instance``'s child, so they exist before any sensor
        # ticks (and after an upgrade).
        model_keys = models.active_model_ids(conn)
    dagster_url = sqlalchemy_url(migrations.ensure_database(pipeline_url, settings.dagster_database))
    dagster_home = home / "dagster"
    dagster_home.mkdir(parents=True, exist_ok=True)
    (dagster_home / "dagster.yaml").write_text(instance_yaml())
    env = {**RUN_EVENT_SETTINGS, **os.environ}
    env.update(
        {
            "DAGSTER_HOME": str(dagster_home),
            DAGSTER_URL_ENV: dagster_url,
            "PIPELINE_HOME": str(home),
            BUCKETS_ENV: str(bucket_count),
        }
    )
    # The services run in DAGSTER_HOME: relative paths keep meaning what they meant here.
    for name in PATH_SETTINGS:
        if env.get(name):
            env[name] = str(Path(env[name]).expanduser().resolve())
    retired = setup_instance(env, model_keys)
    if retired:
        print(
            f"upgraded the Dagster instance to bucket partitions: {retired} per-document partition(s) "
            "of the old scheme deleted (nothing re-embedded)",
            file=sys.stderr,
            flush=True,
        )
    return env, dagster_home


class InstanceSetupError(RuntimeError):
    """Dagster's instance could not be prepared (its storage unreachable, a broken dagster.yaml)."""


# What `prepare` raises for an expected failure: one `error:` line, exit status 1.
PREPARE_ERRORS = (
    db.DatabaseUnavailable,
    embedded_postgres.EmbeddedServerError,
    InstanceSetupError,
    psycopg.Error,
    OSError,
)


def setup_instance(env: dict[str, str], model_keys: list[str] | None = None) -> int:
    """``instance_setup`` in a child process (this one never imports Dagster); the legacy
    partitions it deleted. InstanceSetupError with the child's last line if it failed."""
    done = subprocess.run(
        [sys.executable, "-m", "pipeline_assets.defs.models.instance_setup", env["DAGSTER_HOME"], *(model_keys or [])],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise InstanceSetupError(f"cannot prepare the Dagster instance in {env['DAGSTER_HOME']}: {last}")
    return int(done.stdout.split()[-1])


def dagster_env(settings: Settings) -> tuple[dict[str, str], int]:
    """``prepare``; return (the variables Dagster's own commands need, the bucket count)."""
    env, _ = prepare(settings)
    names = ["PIPELINE_HOME", "DAGSTER_HOME", DAGSTER_URL_ENV, BUCKETS_ENV, *RUN_EVENT_SETTINGS, *PATH_SETTINGS]
    exported = {name: env[name] for name in names if env.get(name)}
    return exported, int(env[BUCKETS_ENV])


def export_lines(env: dict[str, str]) -> str:
    """``export NAME=value`` lines for a POSIX shell (``eval "$(pipeline-assets dagster-env)"``)."""
    return "\n".join(f"export {name}={shlex.quote(value)}" for name, value in env.items())


def run_dagster_env(settings: Settings | None = None) -> int:
    """`pipeline-assets dagster-env`: print the environment, or one `error:` line and 1."""
    try:
        exported, added = dagster_env(settings or Settings.from_env())
    except PREPARE_ERRORS as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 1
    print(export_lines(exported), flush=True)
    print(
        f"# Dagster instance: DAGSTER_HOME={exported['DAGSTER_HOME']} (storage in PostgreSQL); "
        f"{added} document bucket(s)",
        file=sys.stderr,
    )
    return 0


def dagster_command(host: str, port: int) -> list[str]:
    workspace = REPO / "workspace.yaml"
    # Without the repository around it (installed), the definitions module itself.
    target = ["-w", str(workspace)] if workspace.is_file() else ["-m", "pipeline_assets.defs.definitions", "-a", "defs"]
    # `dagster dev` warns that `dg dev` supersedes it; dg needs a [tool.dg] block that
    # would make dagster ignore workspace.yaml, so this stays on `dagster dev`.
    quiet = ["-W", "ignore:Function `dev_command` is superseded"]
    return [sys.executable, *quiet, "-m", "dagster", "dev", *target, "-h", host, "-p", str(port)]


def _stop_leftovers(pgid: int) -> None:
    """Run workers launched by the code server outlive `dagster dev`; end them too.

    Killing a run is safe here by design (idempotent stages, leases that expire).
    """
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def run_dev(settings: Settings | None = None, host: str = "127.0.0.1", port: int = 3000) -> int:
    """Run the Dagster UI + daemon until Ctrl-C; return the exit status."""
    try:
        env, dagster_home = prepare(settings or Settings.from_env())
    except PREPARE_ERRORS as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 1
    print(f"Dagster UI: http://{host}:{port}  (DAGSTER_HOME={dagster_home}; Ctrl-C stops it)", flush=True)
    stopping = {"signals": 0}
    child: dict[str, subprocess.Popen] = {}

    def forward(signum: int, frame: FrameType | None) -> None:
        stopping["signals"] += 1
        proc = child.get("proc")
        if proc is None or proc.poll() is not None:
            return
        try:
            if stopping["signals"] == 1:
                proc.send_signal(signal.SIGINT)  # dagster dev's clean shutdown
            else:
                os.killpg(proc.pid, signal.SIGKILL)  # asked twice: stop now
        except ProcessLookupError:
            pass

    # Handlers first: a child inherits an *ignored* SIGINT (as in a shell's
    # background job), but a caught one is reset to the default at exec, so
    # dagster dev always gets a working Ctrl-C (it maps SIGTERM to SIGINT).
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    # cwd DAGSTER_HOME: dagster warns about (and ignores) a dagster.yaml in the working
    # directory when DAGSTER_HOME is elsewhere (and a .env there would be loaded).
    proc = child["proc"] = subprocess.Popen(
        dagster_command(host, port), env=env, cwd=dagster_home, start_new_session=True
    )
    if stopping["signals"]:  # interrupted while starting it
        proc.send_signal(signal.SIGINT)
    try:
        while True:
            try:
                code = proc.wait(timeout=STOP_TIMEOUT_SECONDS if stopping["signals"] else None)
                break
            except subprocess.TimeoutExpired:
                _stop_leftovers(proc.pid)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_leftovers(proc.pid)
    if stopping["signals"]:
        print("Dagster stopped.", flush=True)
        return 0
    return code
