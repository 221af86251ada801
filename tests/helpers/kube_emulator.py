"""An in-memory Kubernetes API (kmock's emulator) on 127.0.0.1, with a fake kubelet.

The emulator runs in a daemon thread with its own event loop, so both in-process tests and
provisioner processes (through a kubeconfig file) can talk to it. It has no scheduler,
kubelet, grace periods, resourceVersions or selector filtering; the fake kubelet in the same
loop plays scheduler and kubelet for the Pods of one namespace:

- A Pod whose node selector names a label the fake node lacks, or that asks for more of a
  resource than the node has, stays Pending with `PodScheduled=False, reason=Unschedulable`.
- An image under `fake.invalid/` fails to pull (`ErrImagePull`, then `ImagePullBackOff`).
- Otherwise the container's command runs as a local process group with the Pod's env
  (secret references resolved), in a directory of its own. The Pod "network" is loopback:
  each declared container port is mapped to a free local port (substituted in the command
  and env values as the local backend does), `PORT` and `HOST` follow, and the serving port
  is published in the `fake-kubelet.test/port` annotation. Paths under /tmp and the
  termination message path are mapped into the Pod's directory, as a container has its own.
- Status goes Pending, then Running with podIP 127.0.0.1 (`started` once an exec startup
  probe passes; probes run every 50 ms, whatever periodSeconds says), Ready once the port
  accepts, and Succeeded or Failed with the exit code and termination message when it ends.
- Graceful deletion: the fake kubelet puts a finalizer of its own on every Pod; a deleted Pod
  stays terminating while its process group gets SIGTERM (SIGKILL after `kill_grace_s`) and
  is removed once the process is gone, so "the Pod object is gone" implies "the app is dead",
  as on a real node.

Chaos hooks model what others do to Pods: `delete_pod` (node loss, someone's kubectl),
`evict` (kubelet eviction: Failed/Evicted with a DisruptionTarget condition), `hold` and
`release` (a finalizer that keeps a deleted Pod terminating).

kmock quirks (pinned kmock==0.8): resources must be declared before an empty list or watch
works; lists say resourceVersion "..."; every watch replays all objects as ADDED and never
ends by itself; DELETE removes at once unless a finalizer holds the object; patches are JSON
merge patches (lists replaced, so whole status lists are sent each time).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import kmock
from kubernetes.aio import client as kc

from services.provisioner import ports as port_rules

T = TypeVar("T")

PORT_ANNOTATION = "fake-kubelet.test/port"
HOLD_FINALIZER = "fake-kubelet.test/hold"
KUBELET_FINALIZER = "fake-kubelet.test/running"
NODE = "fake-node"
NODE_LABELS = {"kubernetes.io/hostname": NODE, "topology.kubernetes.io/zone": "fake-zone-a"}
NODE_CAPACITY = {"cpu": 8.0, "memory": 32 * 2**30, "nvidia.com/gpu": 0.0}
BAD_IMAGE_PREFIX = "fake.invalid/"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _quantity(text: str) -> float:
    """A Kubernetes quantity as a number (enough of the grammar for tests)."""
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * units[unit]
    return float(text)


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spawn(command: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen[bytes]:
    """Start a container's command as its own process group, output to container.log."""
    with open(os.path.join(cwd, "container.log"), "ab") as log:
        return subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


@dataclasses.dataclass
class _FakePod:
    name: str
    token: str
    dir: str
    status: dict[str, Any] = dataclasses.field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    task: asyncio.Task[None] | None = None
    deleted: bool = False


