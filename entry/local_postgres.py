"""A throwaway PostgreSQL cluster for the local Prefect stack (``rde stack up --postgres``).

``initdb`` in ``<stack folder>/postgres/data``, listening on 127.0.0.1 only (its socket in that
folder, never in /var/run), one superuser role with a generated password (SCRAM), one database
for Prefect. The password lives in ``<stack folder>/postgres/password`` (mode 0600) and reaches
the Prefect server only through its environment: never a profile, a log or ``stack.json``.
PostgreSQL refuses to run as root; as root the cluster runs as the unprivileged ``postgres`` user
the Debian package creates (``os_user``), which then owns the data folder and must be able to
reach it (a stack folder under a 0700 folder such as ``/tmp/pytest-of-root`` is refused with a
message saying so).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote


class PostgresError(RuntimeError):
    """The local cluster could not be created, started or stopped; the message says why."""


def server_binaries() -> Path:
    """The folder holding ``initdb``/``pg_ctl``: from PATH, else Debian's /usr/lib/postgresql/<v>/bin."""
    found = shutil.which("pg_ctl")
    if found and (Path(found).resolve().parent / "initdb").exists():
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name)
                      if p.parent.parent.name.isdigit() else 0)
    if versions:
        return versions[-1].parent
    raise PostgresError("PostgreSQL server binaries (initdb, pg_ctl) were not found: install Debian's package "
                        "`postgresql` (apt-get install postgresql) or put its bin folder on PATH")


def _write_private(path: Path, text: str) -> None:
    """``text`` and a newline into ``path``, created with mode 0600 (never readable by others, not even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text + "\n")


@dataclass
class LocalPostgres:
    folder: Path  # <stack folder>/postgres
    port: int
    host: str = "127.0.0.1"
    role: str = "prefect"
    database: str = "prefect"
    os_user: str | None = None  # None: the current user, or ``postgres`` when running as root
    startup_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        self.folder = Path(self.folder).absolute()
        if self.os_user is None and os.geteuid() == 0:
            self.os_user = "postgres"
        if self.os_user is not None:
            try:
                pwd.getpwnam(self.os_user)
            except KeyError:
                raise PostgresError(f"PostgreSQL cannot run as root and the user {self.os_user!r} does not exist: "
                                    "install Debian's package `postgresql` (it creates it)") from None

    @property
    def data_dir(self) -> Path:
        return self.folder / "data"

    @property
    def password_file(self) -> Path:
        return self.folder / "password"

    @property
    def password(self) -> str:
        return self.password_file.read_text().strip()

    @property
    def url(self) -> str:
        """The SQLAlchemy URL Prefect's server takes (``postgresql+asyncpg://…``); holds the password."""
        secret = quote(self.password, safe="")
        return f"postgresql+asyncpg://{self.role}:{secret}@{self.host}:{self.port}/{self.database}"

    @property
    def redacted_url(self) -> str:
        return f"postgresql+asyncpg://{self.role}:***@{self.host}:{self.port}/{self.database}"

    def _run(self, *args: str, env: dict[str, str] | None = None, check: bool = True,
             timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        binary = str(server_binaries() / args[0])
        done = subprocess.run([binary, *args[1:]], user=self.os_user, capture_output=True, text=True,
                              timeout=timeout, cwd=self.folder, env={**os.environ, **(env or {})})
        if check and done.returncode != 0:
            said = (done.stderr or done.stdout).strip()[-800:]
            raise PostgresError(f"`{args[0]}` failed ({done.returncode}): {said}")
        return done

    def _own(self, path: Path) -> None:
        if self.os_user is not None:
            entry = pwd.getpwnam(self.os_user)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def initialise(self) -> None:
        """``initdb`` once: a superuser ``role`` with a generated password, SCRAM on loopback only."""
        if (self.data_dir / "PG_VERSION").exists():
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o700)
        self._own(self.folder)
        if self.os_user is not None:
            reach = subprocess.run(["test", "-w", str(self.folder)], user=self.os_user, check=False)
            if reach.returncode != 0:
                raise PostgresError(f"the user {self.os_user!r} that runs PostgreSQL cannot reach {self.folder}: "
                                    "choose a stack folder whose parents it may enter (e.g. under the project)")
        password = secrets.token_urlsafe(24)
        _write_private(self.password_file, password)
        pwfile = self.folder / ".initdb-password"
        _write_private(pwfile, password)
        self._own(pwfile)
        try:
            self._run("initdb", "-D", str(self.data_dir), "-U", self.role, "--pwfile", str(pwfile),
                      "--auth", "scram-sha-256", "--encoding", "UTF8", "--locale", "C", "--no-instructions")
        finally:
            pwfile.unlink(missing_ok=True)

    def running(self) -> bool:
        if not (self.data_dir / "PG_VERSION").exists():
            return False
        return self._run("pg_ctl", "status", "-D", str(self.data_dir), check=False).returncode == 0

    def start(self) -> None:
        """Initialise if needed, start on loopback, create the database; returns when it accepts logins."""
        self.initialise()
        if not self.running():
            options = (f"-c listen_addresses={self.host} -p {self.port} -c unix_socket_directories={self.folder} "
                       "-c max_connections=200")
            self._run("pg_ctl", "start", "-D", str(self.data_dir), "-l", str(self.folder / "server.log"),
                      "-o", options, "-w", "-t", str(int(self.startup_timeout_s)), timeout=self.startup_timeout_s + 30)
        env = {"PGPASSWORD": self.password}
        deadline = time.monotonic() + self.startup_timeout_s
        while self._run("pg_isready", "-h", self.host, "-p", str(self.port), check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise PostgresError(f"PostgreSQL did not accept connections on {self.host}:{self.port}; "
                                    f"log {self.folder / 'server.log'}")
            time.sleep(0.5)
        exists = self._run("psql", "-h", self.host, "-p", str(self.port), "-U", self.role, "-d", "postgres", "-tAc",
                           f"SELECT 1 FROM pg_database WHERE datname = '{self.database}'", env=env).stdout.strip()
        if exists != "1":
            self._run("createdb", "-h", self.host, "-p", str(self.port), "-U", self.role, self.database, env=env)

    def stop(self) -> None:
        if self.running():
            self._run("pg_ctl", "stop", "-D", str(self.data_dir), "-m", "fast", "-w", check=False)

    def remove(self) -> None:
        """Stop and delete the cluster and its password."""
        with contextlib.suppress(PostgresError):
            self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
