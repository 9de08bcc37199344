"""services/supervisor.py's ChildProcess with real processes: a stop leaves nothing of the child's
process group behind, a child that ignores SIGTERM is killed after the grace period, and a health
wait that fails says which command failed and where its log is."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from services.supervisor import ChildProcess, StartupError, free_port


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# Prints "ready <grandchild pid>" once its grandchild runs; neither ignores any signal.
FAMILY = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print("ready", grandchild.pid, flush=True)
time.sleep(300)
"""


def _grandchild_pid(child: ChildProcess) -> int | None:
    for line in child.log().splitlines():
        if line.startswith("ready "):
            return int(line.split()[1])
    return None


def test_stop_ends_the_child_and_its_grandchild(tmp_path):
    child = ChildProcess(_python(FAMILY), tmp_path / "family.log", health=lambda: _grandchild_pid(child) is not None)
    with child:
        pid, grandchild = child.proc.pid, _grandchild_pid(child)
        assert os.getpgid(pid) == pid != os.getpgid(0), "the child leads a process group of its own"
        assert os.getpgid(grandchild) == pid, "the grandchild is in the child's group"
        assert os.getsid(pid) == os.getsid(0), "in the caller's session"
        assert _alive(grandchild)
    assert child.returncode == -signal.SIGTERM, "SIGTERM was enough: no SIGKILL needed"
    _wait(lambda: not _alive(grandchild), 5, "the grandchild to be gone")
    assert not _alive(pid)


def test_a_grandchild_left_by_an_exited_child_is_killed_with_the_group(tmp_path):
    orphaning = ("import subprocess, sys; g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)']); print('ready', g.pid, flush=True)")
    child = ChildProcess(_python(orphaning), tmp_path / "orphan.log").start()
    _wait(lambda: child.returncode is not None and _grandchild_pid(child) is not None, 10, "the child to exit")
    grandchild = _grandchild_pid(child)
    assert _alive(grandchild), "the grandchild outlives its parent"
    assert child.stop(grace_s=1) == 0
    _wait(lambda: not _alive(grandchild), 5, "the leftover grandchild to be killed")


IGNORES_SIGTERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(300)
"""


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    child = ChildProcess(_python(IGNORES_SIGTERM), tmp_path / "stubborn.log", grace_s=1.0,
                         health=lambda: "ready" in child.log())
    with child:
        pid = child.proc.pid
        started = time.monotonic()
    took = time.monotonic() - started
    assert child.returncode == -signal.SIGKILL
    assert 1.0 <= took < 10, f"SIGKILL came {took:.1f} s after SIGTERM; the grace is 1 s"
    assert not _alive(pid)


def test_a_health_wait_that_times_out_names_the_command_and_its_log(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/healthz"  # nothing listens there
    log_path = tmp_path / "silent.log"
    child = ChildProcess(_python("print('starting', flush=True); import time; time.sleep(300)"), log_path,
                         health=url).start()
    pid = child.proc.pid
    with pytest.raises(StartupError) as failure:
        child.wait_healthy(timeout_s=1.0)
    message = str(failure.value)
    assert "time.sleep(300)" in message and sys.executable in message, "names the command"
    assert str(log_path) in message and "starting" in message, "names the log and shows its end"
    assert url in message and "within 1 s" in message
    assert not _alive(pid), "a child that never became healthy is stopped"


def test_a_child_that_exits_before_it_is_healthy_is_reported_with_its_exit_code(tmp_path):
    child = ChildProcess(_python("import sys; print('no config', flush=True); sys.exit(3)"), tmp_path / "bad.log",
                         health=lambda: False)
    with pytest.raises(StartupError, match=r"exited with code 3 before it was healthy(.|\n)*no config"):
        with child:
            pass


def test_the_log_is_kept_across_restarts_only_when_asked(tmp_path):
    for append, expected in ((False, 1), (True, 2)):
        log_path = tmp_path / f"append-{append}.log"
        child = ChildProcess(_python("print('run')"), log_path, append_log=append)
        for _ in range(2):
            child.start().proc.wait(10)
        assert child.log().count("run") == expected
