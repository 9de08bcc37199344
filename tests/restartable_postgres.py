"""A PostgreSQL server of the test's own (``initdb`` + ``pg_ctl`` on a temporary directory and port),
which a fault test can stop and start again; the shared server on 5432 is never touched.

PostgreSQL refuses to run as root, so as root the server runs as the ``postgres`` system user
(``runuser``) in a directory that user owns. Where there are no binaries, or no way to run them
unprivileged, ``postgres_server_problem()`` says why (the test skips, or fails under
``EVALFORGE_REQUIRE_SERVICES=1``).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from services.supervisor import free_port

SERVER_USER = "postgres"


def postgres_bin() -> Path | None:
    """The newest ``/usr/lib/postgresql/*/bin`` with ``initdb`` and ``pg_ctl``, or one on PATH."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name)
                        if Path(p).parent.name.isdigit() else 0)
    for directory in reversed(candidates):
        if (Path(directory) / "initdb").exists() and (Path(directory) / "pg_ctl").exists():
            return Path(directory)
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


def postgres_server_problem() -> str | None:
    """None when this process can run a PostgreSQL server of its own, else what is missing."""
    if postgres_bin() is None:
        return "no PostgreSQL server binaries (initdb, pg_ctl) under /usr/lib/postgresql/*/bin or on PATH: " \
               "install postgresql"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return f"running as root and there is no {SERVER_USER!r} user to run PostgreSQL as (it refuses root)"
        if shutil.which("runuser") is None:
            return "running as root without `runuser` to start PostgreSQL as another user"
    return None


class RestartablePostgres:
    """``start()``, ``stop()`` (``pg_ctl stop -m fast``: connections are cut, as in a restart) and ``url``."""

    def __init__(self) -> None:
        self.bin = postgres_bin()
        assert self.bin is not None, postgres_server_problem()
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="evalforge-pg-"))
        self.data = self.root / "data"
        self.log_path = self.root / "postgres.log"
        self.as_root = os.geteuid() == 0
        if self.as_root:
            user = pwd.getpwnam(SERVER_USER)
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        argv = [str(self.bin / tool), *args]
        if self.as_root:
            argv = ["runuser", "-u", SERVER_USER, "--", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, cwd=self.root, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}"
                               f"{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def start(self) -> RestartablePostgres:
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log_path), "-o", options, "-w", "-t", "60",
                  "start")
        return self

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def destroy(self) -> None:
        if self.listening():
            try:
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
            except RuntimeError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)
