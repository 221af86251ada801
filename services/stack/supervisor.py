"""One stack's service processes: starting them in order, learning the ports they bound, waiting
until each serves, deleting every service and stopping them again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from collections.abc import Sequence

from services.common import config, security
from services.stack import api, output, plan, procs, statefiles

# The setting that names the service a load balancer process serves.
_BALANCED = "REPLICAPLANE_LOADBALANCER_SERVICE_NAME"
# Set on a balancer fleet: it serves every service, each on its own port.
_FLEET = "REPLICAPLANE_LOADBALANCER_FLEET"


class Stack:
    """The service processes of one stack and the services it created."""

    def __init__(
        self,
        specs: Sequence[plan.ProcessSpec],
        files: statefiles.StateFiles,
        out: api.Out,
        *,
        token: str = "",
        announce: bool = True,
    ) -> None:
        self.specs = list(specs)
        self.files = files
        self.out = out
        # False: say nothing about where each process serves (a stack that only cleans up).
        self.announce = announce
        self.served: set[str] = set()  # processes that answered their health check
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.created: list[str] = []
        self.ready = False
        # Where each process listens and serves HTTP; a planned port 0 becomes the bound one.
        self.addrs = {s.name: s.addr for s in self.specs}
        self.urls = {s.name: s.url for s in self.specs if s.url}
        self.metrics = {s.name: s.metrics_addr for s in self.specs if s.metrics_addr}
        self._controller = next(s.name for s in self.specs if s.component == "controller")
        self.generated_token = bool(token)
        # The generated token, else the user's own (from the environment).
        self.token = token or security.client_token()

    @property
    def controller_addr(self) -> str:
        """Where clients dial the controller (known once it bound its port)."""
        return plan.dial_addr(self.addrs[self._controller])

    def save(self) -> None:
        """Record what is running, for `down` and for a waiting `up --detach`."""
        state = {
            "pid": os.getpid(),
            "ready": self.ready,
            "metrics": {name: url for name in self.metrics if (url := self.metrics_url(name))},
            "controller": self.controller_addr,
            "token_file": self.files.token_path if self.generated_token else "",
            "services": self.created,
            # replicactl reads `component`, `pid`, `log` and a balancer's `service` to find logs.
            "processes": [
                {
                    "name": s.name,
                    "component": s.component,
                    "pid": self.procs[s.name].pid,
                    "addr": self.addrs[s.name],
                    "log": os.path.abspath(os.path.join(self.files.log_dir, f"{s.name}.log")),
                }
                | ({"url": self.urls[s.name]} if s.name in self.urls else {})
                | ({"service": s.env[_BALANCED]} if _BALANCED in s.env else {})
                | ({"fleet": True} if s.env.get(_FLEET) == "true" else {})
                for s in self.specs
                if s.name in self.procs
            ],
        }
        self.files.write(self.files.state_path, json.dumps(state, indent=2) + "\n")
        self._write_targets()

    def metrics_url(self, name: str) -> str:
        """The metrics URL of process `name`; "" when it has none or its port is not known yet."""
        addr = self.metrics.get(name, "")
        return f"http://{plan.dial_addr(addr)}/metrics" if addr and plan.split_addr(addr)[1] else ""

    def _write_targets(self) -> None:
        """Tell a Prometheus that reads this file (file_sd) where to scrape, one job per component."""
        groups = [
            {
                "targets": [plan.dial_addr(self.metrics[s.name])],
                "labels": {"job": s.component, "process": s.name, "stack": "local"},
            }
            for s in self.specs
            if self.metrics_url(s.name)
        ]
        os.makedirs(os.path.dirname(self.files.targets_path), exist_ok=True)
        self.files.write(self.files.targets_path, json.dumps(groups, indent=2) + "\n")

    def _port_files(self, spec: plan.ProcessSpec) -> dict[str, str]:
        files = {config.env_name(spec.component, "port_file"): os.path.join(self.files.port_dir, f"{spec.name}.port")}
        if spec.url:
            http = os.path.join(self.files.port_dir, f"{spec.name}.http.port")
            files[config.env_name(spec.component, "http_port_file")] = http
        if spec.metrics_addr:
            metrics = os.path.join(self.files.port_dir, f"{spec.name}.metrics.port")
            files[config.env_name(spec.component, "metrics_port_file")] = metrics
        return files

    def _launch(self, spec: plan.ProcessSpec, env: dict[str, str]) -> None:
        for path in self._port_files(spec).values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a stale port from an earlier run
        log_path = os.path.join(self.files.log_dir, f"{spec.name}.log")
        with open(log_path, "ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {spec.name}\n".encode())
            log.flush()
            self.procs[spec.name] = subprocess.Popen(
                spec.argv,
                cwd=procs.REPO,
                env=procs.child_env(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=procs.die_with_this_process(),
            )

    async def start(self, timeout: float) -> None:
        """Start every process, each in its own session, logging to the log dir.

        A process that dials others starts once they have bound their TCP ports (with port 0 it
        learns them from their port files); the others start at once. So the balancer and the
        dashboard, which send tokens to the controller, start only once the stack's controller
        holds its port, never while another process may hold it.

        Raises:
            api.StackError: a process it waits for exited or reported no port in `timeout` s.
        """
        os.makedirs(self.files.log_dir, exist_ok=True)
        os.makedirs(self.files.port_dir, exist_ok=True)
        for spec in self.specs:
            for name in {n for names in spec.needs.values() for n in names}:
                await self.bound(name, timeout)
            self._launch(spec, {**plan.resolve(spec, self.addrs), **self._port_files(spec)})
            self.save()

    async def bound(self, name: str, timeout: float) -> None:
        """Wait until process `name` has bound its TCP ports (its address, URL and metrics) and
        serves, and take the ports it got for a planned port 0. Its port files prove it: a health answer
        alone does not (another process may hold a fixed port, and would collect the token of
        every client that connects). A Unix socket's address is known in advance.

        Raises:
            api.StackError: it exited first, or wrote no port file in `timeout` s.
        """
        spec = next(s for s in self.specs if s.name == name)
        files = self._port_files(spec)
        # Port file -> what it holds the port of; a Unix socket's address has nothing to wait for.
        kinds = {} if plan.is_unix(self.addrs[name]) else {files[config.env_name(spec.component, "port_file")]: "addr"}
        if spec.url:
            kinds[files[config.env_name(spec.component, "http_port_file")]] = "url"
        if spec.metrics_addr:
            kinds[files[config.env_name(spec.component, "metrics_port_file")]] = "metrics"
        deadline = time.monotonic() + timeout
        while not _all_exist(list(kinds)):
            if self.procs[name].poll() is not None:
                raise api.StackError(self.failure(name))
            if time.monotonic() > deadline:
                raise api.StackError(f"{name} reported no port in {timeout:.0f} s (log: {self.log_path(name)})")
            await asyncio.sleep(0.05)
        changed = False
        for path, kind in kinds.items():
            port = int(await asyncio.to_thread(_read, path))
            if kind == "addr":
                host, planned = plan.split_addr(self.addrs[name])
                self.addrs[name] = f"{host}:{port}"
            elif kind == "metrics":
                host, planned = plan.split_addr(self.metrics[name])
                self.metrics[name] = f"{host}:{port}"
            else:
                host, planned = plan.split_addr(self.urls[name].removeprefix("http://"))
                self.urls[name] = f"http://{host}:{port}"
            changed = changed or planned != port
        if changed:
            self.save()

    def log_path(self, name: str) -> str:
        """The log file of process `name`."""
        return os.path.join(self.files.log_dir, f"{name}.log")

    def failure(self, name: str) -> str:
        """One line on why process `name` exited: the error it logged last (the setting or port at
        fault), its exit code otherwise, and its log."""
        proc = self.procs[name]
        log = self.log_path(name)
        started = name in self.served
        if reason := procs.exit_reason(log):
            return f"{name} {'stopped' if started else 'did not start'}: {reason} (log: {log})"
        return f"{name} exited with code {proc.returncode}{'' if started else ' before it served'} (log: {log})"

    def exited(self) -> str | None:
        """A message naming the first process that exited, or None while all run."""
        for spec in self.specs:
            proc = self.procs.get(spec.name)
            if proc is not None and proc.poll() is not None:
                return self.failure(spec.name)
        return None

    async def wait_serving(self, timeout: float) -> None:
        """Wait until every process's health check says SERVING."""
        for spec in self.specs:
            await self.bound(spec.name, timeout)
            proc = self.procs[spec.name]
            alive = lambda p=proc: p.poll() is None  # noqa: E731 - binds this loop's process
            var = f"REPLICAPLANE_{spec.component.upper()}_TLS_CERT_FILE"
            tls = spec.component != "controller" and bool(spec.env.get(var) or os.environ.get(var))
            addr = self.addrs[spec.name]
            try:
                await api.wait_serving(plan.dial_addr(addr), spec.grpc_service, timeout=timeout, alive=alive, tls=tls)
            except api.StackError:
                if proc.poll() is not None:
                    raise api.StackError(self.failure(spec.name)) from None
                raise api.StackError(
                    f"{spec.name} on {addr} was not serving after {timeout:.0f} s (log: {self.log_path(spec.name)})"
                ) from None
            self.served.add(spec.name)
            if not self.announce:
                continue
            self.out(f"{spec.name} serving on {addr} (log: {self.log_path(spec.name)})")
            if metrics_url := self.metrics_url(spec.name):
                self.out(f"{spec.name} metrics: {metrics_url}")
            if spec.component == "dashboard":
                self.out(output.dashboard_line(self.urls[spec.name]))
            elif spec.url and spec.env.get(_FLEET) == "true":
                self.out(
                    f"{spec.name}: every service gets its own URL, from {self.urls[spec.name]} up "
                    "(`replicactl status` shows each)"
                )
            elif spec.url:
                service = spec.env.get(_BALANCED, "")
                self.out(f"{spec.name}: {service} at {self.urls[spec.name]}")

    async def watch_exits(self) -> str:
        """Return once a process exits (bounded by the caller's cancellation)."""
        while (message := self.exited()) is None:
            await asyncio.sleep(0.5)
        return message

    async def delete_services(self, delete_timeout: float) -> list[str]:
        """Delete every service the controller has (not only the ones this stack created) and
        wait until they are gone, so no replica is left.

        Returns:
            Services that could not be confirmed deleted.
        """
        controller = self.procs.get("controller")
        if controller is not None and controller.poll() is None:
            client = api.Controller(self.controller_addr, token=self.token)
            try:
                return await client.delete_everything(timeout=delete_timeout, out=self.out, also=self.created)
            finally:
                await client.close()
        if self.created:
            self.out("warning: the controller is not running, so services could not be deleted")
        return list(self.created)

    async def stop_processes(self) -> None:
        """SIGTERM every process and wait for it (SIGKILL after procs.STOP_TIMEOUT_S)."""
        # The dashboard and the balancer, then the controller, so nothing calls a stopped service;
        # the provisioner last.
        rank = {"dashboard": -2, "loadbalancer": -1, "controller": 0, "prober": 1}
        order = sorted(self.specs, key=lambda s: rank.get(s.component, 2))
        pids = [(s.name, p.pid, f"services.{s.component}") for s in order if (p := self.procs.get(s.name))]
        await asyncio.to_thread(procs.terminate_pids, pids, self.out)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(1.0)  # reap
        self.out("stack stopped")


def _all_exist(paths: Sequence[str]) -> bool:
    return all(os.path.exists(p) for p in paths)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read().strip()
