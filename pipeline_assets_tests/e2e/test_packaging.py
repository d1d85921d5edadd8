"""The built wheel (not the editable install the rest of the suite uses) holds
every subpackage, the SQL and py.typed, and its installed ``pipeline-assets``
command works from outside the repository.

The wheel is built offline from a copy of the working tree (so stale files in
``build/`` cannot leak into it and nothing is written into the checkout), then
installed with ``--no-deps`` into a fresh virtual environment that sees this
environment's dependencies (dagster & co.) through a ``.pth`` line. A path
added by a ``.pth`` line is not itself scanned for ``.pth`` files, so this
environment's editable-install hook stays inactive there; the tests check that
the code and SQL they run come from the fresh environment.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import psycopg
import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pipeline_assets"
SQL = REPO / "sql"
BUILD_BACKEND_MIN = (68,)
PIP_PYTHON_OPTION_MIN = (22, 3)  # `pip --python <interpreter>`

COPY_IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.pyc",
    ".pipeline",
    ".pytest_cache",
    ".tmp_dagster_home*",
)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _run(cmd: list[str], *, what: str, timeout: float = 180, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0:
        pytest.fail(
            f"{what} failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n"
            f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that would put the checkout on sys.path."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")
    }
    env["PYTHONNOUSERSITE"] = "1"
    env.update(extra)
    return env


def _outside_repo(path: Path) -> Path:
    path = path.resolve()
    if path.is_relative_to(REPO):
        pytest.fail(f"{path} lies inside the repository; run pytest with a --basetemp outside {REPO}")
    return path


def _repo_migrations() -> list[str]:
    return sorted(p.name for p in SQL.glob("[0-9][0-9][0-9]_*.sql"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the working tree, offline, with this environment's setuptools."""
    try:
        setuptools_version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        setuptools_version = "0"
    if _version_tuple(setuptools_version) < BUILD_BACKEND_MIN:
        pytest.fail(
            f"the build backend needs setuptools>=68 in this environment (found {setuptools_version}); "
            f"run: pip install -e '.[dev]' (the dev extra carries it)"
        )
    work = _outside_repo(tmp_path_factory.mktemp("wheel"))
    source = work / "src"
    shutil.copytree(REPO, source, ignore=COPY_IGNORE)
    dist = work / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "-w",
            str(dist),
            str(source),
        ],
        what="building the wheel",
        cwd=work,
        env=_clean_env(),
    )
    wheels = sorted(dist.glob("pipeline_assets-*.whl"))
    if len(wheels) != 1:
        pytest.fail(f"expected one pipeline_assets wheel in {dist}, found {[w.name for w in wheels]}")
    return wheels[0]


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> dict:
    """A new virtual environment with the wheel installed (--no-deps) and this environment's
    site-packages appended through a .pth line, for the dependencies."""
    pip_version = importlib.metadata.version("pip")
    if _version_tuple(pip_version) < PIP_PYTHON_OPTION_MIN:
        pytest.fail(f"installing into the fresh venv needs pip>=22.3 (`pip --python`); found {pip_version}")
    root = _outside_repo(tmp_path_factory.mktemp("venv")) / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)], what="creating the fresh venv", env=_clean_env())
    python = root / "bin" / "python"
    # Install first, while the fresh venv sees nothing else: pip then cannot mistake this
    # environment's editable pipeline-assets for the one to upgrade (and try to uninstall it).
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            "--no-warn-script-location",
            str(wheel),
        ],
        what="installing the wheel into the fresh venv",
        env=_clean_env(),
        cwd=root.parent,
    )
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            what="locating the fresh venv's site-packages",
            env=_clean_env(),
            cwd=root.parent,
        ).stdout.strip()
    )
    parents = dict.fromkeys(str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("purelib", "platlib"))
    (site / "_parent_env_dependencies.pth").write_text("".join(f"{p}\n" for p in parents))
    script = root / "bin" / "pipeline-assets"
    if not script.is_file():
        pytest.fail(f"the wheel installed no console script {script}")
    workdir = _outside_repo(tmp_path_factory.mktemp("cwd"))
    return {
        "root": root,
        "python": python,
        "site": site.resolve(),
        "script": script,
        "cwd": workdir,
        "env": _clean_env(
            VIRTUAL_ENV=str(root),
            PATH=f"{root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            PIPELINE_HOME=str(workdir / "home"),
        ),
    }


