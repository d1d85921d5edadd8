"""The `pipeline-assets` process ends once its command is done without the interpreter's teardown
(cli/process_exit.py): its output whole, its status kept, its atexit handlers run; a normal exit
when another non-daemon thread still runs. Real processes, the real command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from pipeline_assets.cli import main

# The command line as the console script runs it, with two witnesses: an atexit handler (run
# by any exit) and an object whose finalizer only the interpreter's teardown runs.
PROBE = """
import atexit, sys, threading
from pathlib import Path
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
class Witness:
    def __del__(self, open=open, path=str(out / "teardown")):  # bound now: teardown clears globals
        with open(path, "w") as f:
            f.write("ran")
witness = Witness()
if sys.argv[2] == "thread":
    def late():  # still running when the command ends: it waits for the main thread to stop
        threading.main_thread().join()
        (out / "thread").write_text("done")
    threading.Thread(target=late, daemon=False).start()
from pipeline_assets.cli import main
sys.argv = ["pipeline-assets", *sys.argv[3:]]
sys.exit(main())
"""


def run(tmp_path: Path, *args: str, thread: bool = False) -> subprocess.CompletedProcess:
    # No server behind the database URL: a command that needs one fails with one line.
    env = {**os.environ, "PIPELINE_DATABASE_URL": f"postgresql://nobody@/none?host={tmp_path}"}
    return subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path), "thread" if thread else "-", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_command_ends_without_the_teardown_its_output_whole_and_atexit_run(tmp_path):
    proc = run(tmp_path, "settings", "--reference")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == CliRunner().invoke(main, ["settings", "--reference"]).output  # every line written
    assert proc.stdout.count("\n") > 40
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "teardown").exists()  # the modules were not freed one by one


def test_the_status_of_a_usage_error_and_of_an_expected_failure_is_kept(tmp_path):
    usage = run(tmp_path, "no-such-command")
    assert usage.returncode == 2 and "No such command" in usage.stderr
    failed = run(tmp_path, "status")
    assert failed.returncode == 1 and failed.stderr.startswith("error: "), failed.stderr
    assert "Traceback" not in usage.stderr + failed.stderr
    assert (tmp_path / "atexit").exists() and not (tmp_path / "teardown").exists()


def test_a_running_non_daemon_thread_gets_the_normal_exit(tmp_path):
    proc = run(tmp_path, "settings", "--reference", thread=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "thread").read_text() == "done"  # waited for, as a normal exit does
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "teardown").read_text() == "ran"
