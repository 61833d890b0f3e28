"""Start and stop a Mooncake master (plus its HTTP metadata server) on loopback.

The master binary ``mooncake_master`` ships in the ``mooncake`` package of the PyPI wheel
``mooncake-transfer-engine-non-cuda``; the metadata server is the package's ``http_metadata_server``
module. Every listening address is set explicitly to ``host`` (default ``127.0.0.1``) — the
defaults bind all interfaces — and the master's built-in HTTP metadata server is not used because it
binds ``0.0.0.0`` whatever its host flag says.

A test service, not part of the installed package: the Mooncake tests and ``benchmarks/store_bench.py``
import it with ``tools/`` on the import path. Command line (runs until interrupted, prints the addresses a
client needs)::

    python tools/mooncake_master.py [--host 127.0.0.1] [--rpc-port 0] \
        [--metadata-port 0] [--metrics-port 0] [--lease-ttl-ms 1000]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torch_kvoffload._utils import free_ports

logger = logging.getLogger(__name__)

__all__ = ["MooncakeMaster", "find_master_binary"]


def find_master_binary() -> str | None:
    """Path of ``mooncake_master`` from the installed ``mooncake`` package, else from ``PATH``."""
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "mooncake_master"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return shutil.which("mooncake_master")


def _die_with_parent() -> None:  # pragma: no cover (runs in the child between fork and exec)
    """Ask Linux to SIGTERM the child when the thread that started it exits (no orphaned masters)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _wait_listening(host: str, port: int, proc: subprocess.Popen, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class MooncakeMaster:
    """A loopback Mooncake master and HTTP metadata server, as child processes.

    Args:
        host: the address every socket binds to.
        rpc_port / metadata_port / metrics_port: 0 picks a free port.
        lease_ttl_ms: the master's ``--default_kv_lease_ttl``: how long a read protects an object from
            removal and eviction.
        extra_args: more ``--flag=value`` arguments for ``mooncake_master``.
        startup_timeout: seconds to wait for both services to accept connections.

    Use as a context manager, or call :meth:`start` / :meth:`stop`. On Linux the children are also
    terminated when the thread that started them exits, so a killed test run leaves no master behind.
    Attributes ``master_addr`` (``host:port``) and ``metadata_server`` (``http://host:port/metadata``) are
    what clients need.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        rpc_port: int = 0,
        metadata_port: int = 0,
        metrics_port: int = 0,
        lease_ttl_ms: int = 1000,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 30.0,
    ) -> None:
        self.host = host
        # picked together: ports picked one by one can repeat, and the master's RPC port would then be the
        # metadata server's (the master fails to bind, yet its port answers)
        picked = iter(free_ports(3, host))
        self.rpc_port = rpc_port or next(picked)
        self.metadata_port = metadata_port or next(picked)
        self.metrics_port = metrics_port or next(picked)
        ports = (self.rpc_port, self.metadata_port, self.metrics_port)
        if len(set(ports)) != len(ports):
            raise ValueError(
                f"MooncakeMaster: rpc_port, metadata_port and metrics_port must differ, got {ports}"
            )
        self.lease_ttl_ms = lease_ttl_ms
        self.extra_args = tuple(extra_args)
        self.startup_timeout = startup_timeout
        self._procs: list[subprocess.Popen] = []
        self._logdir: tempfile.TemporaryDirectory | None = None

    @property
    def master_addr(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    def commands(self, binary: str) -> tuple[list[str], list[str]]:
        """The metadata-server and master command lines (also shown in docs/store.md)."""
        metadata = [
            sys.executable,
            "-m",
            "mooncake.http_metadata_server",
            "--host",
            self.host,
            "--port",
            str(self.metadata_port),
        ]
        master = [
            binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            "--enable_http_metadata_server=false",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            *self.extra_args,
        ]
        return metadata, master

    def log_tail(self, chars: int = 4000) -> str:
        if self._logdir is None:
            return ""
        parts = []
        for name in ("metadata.log", "master.log"):
            path = Path(self._logdir.name) / name
            if path.exists():
                parts.append(f"--- {name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def start(self) -> MooncakeMaster:
        if self._procs:
            return self
        binary = find_master_binary()
        if binary is None:
            raise RuntimeError(
                "mooncake_master not found: pip install mooncake-transfer-engine-non-cuda "
                "(and apt-get install libibverbs1)"
            )
        self._logdir = tempfile.TemporaryDirectory(prefix="kvoffload-mooncake-")
        deadline = time.monotonic() + self.startup_timeout
        for (cmd, port), name in zip(
            zip(self.commands(binary), (self.metadata_port, self.rpc_port), strict=True),
            ("metadata.log", "master.log"),
            strict=True,
        ):
            log = open(Path(self._logdir.name) / name, "wb")  # noqa: SIM115 (kept open for the child)
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
            log.close()
            self._procs.append(proc)
            if not _wait_listening(self.host, port, proc, deadline):
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"{cmd[0]} did not start listening on {self.host}:{port}:\n{tail}")
        logger.info("mooncake master on %s, metadata %s", self.master_addr, self.metadata_server)
        return self

    def stop(self) -> None:
        """Terminate both processes (SIGTERM, then SIGKILL after 5 s); idempotent."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._procs.clear()
        if self._logdir is not None:
            self._logdir.cleanup()
            self._logdir = None

    @property
    def running(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run a loopback Mooncake master and metadata server.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--rpc-port", type=int, default=0)
    parser.add_argument("--metadata-port", type=int, default=0)
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--lease-ttl-ms", type=int, default=1000)
    args = parser.parse_args(argv)

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # stop the children on SIGTERM too

    signal.signal(signal.SIGTERM, _terminate)
    master = MooncakeMaster(
        host=args.host,
        rpc_port=args.rpc_port,
        metadata_port=args.metadata_port,
        metrics_port=args.metrics_port,
        lease_ttl_ms=args.lease_ttl_ms,
    )
    with master:
        print(f"master_server_addr={master.master_addr}", flush=True)
        print(f"metadata_server={master.metadata_server}", flush=True)
        try:
            while master.running:
                time.sleep(1)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