def test_wheel_holds_every_subpackage_the_sql_and_py_typed(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next((zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")), "")

    subpackages = sorted(
        p.parent.relative_to(REPO).as_posix() for p in PACKAGE.rglob("__init__.py") if "__pycache__" not in p.parts
    )
    assert {
        "pipeline_assets",
        "pipeline_assets/content",
        "pipeline_assets/jobqueue",
        "pipeline_assets/store",
        "pipeline_assets/app",
        "pipeline_assets/defs",
        "pipeline_assets/providers",
        "pipeline_assets/cli",
    } <= set(subpackages)
    missing_inits = [f"{pkg}/__init__.py" for pkg in subpackages if f"{pkg}/__init__.py" not in names]
    assert not missing_inits, f"subpackages missing from the wheel (list them in pyproject.toml): {missing_inits}"

    modules = {p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert not modules - names, f"modules missing from the wheel: {sorted(modules - names)}"

    sql_files = {
        "pipeline_assets/sql/" + p.relative_to(SQL).as_posix() for p in [*SQL.glob("*.sql"), *SQL.glob("queries/*.sql")]
    }
    for required in (
        "pipeline_assets/sql/001_core.sql",
        "pipeline_assets/sql/queries/migrations.sql",
        "pipeline_assets/py.typed",
    ):
        assert required in names, f"{required} missing from the wheel"
    assert not sql_files - names, f"SQL files missing from the wheel: {sorted(sql_files - names)}"

    assert not [n for n in names if n.startswith(("pipeline_assets_tests/", "sql/", "benchmarks/"))], (
        "the wheel ships tests, benchmarks or a top-level sql/"
    )
    assert "pipeline-assets = pipeline_assets.cli:main" in entry_points


def test_installed_wheel_imports_from_the_fresh_venv(fresh_venv):
    probe = (
        "import json, sys\n"
        "import pipeline_assets, pipeline_assets.cli, pipeline_assets.defs.definitions, dagster\n"
        "from pipeline_assets.store import migrations, queries\n"
        "mods = {n: getattr(m, '__file__', None) for n, m in list(sys.modules.items())\n"
        "        if n == 'pipeline_assets' or n.startswith('pipeline_assets.')}\n"
        "print(json.dumps({'package': pipeline_assets.__file__, 'sql_dir': str(queries.sql_dir()),\n"
        "                  'migrations': [p.name for p in migrations.migration_files()],\n"
        "                  'modules': mods, 'dagster': dagster.__file__,\n"
        "                  'finders': [repr(f) for f in sys.meta_path]}))\n"
    )
    proc = _run(
        [str(fresh_venv["python"]), "-c", probe],
        what="importing the installed package",
        cwd=fresh_venv["cwd"],
        env=fresh_venv["env"],
    )
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    site = fresh_venv["site"]
    package = Path(info["package"]).resolve()
    assert package.is_relative_to(site), (
        f"pipeline_assets imported from {package}, not from the fresh venv {site}: the test would prove nothing"
    )
    outside = {n: f for n, f in info["modules"].items() if f and not Path(f).resolve().is_relative_to(site)}
    assert not outside, f"modules loaded from outside the fresh venv: {outside}"
    assert Path(info["sql_dir"]).resolve() == site / "pipeline_assets" / "sql"
    assert info["migrations"] == _repo_migrations()
    assert not [f for f in info["finders"] if "__editable__" in f], "the editable-install hook is active"
    assert not Path(info["dagster"]).resolve().is_relative_to(site), "dagster should come from the parent env"


def test_installed_command_help_and_migrate(fresh_venv, database_url):
    script, cwd, env = str(fresh_venv["script"]), fresh_venv["cwd"], fresh_venv["env"]

    help_ = _run([script, "--help"], what="pipeline-assets --help", cwd=cwd, env=env)
    assert "migrate" in help_.stdout

    # An empty database: the wheel's own SQL creates the whole schema.
    empty = "t_packaging_empty_" + os.urandom(3).hex()
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{empty}"')
    try:
        empty_url = psycopg.conninfo.make_conninfo(database_url, dbname=empty)
        first = _run(
            [script, "migrate"],
            what="pipeline-assets migrate (empty database)",
            cwd=cwd,
            env={**env, "PIPELINE_DATABASE_URL": empty_url},
        )
        names = _repo_migrations()
        assert first.stdout.strip() == f"applied {len(names)} migration(s): {', '.join(names)}", first.stdout
        again = _run(
            [script, "migrate"],
            what="pipeline-assets migrate (second run)",
            cwd=cwd,
            env={**env, "PIPELINE_DATABASE_URL": empty_url},
        )
        assert again.stdout.strip() == "applied 0 migration(s)", again.stdout
        with psycopg.connect(empty_url) as c:
            recorded = [r[0] for r in c.execute("SELECT version FROM app.schema_migrations ORDER BY version")]
        assert recorded == names
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{empty}" WITH (FORCE)')

    # The suite's database, migrated by the checkout: the wheel's migrations are the same set.
    same = _run(
        [script, "migrate"],
        what="pipeline-assets migrate (test database)",
        cwd=cwd,
        env={**env, "PIPELINE_DATABASE_URL": database_url},
    )
    assert same.stdout.strip() == "applied 0 migration(s)", same.stdout
