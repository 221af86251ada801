"""Start real service processes on free loopback ports and stop them, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class ServiceProcess:
    """A running `python -m services.<name>` process."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log_path: str
    host: str = "127.0.0.1"
    metrics_port: int = 0
    """Port of its /metrics endpoint (0 when metrics are off)."""

    @property
    def addr(self) -> str:
        """host:port of the service."""
        return f"{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        """The URL of its Prometheus metrics."""
        assert self.metrics_port, f"{self.name} serves no metrics"
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Send `sig` and wait for exit; SIGKILL after `timeout`. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        self.stop(signal.SIGKILL)

    def log(self) -> str:
        """The process's combined output so far."""
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()


def start_service(
    name: str,
    *,
    env: Mapping[str, str] | None = None,
    workdir: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    timeout: float = 45.0,
) -> ServiceProcess:
    """Start service `name` (controller, provisioner, prober) and wait until it serves.

    The service binds port 0 and writes the port it got to a port file, which is read here:
    no port is picked first and bound later, so no other process can take it in between.

    Args:
        name: the service package under services/.
        env: extra environment, for example REPLICAPLANE_CONTROLLER_STATE_DIR.
        workdir: directory for the port file and log; a new temp dir by default.
        host: loopback address to listen on; a ports.private_host() for a service that is
            restarted on the same address.
        port: 0 (the service picks); the old port only to restart a service on its address.
        timeout: seconds to wait for the port file.
    """
    return spawn_service(name, env=env, workdir=workdir, host=host, port=port).wait(timeout)


@dataclasses.dataclass
class Starting:
    """A service process started but maybe not serving yet: `wait()` for it. Starting several
    before waiting for any overlaps their start-up (the imports take most of a second each)."""

    name: str
    proc: subprocess.Popen[bytes]
    port_file: str
    metrics_port_file: str
    log_path: str
    host: str

    def wait(self, timeout: float = 45.0) -> ServiceProcess:
        """Wait until the service wrote its port file; kill it and raise if it exits first or
        `timeout` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(self.port_file):
                # The metrics port file is written before the gRPC one (when metrics are on).
                with open(self.port_file, encoding="utf-8") as fh:
                    port = int(fh.read())
                metrics_port = 0
                if os.path.exists(self.metrics_port_file):
                    with open(self.metrics_port_file, encoding="utf-8") as fh:
                        metrics_port = int(fh.read())
                return ServiceProcess(self.name, self.proc, port, self.log_path, self.host, metrics_port)
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.proc.kill()
        self.proc.wait()
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            raise RuntimeError(f"{self.name} did not start:\n{fh.read()}")


def spawn_service(
    name: str,
    *,
    env: Mapping[str, str] | None = None,
    workdir: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> Starting:
    """Start service `name` without waiting for it; the arguments are start_service's."""
    workdir = workdir or tempfile.mkdtemp(prefix=f"rp-{name}-")
    port_file = os.path.join(workdir, f"{name}.port")
    metrics_port_file = os.path.join(workdir, f"{name}.metrics.port")
    for path in (port_file, metrics_port_file):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    log_path = os.path.join(workdir, f"{name}.log")
    upper = name.upper()
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "gen", "python")]),
        f"REPLICAPLANE_{upper}_LISTEN_ADDR": f"{host}:{port}",
        f"REPLICAPLANE_{upper}_PORT_FILE": port_file,
        # Metrics on a port of its own choosing: tests never clash on the default ports.
        f"REPLICAPLANE_{upper}_METRICS_ADDR": f"{host}:0",
        f"REPLICAPLANE_{upper}_METRICS_PORT_FILE": metrics_port_file,
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    log_fh = open(log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
    proc = subprocess.Popen(
        [sys.executable, "-m", f"services.{name}"],
        cwd=REPO,
        env=full_env,
        stdout=log_fh,
        stderr=subprocess.STDOUT,
    )
    log_fh.close()
    return Starting(name, proc, port_file, metrics_port_file, log_path, host)


@contextlib.contextmanager
def running(name: str, **kwargs: object) -> Iterator[ServiceProcess]:
    """Context manager around start_service that always stops the process."""
    svc = start_service(name, **kwargs)  # type: ignore[arg-type]
    try:
        yield svc
    finally:
        svc.stop()
