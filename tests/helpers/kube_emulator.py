"""A Kubernetes API for tests (tests/helpers/kube_api.py) on 127.0.0.1, with a fake kubelet.

The API server and the kubelet run in a daemon thread with its own event loop, so both
in-process tests and provisioner processes (through a kubeconfig file) can talk to them. The
API server keeps the real one's protocol (resourceVersions, watch resume, 410, bookmarks,
graceful deletion, finalizers, ownerReferences garbage collection) and takes scripted faults;
see its module docstring. The fake kubelet plays scheduler and kubelet for the Pods of one
namespace, through the same API as any client (its requests are never faulted):

- Scheduling: the cluster has `nodes` (one `fake-node` with 8 CPUs, 32 GiB and no GPUs unless
  told otherwise), each with labels and allocatable resources. A Pod is bound (the binding
  subresource) to the first node whose labels match its node selector and whose free resources
  (allocatable minus the requests of the Pods bound there that have not ended) cover its
  requests. A Pod no node fits stays Pending with `PodScheduled=False, reason=Unschedulable`
  and the scheduler's kind of message (`0/2 nodes are available: 1 Insufficient
  nvidia.com/gpu, 1 node(s) didn't match Pod's node affinity/selector.`), and is placed once
  a Pod ends or goes or `set_nodes` changes the nodes, as the real scheduler retries.
- An image under `fake.invalid/` fails to pull (`ErrImagePull`, then `ImagePullBackOff`).
- Otherwise the container's command runs as a local process group with the Pod's env
  (secret references resolved), in a directory of its own. The Pod "network" is loopback:
  each declared container port is mapped to a free local port (substituted in the command
  and env values as the local backend does), `PORT` and `HOST` follow, and the serving port
  is published in the `fake-kubelet.test/port` annotation. Paths under /tmp and the
  termination message path are mapped into the Pod's directory, as a container has its own.
- Status (through the status subresource) goes Pending, then Running with podIP 127.0.0.1
  (`started` once an exec startup probe passes; probes run every 50 ms, whatever
  periodSeconds says), Ready once the port accepts, and Succeeded or Failed with the exit code
  and termination message when it ends.
- A Pod being deleted gets SIGTERM, SIGKILL after its deletionGracePeriodSeconds, and once
  the process is gone the kubelet deletes it with grace 0, so "the Pod object is gone"
  implies "the app is dead", as on a real node.
- `exec` (the API's pods/exec) runs a command in a running container: a process with the
  container's env, in its directory. Every process of a Pod (its command, what is exec'd, what
  they start in groups of their own) carries a marker in its environment, and all of them die
  with the container, as in a real one's PID namespace.

Chaos hooks model what others do to Pods: `delete_pod` (node loss, someone's kubectl),
`evict` (kubelet eviction: Failed/Evicted with a DisruptionTarget condition), `hold` and
`release` (a finalizer that keeps a deleted Pod terminating), `set_nodes` (nodes added or
removed, as a cluster autoscaler does). Faults of the API itself are
`Emulator.api.fail`, `stall`, `compact` and `end_watches`, called through `Emulator.run`.
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
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import aiohttp
from kubernetes.aio import client as kc

from services.provisioner import ports as port_rules
from services.provisioner import procs
from tests.helpers import kube_api

T = TypeVar("T")

PORT_ANNOTATION = "fake-kubelet.test/port"
LOG_FILE = "container.log"
POD_MARKER = "FAKE_KUBELET_POD"
"""Environment marker on every process of a fake Pod: its directory."""
HOLD_FINALIZER = "fake-kubelet.test/hold"
KUBELET_AGENT = "fake-kubelet"
NODE = "fake-node"
ZONE_LABEL = "topology.kubernetes.io/zone"
BAD_IMAGE_PREFIX = "fake.invalid/"
MERGE = {"_content_type": kube_api.MERGE_PATCH}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(frozen=True)
class Node:
    """A node of the emulated cluster: its labels and its allocatable resources.

    Attributes:
        name: the node name (also its `kubernetes.io/hostname` label).
        labels: node labels, matched against Pods' node selectors.
        allocatable: resource -> amount: `cpu` in cores, `memory` in bytes, extended resources
            (`nvidia.com/gpu`) in units. A resource not named is 0.
    """

    name: str
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    allocatable: dict[str, float] = dataclasses.field(default_factory=dict)

    def all_labels(self) -> dict[str, str]:
        """The labels with `kubernetes.io/hostname`, as the kubelet registers them."""
        return {"kubernetes.io/hostname": self.name, **self.labels}


def default_nodes() -> list[Node]:
    """One node with 8 CPUs, 32 GiB and no accelerators, in zone fake-zone-a."""
    return [Node(NODE, {ZONE_LABEL: "fake-zone-a"}, {"cpu": 8.0, "memory": 32 * 2**30})]


def gpu_node(name: str, accelerator: str, count: int, **labels: str) -> Node:
    """A node with `count` GPUs of `accelerator`, labelled as the kubernetes backend's default
    `kubernetes_accelerator_label` expects (the lowercased name)."""
    return Node(
        name,
        {ZONE_LABEL: "fake-zone-a", "replicaplane.dev/accelerator": accelerator.lower(), **labels},
        {"cpu": 8.0, "memory": 32 * 2**30, "nvidia.com/gpu": float(count)},
    )


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spawn(command: list[str], env: dict[str, str], cwd: str) -> tuple[subprocess.Popen[bytes], threading.Thread]:
    """Start a container's command as its own process group; a thread writes its output to
    container.log, each line stamped with the time it was read (as the kubelet's CRI logs are)."""
    proc = subprocess.Popen(
        command,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    pump = threading.Thread(
        target=_pump, args=(proc.stdout, os.path.join(cwd, LOG_FILE)), name="fake-kubelet-log", daemon=True
    )
    pump.start()
    return proc, pump


def stamp(ns: int | None = None) -> str:
    """An RFC 3339 time with nanoseconds, as the kubelet stamps log lines."""
    ns = time.time_ns() if ns is None else ns
    whole = datetime.datetime.fromtimestamp(ns // 1_000_000_000, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{whole}.{ns % 1_000_000_000:09d}Z"


def _pump(stream: Any, path: str) -> None:
    """Copy a container's output to its log file, line by line, each with its time."""
    with stream, open(path, "ab") as out:
        for line in iter(stream.readline, b""):
            out.write(stamp().encode() + b" " + line)
            out.flush()


def _kill_marked(pod_dir: str) -> None:
    """SIGKILL every process of a fake Pod, whatever group it is in. The scan runs again until it
    finds none (bounded): a process forked while one scan ran is not in it."""
    for _ in range(50):
        pids = procs.pids_with_env(POD_MARKER, pod_dir)
        if not pids:
            return
        procs.signal_pids(pids, signal.SIGKILL)
        time.sleep(0.005)


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
    pump: threading.Thread | None = None
    port: int = 0
    task: asyncio.Task[None] | None = None
    deleted: bool = False
    env: dict[str, str] = dataclasses.field(default_factory=dict)


def _token(pod: dict[str, Any]) -> str:
    return str(((pod.get("metadata") or {}).get("annotations") or {}).get("replicaplane.dev/token", ""))


class FakeKubelet:
    """Plays scheduler and kubelet for the Pods of one namespace; see the module docstring."""

    def __init__(self, url: str, namespace: str, workdir: str, nodes: list[Node] | None = None) -> None:
        self.url = url
        self.namespace = namespace
        self.workdir = workdir
        self.nodes = list(nodes) if nodes is not None else default_nodes()
        self.pods: dict[str, _FakePod] = {}
        # Pod name -> (node, requests) of every Pod bound to a node that has not ended.
        self.placed: dict[str, tuple[str, dict[str, float]]] = {}
        self._freed = asyncio.Event()
        self._api: kc.ApiClient | None = None
        self._core: Any = None

    async def run(self) -> None:
        """List, then watch from the list's version (relisting on 410 and errors), forever."""
        self._api = kc.ApiClient(kc.Configuration(host=self.url))
        self._api.user_agent = KUBELET_AGENT
        self._core = kc.CoreV1Api(self._api)
        version = ""
        try:
            while True:
                try:
                    if not version:
                        version = await self._relist()
                    version = await self._watch(version)
                except (TimeoutError, OSError, aiohttp.ClientError, kc.exceptions.ApiException, ValueError):
                    version = ""
                    await asyncio.sleep(0.01)
        finally:
            tasks = [p.task for p in self.pods.values() if p.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for pod in self.pods.values():
                self._kill(pod, grace_s=0)
            await self._api.close()

    async def _relist(self) -> str:
        listing = await self._raw("list_namespaced_pod", self.namespace)
        if listing is None:
            raise ValueError("list failed")
        listed = set()
        for pod in listing.get("items") or []:
            listed.add(pod["metadata"]["name"])
            await self._on_pod("ADDED", pod)
        for name in [n for n in self.pods if n not in listed]:
            self._forget(name)
        return str(listing["metadata"]["resourceVersion"])

    async def _watch(self, version: str) -> str:
        """One watch; returns the version to resume from ("" to relist)."""
        resp = await self._core.list_namespaced_pod_without_preload_content(
            self.namespace, watch=True, resource_version=version, allow_watch_bookmarks=True, timeout_seconds=30
        )
        try:
            if resp.status >= 400:
                return ""
            while line := await asyncio.wait_for(resp.content.readline(), 35):
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    return ""
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if event.get("type") != "BOOKMARK":
                    await self._on_pod(event["type"], obj)
            return version
        finally:
            resp.release()

    def _forget(self, name: str) -> None:
        self._release(name)
        fake = self.pods.pop(name, None)
        if fake is not None:
            fake.deleted = True
            if fake.task is not None:
                fake.task.cancel()
            self._kill(fake, grace_s=0)

    async def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        name = meta.get("name", "")
        fake = self.pods.get(name)
        if fake is not None and fake.token != _token(pod):
            if kind == "DELETED":
                return  # an older incarnation's last event
            self._forget(name)
            fake = None
        if kind == "DELETED":
            self._forget(name)
            return
        if meta.get("deletionTimestamp"):
            if fake is None or not fake.deleted:
                if fake is not None:
                    fake.deleted = True
                grace = float(meta.get("deletionGracePeriodSeconds") or 0)
                asyncio.get_running_loop().create_task(self._terminate(name, fake, grace))
            return
        spec = pod.get("spec") or {}
        if fake is not None or spec.get("nodeName") or (pod.get("status") or {}).get("conditions"):
            return  # known, or handled by another kubelet
        fake = _FakePod(name=name, token=_token(pod), dir=os.path.join(self.workdir, f"{name}-{_token(pod)[:8]}"))
        self.pods[name] = fake
        fake.task = asyncio.get_running_loop().create_task(self._run_pod(fake, pod))

    async def _raw(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        """Call the API without the client's models; None on any error status."""
        resp = await getattr(self._core, f"{method}_without_preload_content")(*args, **kwargs)
        try:
            if resp.status >= 400:
                return None
            return dict(json.loads(await resp.read()))
        finally:
            resp.release()

    async def _terminate(self, name: str, fake: _FakePod | None, grace_s: float) -> None:
        """SIGTERM, SIGKILL after the grace period; once the process is gone, finish the deletion."""
        if fake is not None:
            if fake.task is not None:
                fake.task.cancel()
            self._kill(fake, grace_s=grace_s)
            while fake.proc is not None and fake.proc.poll() is None:
                await asyncio.sleep(0.02)
        self._release(name)
        await self._raw("delete_namespaced_pod", name, self.namespace, grace_period_seconds=0)

    async def _bind(self, fake: _FakePod, node: str) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": fake.name},
            "target": {"kind": "Node", "name": node},
        }
        await self._raw("create_namespaced_pod_binding", fake.name, self.namespace, body)

    async def _patch(self, fake: _FakePod, body: dict[str, Any]) -> None:
        if not fake.deleted:
            await self._raw("patch_namespaced_pod", fake.name, self.namespace, body, **MERGE)

    async def _set_status(self, fake: _FakePod, **fields: Any) -> None:
        fake.status.update(fields)
        if not fake.deleted:
            await self._raw(
                "patch_namespaced_pod_status", fake.name, self.namespace, {"status": dict(fake.status)}, **MERGE
            )

    async def _run_pod(self, fake: _FakePod, pod: dict[str, Any]) -> None:
        spec = pod.get("spec") or {}
        container = (spec.get("containers") or [{}])[0]
        said = ""
        while True:
            node, problem = self._place(fake.name, pod)
            if node:
                break
            if problem != said:
                said = problem
                condition = {"type": "PodScheduled", "status": "False", "lastTransitionTime": _now()}
                condition.update(reason="Unschedulable", message=problem)
                await self._set_status(fake, phase="Pending", conditions=[condition])
            await self._freed.wait()
        scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}
        await self._bind(fake, node)
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
        fake.proc, fake.pump = _spawn(command, env, fake.dir)
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
        _kill_marked(fake.dir)  # the container's end is the end of every process in it
        code = 128 - code if code < 0 else code  # killed by signal N: 128+N, as a runtime reports it
        message = ""
        with contextlib.suppress(OSError):
            message = _read(term_log)
        self._release(fake.name)
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "finishedAt": _now()}
        if message:
            terminated["message"] = message
        await self._set_status(
            fake,
            phase="Succeeded" if code == 0 else "Failed",
            conditions=[scheduled, {"type": "Ready", "status": "False"}],
            containerStatuses=[{**running, "ready": False, "state": {"terminated": terminated}}],
        )

    def _place(self, name: str, pod: dict[str, Any]) -> tuple[str, str]:
        """Pick a node for Pod `name` and reserve its requests there: (node, "") or ("", why not).

        Synchronous, so two Pods never take the same free resources.
        """
        selector = (pod.get("spec") or {}).get("nodeSelector") or {}
        wanted = kube_api.pod_requests(pod)
        used: dict[str, dict[str, float]] = {}
        for node, requests in self.placed.values():
            for resource, amount in requests.items():
                used.setdefault(node, {}).setdefault(resource, 0.0)
                used[node][resource] += amount
        reasons: dict[str, int] = {}
        for node in self.nodes:
            labels = node.all_labels()
            if any(labels.get(k) != v for k, v in selector.items()):
                why = "node(s) didn't match Pod's node affinity/selector"
                reasons[why] = reasons.get(why, 0) + 1
                continue
            have = used.get(node.name, {})
            short = [
                r for r, amount in sorted(wanted.items()) if amount > node.allocatable.get(r, 0.0) - have.get(r, 0.0)
            ]
            if short:
                for resource in short:
                    reasons[f"Insufficient {resource}"] = reasons.get(f"Insufficient {resource}", 0) + 1
                continue
            self.placed[name] = (node.name, wanted)
            return node.name, ""
        summary = ", ".join(f"{count} {why}" for why, count in sorted(reasons.items()))
        return "", f"0/{len(self.nodes)} nodes are available: {summary}."

    def _release(self, name: str) -> None:
        """Pod `name` ended or went: its node's resources are free again; pending Pods try again."""
        if self.placed.pop(name, None) is not None:
            self._reschedule()

    def _reschedule(self) -> None:
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()

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
        env[POD_MARKER] = fake.dir
        fake.env = env
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
        if grace_s <= 0:
            _kill_marked(fake.dir)
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

    async def delete_pod(self, name: str, grace_s: int = 0) -> None:
        """Someone else deletes the Pod (node loss, a spot reclaim, kubectl delete)."""
        if grace_s == 0:
            self._forget(name)
        await self._raw("delete_namespaced_pod", name, self.namespace, grace_period_seconds=grace_s)

    async def evict(self, name: str) -> None:
        """The kubelet evicts the Pod under node pressure: Failed, reason Evicted."""
        fake = self.pods[name]
        self._kill(fake, grace_s=0)
        if fake.task is not None:
            fake.task.cancel()
        self._release(name)
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

    async def set_nodes(self, nodes: list[Node]) -> None:
        """The cluster's nodes change (a cluster autoscaler adds one, a node pool is removed).
        Pods already bound stay where they are; Pods waiting for a node try again."""
        self.nodes = list(nodes)
        self._reschedule()

    async def hold(self, name: str) -> None:
        """Add a finalizer: a delete then leaves the Pod terminating until release()."""
        pod = await self._raw("read_namespaced_pod", name, self.namespace)
        finalizers = [*((pod or {}).get("metadata", {}).get("finalizers") or []), HOLD_FINALIZER]
        await self._raw("patch_namespaced_pod", name, self.namespace, {"metadata": {"finalizers": finalizers}}, **MERGE)

    async def release(self, name: str) -> None:
        """Remove the finalizer hold() added."""
        pod = await self._raw("read_namespaced_pod", name, self.namespace)
        left = [f for f in ((pod or {}).get("metadata", {}).get("finalizers") or []) if f != HOLD_FINALIZER]
        await self._raw(
            "patch_namespaced_pod", name, self.namespace, {"metadata": {"finalizers": left or None}}, **MERGE
        )

    def log_source(self, namespace: str, name: str) -> kube_api.LogSource | None:
        """Where the API server reads Pod `name`'s log: None until its container started."""
        fake = self.pods.get(name)
        if namespace != self.namespace or fake is None or fake.proc is None:
            return None
        pump = fake.pump
        return kube_api.LogSource(
            path=os.path.join(fake.dir, LOG_FILE), done=lambda: pump is None or not pump.is_alive()
        )

    def alive(self) -> list[str]:
        """Names of Pods whose process runs, and `<pod dir> (pid N)` for each process left of a
        Pod whose container ended (none should be: they die with it)."""
        running = {n: f for n, f in self.pods.items() if f.proc is not None and f.proc.poll() is None}
        out = sorted(running)
        live_dirs = {f.dir for f in running.values()}
        root = os.path.abspath(self.workdir)
        for pid in procs.pids_with_env(POD_MARKER):
            where = procs.env_value(pid, POD_MARKER) or ""
            if where.startswith(root + os.sep) and where not in live_dirs:
                out.append(f"{os.path.basename(where)} (pid {pid})")
        return out

    async def exec_source(self, namespace: str, name: str, command: list[str]) -> asyncio.subprocess.Process | None:
        """Start `command` in Pod `name`'s running container (the API's pods/exec); None if it does not run."""
        fake = self.pods.get(name)
        if namespace != self.namespace or fake is None or fake.proc is None or fake.proc.poll() is not None:
            return None
        if fake.deleted:
            return None
        return await asyncio.create_subprocess_exec(
            *command,
            env=fake.env,
            cwd=fake.dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )


class Emulator:
    """The API server plus a FakeKubelet, on 127.0.0.1 in a daemon thread; see the module docstring.

    `nodes` are the cluster's nodes (default_nodes() when None). Other keyword arguments go to
    kube_api.KubeApi (history, bookmark_interval_s, watch_timeout_s, ...).
    """

    def __init__(
        self, workdir: str, *, namespace: str = "replicas", nodes: list[Node] | None = None, **api_options: Any
    ) -> None:
        self.workdir = workdir
        self.namespace = namespace
        self.nodes = nodes
        self.url = ""
        self.api = kube_api.KubeApi(**api_options)
        self.kubelet: FakeKubelet | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
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
        self.api.add_namespace(self.namespace)
        self.url = await self.api.start()
        self.kubelet = FakeKubelet(self.url, self.namespace, os.path.join(self.workdir, "pods"), self.nodes)
        self.api.log_source = self.kubelet.log_source
        self.api.exec_source = self.kubelet.exec_source
        kubelet = asyncio.get_running_loop().create_task(self.kubelet.run())
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            kubelet.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await kubelet
            await self.api.stop()

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

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call `fn` on the emulator's loop (the API's state lives there) and return its result."""

        async def call() -> T:
            return fn(*args, **kwargs)

        return self.submit(call()).result(timeout=10)

    def logged(self, method: str, *, kubelet: bool = False) -> list[tuple[str, dict[str, str]]]:
        """Requests the API received with `method`, as (path, query) pairs; the kubelet's only if asked."""
        entries = self.run(lambda: list(self.api.log))
        return [
            (e.path, e.query)
            for e in entries
            if e.method == method.upper() and (kubelet or not e.agent.startswith(KUBELET_AGENT))
        ]

    def watches(self) -> list[dict[str, str]]:
        """The queries of the watches clients other than the kubelet opened on Pods, in order."""
        return [q for path, q in self.logged("GET") if q.get("watch") in ("true", "1") and path.endswith("/pods")]

    def lists(self) -> list[dict[str, str]]:
        """The queries of the Pod lists clients other than the kubelet made, in order."""
        return [q for path, q in self.logged("GET") if q.get("watch") not in ("true", "1") and path.endswith("/pods")]

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
        return await asyncio.to_thread(self.run, self.api.get, "pods", self.namespace, name)

    async def names(self, kind: str = "pod") -> list[str]:
        """Names of the namespace's objects of `kind` (pod, service, secret)."""
        return await asyncio.to_thread(self.run, self.api.names, f"{kind}s", self.namespace)

    def wait_until(self, pred: Any, timeout: float = 10.0) -> None:
        """Poll `pred()` (bounded) until true; fail after `timeout`."""
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached")
            time.sleep(0.02)