class FakeKubelet:
    """Plays scheduler and kubelet for the Pods of one namespace; see the module docstring."""

    def __init__(self, url: str, namespace: str, workdir: str, *, kill_grace_s: float = 2.0) -> None:
        self.url = url
        self.namespace = namespace
        self.workdir = workdir
        self.kill_grace_s = kill_grace_s
        self.pods: dict[str, _FakePod] = {}
        self._api: kc.ApiClient | None = None
        self._core: Any = None

    async def run(self) -> None:
        """List and watch Pods forever (relisting on idle), acting on each."""
        self._api = kc.ApiClient(kc.Configuration(host=self.url))
        self._core = kc.CoreV1Api(self._api)
        try:
            while True:
                try:
                    listing = await self._core.list_namespaced_pod_without_preload_content(self.namespace)
                    try:
                        pods = json.loads(await listing.read())
                    finally:
                        listing.release()
                    for pod in pods.get("items") or []:
                        await self._on_pod("ADDED", pod)
                    resp = await self._core.list_namespaced_pod_without_preload_content(self.namespace, watch=True)
                    try:
                        while True:
                            line = await asyncio.wait_for(resp.content.readline(), 2.0)
                            if not line:
                                break
                            event = json.loads(line)
                            await self._on_pod(event["type"], event["object"])
                    finally:
                        resp.release()
                except (TimeoutError, OSError, kc.exceptions.ApiException):
                    await asyncio.sleep(0.01)
        finally:
            tasks = [p.task for p in self.pods.values() if p.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for pod in self.pods.values():
                self._kill(pod, grace_s=0)
            await self._api.close()

    async def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        name = meta.get("name", "")
        token = (meta.get("annotations") or {}).get("replicaplane.dev/token", "")
        fake = self.pods.get(name)
        if fake is not None and fake.token != token:
            if kind == "DELETED":
                return  # an older incarnation's last event
            self._kill(fake, grace_s=0)
            fake = None
        if kind == "DELETED":
            if fake is not None:
                fake.deleted = True
                self._kill(fake, grace_s=0)
                self.pods.pop(name, None)
            return
        if meta.get("deletionTimestamp"):
            if fake is None or not fake.deleted:
                # Graceful deletion: the object goes once the container is dead, as with a kubelet.
                if fake is not None:
                    fake.deleted = True
                asyncio.get_running_loop().create_task(self._terminate(name, fake))
            return
        if fake is not None or (pod.get("status") or {}).get("phase"):
            return  # known, or already handled by an earlier fake kubelet
        fake = _FakePod(name=name, token=token, dir=os.path.join(self.workdir, f"{name}-{token[:8]}"))
        self.pods[name] = fake
        finalizers = [*(meta.get("finalizers") or []), KUBELET_FINALIZER]
        await self._raw("patch_namespaced_pod", name, self.namespace, {"metadata": {"finalizers": finalizers}})
        fake.task = asyncio.get_running_loop().create_task(self._run_pod(fake, pod))

    async def _raw(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        """Call the API without the client's models; None on 404 (or any error status)."""
        resp = await getattr(self._core, f"{method}_without_preload_content")(*args, **kwargs)
        try:
            if resp.status >= 400:
                return None
            return dict(json.loads(await resp.read()))
        finally:
            resp.release()

    async def _terminate(self, name: str, fake: _FakePod | None) -> None:
        """SIGTERM, grace, SIGKILL; once the process is gone, drop our finalizer."""
        if fake is not None:
            if fake.task is not None:
                fake.task.cancel()
            self._kill(fake, grace_s=self.kill_grace_s)
            while fake.proc is not None and fake.proc.poll() is None:
                await asyncio.sleep(0.02)
        await self._drop_finalizer(name, KUBELET_FINALIZER)

    async def _drop_finalizer(self, name: str, finalizer: str) -> None:
        pod = await self._raw("read_namespaced_pod", name, self.namespace)
        if pod is None:
            return
        left = [f for f in (pod["metadata"].get("finalizers") or []) if f != finalizer]
        # An empty list would not do: this emulator deletes an object when finalizers go to null.
        await self._raw("patch_namespaced_pod", name, self.namespace, {"metadata": {"finalizers": left or None}})

    async def _patch(self, fake: _FakePod, body: dict[str, Any]) -> None:
        if not fake.deleted:
            await self._raw("patch_namespaced_pod", fake.name, self.namespace, body)

    async def _set_status(self, fake: _FakePod, **fields: Any) -> None:
        fake.status.update(fields)
        await self._patch(fake, {"status": dict(fake.status)})

    async def _run_pod(self, fake: _FakePod, pod: dict[str, Any]) -> None:
        spec = pod.get("spec") or {}
        container = (spec.get("containers") or [{}])[0]
        problem = self._unschedulable(spec)
        scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}
        if problem:
            await self._set_status(
                fake,
                phase="Pending",
                conditions=[{**scheduled, "status": "False", "reason": "Unschedulable", "message": problem}],
            )
            return
        await self._patch(fake, {"spec": {"nodeName": NODE}})
        base = {
            "name": container.get("name", "c"),
            "image": container.get("image", ""),
            "imageID": "",
            "restartCount": 0,
        }
        if str(container.get("image", "")).startswith(BAD_IMAGE_PREFIX):
            for reason in ("ErrImagePull", "ImagePullBackOff"):
                message = f'Back-off pulling image "{container["image"]}"'
                await self._set_status(
                    fake,
                    phase="Pending",
                    conditions=[scheduled],
                    containerStatuses=[
                        {
                            **base,
                            "ready": False,
                            "started": False,
                            "state": {"waiting": {"reason": reason, "message": message}},
                        }
                    ],
                )
                await asyncio.sleep(0.05)
            return
        try:
            env, command, term_log = await self._prepare(fake, container)
        except (OSError, ValueError, kc.exceptions.ApiException) as exc:
            waiting = {"reason": "CreateContainerConfigError", "message": str(exc)}
            await self._set_status(
                fake,
                phase="Pending",
                conditions=[scheduled],
                containerStatuses=[{**base, "ready": False, "started": False, "state": {"waiting": waiting}}],
            )
            return
        fake.proc = _spawn(command, env, fake.dir)
        await self._patch(fake, {"metadata": {"annotations": {PORT_ANNOTATION: str(fake.port)}}})
        probe = container.get("startupProbe")
        started = probe is None
        running = {**base, "ready": False, "started": started, "state": {"running": {"startedAt": _now()}}}
        await self._set_status(
            fake,
            phase="Running",
            podIP="127.0.0.1",
            hostIP="127.0.0.1",
            startTime=_now(),
            conditions=[scheduled, {"type": "Ready", "status": "False"}],
            containerStatuses=[running],
        )
        ready = False
        while fake.proc.poll() is None and not fake.deleted:
            if not started and probe is not None:
                cmd = probe.get("exec", {}).get("command") or ["true"]
                result = await asyncio.to_thread(
                    subprocess.run, cmd, env=env, cwd=fake.dir, capture_output=True, check=False
                )
                if result.returncode == 0:
                    started = True
                    running = {**running, "started": True}
                    await self._set_status(fake, containerStatuses=[running])
            if started and not ready and await asyncio.to_thread(self._accepts, fake.port):
                ready = True
                running = {**running, "ready": True}
                await self._set_status(
                    fake, conditions=[scheduled, {"type": "Ready", "status": "True"}], containerStatuses=[running]
                )
            await asyncio.sleep(0.05)
        if fake.deleted:
            return
        code = fake.proc.wait()
        code = 128 - code if code < 0 else code  # killed by signal N: 128+N, as a runtime reports it
        message = ""
        with contextlib.suppress(OSError):
            message = _read(term_log)
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "finishedAt": _now()}
        if message:
            terminated["message"] = message
        await self._set_status(
            fake,
            phase="Succeeded" if code == 0 else "Failed",
            conditions=[scheduled, {"type": "Ready", "status": "False"}],
            containerStatuses=[{**running, "ready": False, "state": {"terminated": terminated}}],
        )

    def _unschedulable(self, spec: dict[str, Any]) -> str:
        for key, value in (spec.get("nodeSelector") or {}).items():
            if NODE_LABELS.get(key) != value:
                return "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
        for container in spec.get("containers") or []:
            res = container.get("resources") or {}
            for name, text in {**(res.get("requests") or {}), **(res.get("limits") or {})}.items():
                if _quantity(str(text)) > NODE_CAPACITY.get(name, 0.0):
                    return f"0/1 nodes are available: 1 Insufficient {name}."
        return ""

    async def _prepare(self, fake: _FakePod, container: dict[str, Any]) -> tuple[dict[str, str], list[str], str]:
        os.makedirs(os.path.join(fake.dir, "tmp"), exist_ok=True)
        declared = [int(p["containerPort"]) for p in container.get("ports") or []]
        mapping = {p: _free_port() for p in declared}
        serving = next((int(p["containerPort"]) for p in container.get("ports") or [] if p.get("name") == "serve"), 0)
        fake.port = mapping.get(serving) or (next(iter(mapping.values())) if mapping else _free_port())
        term_path = container.get("terminationMessagePath") or "/dev/termination-log"
        term_log = os.path.join(fake.dir, "termination-log")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        for item in container.get("env") or []:
            if "valueFrom" in item:
                ref = item["valueFrom"]["secretKeyRef"]
                secret = await self._core.read_namespaced_secret(ref["name"], self.namespace)
                value = base64.b64decode((secret.data or {})[ref["key"]]).decode()
            else:
                value = str(item.get("value", ""))
            if value == term_path:
                value = term_log
            elif value.startswith("/tmp/"):
                value = os.path.join(fake.dir, "tmp", value[len("/tmp/") :])
            env[item["name"]] = port_rules.substitute(value, mapping)
        env["PORT"] = str(fake.port)
        env["HOST"] = "127.0.0.1"
        command = [
            port_rules.substitute(str(a), mapping)
            for a in (container.get("command") or []) + (container.get("args") or [])
        ]
        return env, command, term_log

    @staticmethod
    def _accepts(port: int) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            return False

    def _kill(self, fake: _FakePod, *, grace_s: float) -> None:
        proc = fake.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        if grace_s > 0:
            asyncio.get_running_loop().call_later(grace_s, functools.partial(self._kill, fake, grace_s=0))
        else:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)

    # ---- chaos hooks (run on the emulator's loop) ---------------------------------------------

    async def delete_pod(self, name: str) -> None:
        """Someone else deletes the Pod (node loss, a spot reclaim, kubectl delete)."""
        fake = self.pods.get(name)
        if fake is not None:
            fake.deleted = True
            self._kill(fake, grace_s=0)
        await self._raw("delete_namespaced_pod", name, self.namespace, grace_period_seconds=0)
        await self._drop_finalizer(name, KUBELET_FINALIZER)

    async def evict(self, name: str) -> None:
        """The kubelet evicts the Pod under node pressure: Failed, reason Evicted."""
        fake = self.pods[name]
        self._kill(fake, grace_s=0)
        if fake.task is not None:
            fake.task.cancel()
        condition = {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "TerminationByKubelet",
            "message": "The node was low on resource: memory.",
        }
        statuses = [
            {**s, "ready": False, "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}
            for s in fake.status.get("containerStatuses") or []
        ]
        await self._set_status(
            fake,
            phase="Failed",
            reason="Evicted",
            message="The node was low on resource: memory.",
            conditions=[*(fake.status.get("conditions") or []), condition],
            containerStatuses=statuses,
        )

    async def hold(self, name: str) -> None:
        """Add a finalizer: a delete then leaves the Pod terminating until release()."""
        pod = await self._raw("read_namespaced_pod", name, self.namespace)
        finalizers = [*((pod or {}).get("metadata", {}).get("finalizers") or []), HOLD_FINALIZER]
        await self._raw("patch_namespaced_pod", name, self.namespace, {"metadata": {"finalizers": finalizers}})

    async def release(self, name: str) -> None:
        """Remove the finalizer hold() added."""
        await self._drop_finalizer(name, HOLD_FINALIZER)

    def alive(self) -> list[str]:
        """Names of Pods whose process runs."""
        return sorted(n for n, f in self.pods.items() if f.proc is not None and f.proc.poll() is None)


class Emulator:
    """kmock's emulator plus a FakeKubelet, on 127.0.0.1 in a daemon thread; see the module docstring."""

    def __init__(self, workdir: str, *, namespace: str = "replicas") -> None:
        self.workdir = workdir
        self.namespace = namespace
        self.url = ""
        self.kubelet: FakeKubelet | None = None
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._emu: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kube-emulator", daemon=True)

    def start(self) -> Emulator:
        """Start and wait until the API answers."""
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"emulator did not start: {self._error!r}")
        return self

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        emu = kmock.KubernetesEmulator()
        for resource in ("v1/pods", "v1/services", "v1/secrets", "v1/events", "v1/namespaces"):
            emu.resources[resource]
        self._emu = emu
        async with emu, kmock.Server(emu, host="127.0.0.1") as server:
            self.url = str(server.url).rstrip("/")
            self.kubelet = FakeKubelet(self.url, self.namespace, os.path.join(self.workdir, "pods"))
            kubelet = asyncio.get_running_loop().create_task(self.kubelet.run())
            self._ready.set()
            await self._stop.wait()
            kubelet.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await kubelet

    def stop(self) -> None:
        """Stop the kubelet (killing every Pod process) and the server."""
        if self._stop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        shutil.rmtree(os.path.join(self.workdir, "pods"), ignore_errors=True)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coro` on the emulator's loop."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` run on the emulator's loop, from another loop."""
        return await asyncio.wrap_future(self.submit(coro))

    def logged(self, method: str) -> list[tuple[str, dict[str, str]]]:
        """Requests the API received with `method`: (path, query) pairs."""
        out = []
        for req in list(self._emu):
            if str(req.method).upper().endswith(method.upper()):
                out.append((req.url.path, dict(req.params)))
        return out

    def kubeconfig(self, path: str) -> str:
        """Write a kubeconfig for the emulator (no auth, no TLS) to `path`."""
        text = (
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: emu\n  cluster:\n    server: {self.url}\n"
            "users:\n- name: emu\n  user: {}\n"
            f"contexts:\n- name: emu\n  context:\n    cluster: emu\n    user: emu\n    namespace: {self.namespace}\n"
            "current-context: emu\n"
        )
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        return path

    async def pod(self, name: str) -> dict[str, Any] | None:
        """The Pod `name` as stored, or None."""

        async def read() -> dict[str, Any] | None:
            async with kc.ApiClient(kc.Configuration(host=self.url)) as api:
                resp = await kc.CoreV1Api(api).read_namespaced_pod_without_preload_content(name, self.namespace)
                try:
                    return None if resp.status == 404 else dict(json.loads(await resp.read()))
                finally:
                    resp.release()

        return await self.call(read())

    async def names(self, kind: str = "pod") -> list[str]:
        """Names of the namespace's objects of `kind` (pod, service, secret)."""

        async def read() -> list[str]:
            async with kc.ApiClient(kc.Configuration(host=self.url)) as api:
                method = getattr(kc.CoreV1Api(api), f"list_namespaced_{kind}_without_preload_content")
                resp = await method(self.namespace)
                try:
                    items = json.loads(await resp.read()).get("items") or []
                finally:
                    resp.release()
                return sorted(i["metadata"]["name"] for i in items)

        return await self.call(read())

    def wait_until(self, pred: Any, timeout: float = 10.0) -> None:
        """Poll `pred()` (bounded) until true; fail after `timeout`."""
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached")
            time.sleep(0.02)
