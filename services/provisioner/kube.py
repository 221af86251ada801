"""The `kubernetes` backend: each replica is a Pod (plus an optional Service) in one namespace.

The official client's asyncio flavour (`kubernetes.aio`) is imported lazily, when the backend
starts, so the local backend never pays for it. Objects are built as plain dicts by
kube_manifests.py; this module sends them and follows their Pods.

One watch over the Pods carrying this instance's labels drives everything: a list, then a
watch from the list's resourceVersion, resumed from the last version it saw (an event's or a
bookmark's) whenever it ends: the server's timeout, a silent connection, an error. Only a 410
Gone (the version is too old to resume from) makes it list again. A list replays every Pod;
the state kept per replica makes that harmless (each incarnation reports one end).

API calls go through kube_client.py, which retries them, and only it, when the failure is
transient (no answer, 429, 5xx). A create whose answer was lost meets its own object on the
retry (409) and takes it. Other failures become launch or
teardown failures that say what the API server answered.

A replica's Secret and Service carry an ownerReference to its Pod, so the cluster's garbage
collector removes them with the Pod even when no provisioner is left to. The Secret is created
before the Pod (the container needs it to start) and owned once the Pod exists; one left
behind by a crash in between is removed at the next start.

Resources alternatives (`any_of`, `ordered`, a list of accelerators; see alternatives.py) are
tried one Pod at a time within one launch attempt: an alternative whose Pod stays unschedulable
for `alternative_timeout_s`, or whose Pod the API server refuses for what it asks (a quota, a
LimitRange, an invalid quantity), has its objects deleted and the next one is tried. Failures
after the Pod was scheduled (image, setup, the app) end the attempt as with one set of resources.

Restart safety: the Pods themselves are the record. Each carries the full replica name and
the incarnation token in annotations, so a restarted provisioner lists its Pods by label and
re-adopts them; Pods that ended while it was down are reported then.

Mixed into `KubernetesBackend`: launching Pods (`kube_launch.PodLaunches`) and the Pod watch
(`kube_watch.PodWatch`); this module keeps the lifecycle, teardown, reads and jobs.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from services.common import waits
from services.provisioner import (
    backend,
    kube_client,
    kube_jobs,
    kube_launch,
    kube_objects,
    kube_pods,
    kube_status,
    kube_watch,
    model,
)
from services.provisioner.kube_client import ApiError, Options, describe
from services.provisioner.kube_pods import Tracked

log = logging.getLogger(__name__)


class _DeleteFailed(Exception):
    """Deleting a replica's objects failed; the message says which and why."""


class KubernetesBackend(kube_launch.PodLaunches, kube_watch.PodWatch, backend.Backend):
    """Replicas as Pods; see the module docstring."""

    name = "kubernetes"

    def __init__(
        self,
        options: Options,
        *,
        clock: Callable[[], float] = time.time,
        log_path: Callable[[str, model.LogKind], str] | None = None,
    ) -> None:
        """Args:
        options: the backend's settings.
        clock: wall-clock time for events.
        log_path: where replica `name`'s log of a kind lives; Pod logs of adopted replicas
            are copied there (launched ones use the paths of their CreateRequest).
        """
        self._opts = options
        self._log_path = log_path
        self._reports: set[asyncio.Task[None]] = set()
        self._cfg = options.pods
        self._ns = options.pods.namespace
        self._labels = kube_objects.selector(options.pods.instance)
        self._selector = kube_objects.selector_text(self._labels)
        self._clock = clock
        self._api = kube_client.Api(options)
        self._tracked: dict[str, Tracked] = {}
        self._logs = kube_pods.LogCopier(
            self._api,
            self._ns,
            follow_logs=options.follow_logs,
            reconnect_margin_s=options.log_reconnect_margin_s,
            current=lambda name: self._tracked.get(name),
        )
        self._events: asyncio.Queue[backend.BackendEvent] = asyncio.Queue()
        self._watcher: asyncio.Task[None] | None = None
        # Tokens of incarnations deleted here: a replayed event of theirs must not re-adopt them.
        self._deleted: collections.deque[str] = collections.deque(maxlen=10_000)
        # Placement key -> when a Pod of that shape last found no capacity (any_of tries it last).
        self._found_full: dict[str, float] = {}
        self._jobs = kube_jobs.KubeJobs(
            lambda pod, command: self._api.exec(self._ns, pod, command),
            worker_alive=self._worker_alive,
            clock=clock,
        )

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, list this instance's Pods and adopt them, remove Secrets and Services whose
        Pod is gone, then start the watch."""
        try:
            await self._api.open()
        except ApiError as exc:
            raise RuntimeError(f"kubernetes backend: {exc.message}") from None
        try:
            if self._opts.create_namespace:
                await self._api.ensure_namespace(self._ns)
            items, version = await self._api.list("pod", self._ns, self._selector)
        except ApiError as exc:
            raise RuntimeError(
                f"kubernetes backend: cannot list Pods in namespace {self._ns}: {describe(exc)}"
            ) from None
        self._apply_list(items)
        log.info("kubernetes backend: namespace %s, %d replica Pods found", self._ns, len(self._tracked))
        if self._opts.endpoint in ("node_port", "load_balancer"):
            await self._find_services()
        await self._remove_orphans({str((p.get("metadata") or {}).get("name", "")) for p in items})
        self._watcher = asyncio.get_running_loop().create_task(self._watch(version))

    async def _find_services(self) -> None:
        """Give adopted replicas their Services (their endpoints come from them)."""
        try:
            items, _ = await self._api.list("service", self._ns, self._selector)
        except ApiError as exc:
            log.warning("could not list Services; endpoints wait for them: %s", describe(exc))
            return
        by_name = {str((s.get("metadata") or {}).get("name", "")): s for s in items}
        for tracked in self._tracked.values():
            found = by_name.get(tracked.obj)
            if found is not None and kube_objects.token_of(found) == tracked.token:
                tracked.service = found

    async def _remove_orphans(self, pods: set[str]) -> None:
        """Delete our Secrets and Services whose Pod does not exist: a crash between creating a
        Secret and its Pod leaves one that no ownerReference covers. Best effort."""
        for kind in ("secret", "service"):
            try:
                items, _ = await self._api.list(kind, self._ns, self._selector)
            except ApiError as exc:
                log.warning("could not look for %ss left without a Pod: %s", kind, describe(exc))
                continue
            for item in items:
                meta = item.get("metadata") or {}
                name = str(meta.get("name", ""))
                if name in pods or not kube_objects.matches(item, self._labels):
                    continue
                try:
                    await self._api.delete(kind, name, self._ns, uid=str(meta.get("uid", "")))
                    log.info("deleted %s %s/%s: its Pod is gone", kind, self._ns, name)
                except ApiError as exc:
                    log.warning("could not delete %s %s/%s left without a Pod: %s", kind, self._ns, name, describe(exc))

    async def close(self) -> None:
        """Stop watching; the Pods keep running and are re-adopted on the next start()."""
        tasks = [t for t in (self._watcher, *(x.log_task for x in self._tracked.values())) if t is not None]
        tasks += list(self._reports)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._jobs.close()
        await self._api.close()

    # ---- backend interface -----------------------------------------------------------------

    async def delete(self, name: str, *, grace_s: float) -> None:
        """Delete the Pod with `grace_s` as its grace period (and its Service and Secret), then
        wait until the Pod is gone. Objects of that name that are not this instance's are left
        alone. A Pod that is still terminating after the grace period plus `delete_timeout_s`
        fails the attempt (TeardownError): it is reported, not forgotten.
        """
        tracked = self._tracked.get(name)
        obj = tracked.obj if tracked else kube_objects.object_name(name)
        if tracked is not None:
            tracked.deleting = True
        try:
            uid = await self._delete_objects(obj, grace_s=grace_s)
        except _DeleteFailed as exc:
            raise backend.TeardownError(str(exc)) from None
        deadline = time.monotonic() + grace_s + self._opts.delete_timeout_s
        while uid:
            try:
                pod = await self._api.get("pod", obj, self._ns)
            except ApiError as exc:
                raise backend.TeardownError(f"could not read Pod {self._ns}/{obj}: {describe(exc)}") from None
            if pod is None or (pod.get("metadata") or {}).get("uid") != uid:
                break
            if time.monotonic() >= deadline:
                meta = pod.get("metadata") or {}
                finalizers = ", ".join(meta.get("finalizers") or []) or "none"
                raise backend.TeardownError(
                    f"Pod {self._ns}/{obj} is stuck terminating (deletion requested at "
                    f"{meta.get('deletionTimestamp') or '?'}, finalizers: {finalizers}, "
                    f"node: {(pod.get('spec') or {}).get('nodeName') or 'none'})"
                )
            if tracked is not None:
                await waits.wait_event(tracked.changed, 0.5)
            else:
                await asyncio.sleep(0.5)
        if tracked is not None:
            # The container is dead: what it wrote last is on its way to the app log.
            await self._logs.settled(tracked)
            if tracked.log_task is not None:
                tracked.log_task.cancel()
            self._deleted.append(tracked.token)
            if self._tracked.get(name) is tracked:
                del self._tracked[name]
            self._jobs.forget_worker(name)

    async def _delete_objects(self, obj: str, *, grace_s: float) -> str:
        """Delete our Pod, Service and Secret named `obj`; returns the deleted Pod's uid ("" if none).

        Raises:
            _DeleteFailed: an API call failed (the message says which and why).
        """
        uid = await self._delete_ours("pod", obj, grace_s=grace_s)
        for kind in ("service", "secret"):
            await self._delete_ours(kind, obj)
        return uid

    async def _delete_ours(self, kind: str, name: str, *, grace_s: float | None = None) -> str:
        """Delete one object if it is this instance's; returns its uid ("" when there was none)."""
        what = f"{kind.capitalize() if kind == 'pod' else kind} {self._ns}/{name}"
        try:
            existing = await self._api.get(kind, name, self._ns)
            if existing is None:
                return ""
            if not kube_objects.matches(existing, self._labels):
                log.warning("not deleting %s: it is not this provisioner's", what)
                return ""
            uid = str((existing.get("metadata") or {}).get("uid") or "")
            return uid if await self._api.delete(kind, name, self._ns, grace_s=grace_s, uid=uid) else ""
        except ApiError as exc:
            raise _DeleteFailed(f"could not delete {what}: {describe(exc)}") from None

    def get(self, name: str) -> backend.BackendReplica | None:
        """The replica `name`, if one of this instance's Pods runs it."""
        tracked = self._tracked.get(name)
        return self._describe(tracked) if tracked else None

    def list(self) -> builtins.list[backend.BackendReplica]:
        """Every replica with a Pod of this instance, by name."""
        return [self._describe(self._tracked[n]) for n in sorted(self._tracked)]

    async def watch(self) -> AsyncIterator[backend.BackendEvent]:
        """App exits, evictions and deletions by others, as the Pod watch sees them."""
        while True:
            yield await self._events.get()

    async def preempt(self, name: str) -> None:
        """Delete the replica's Pod at once (grace 0), as a node loss or spot reclaim would."""
        tracked = self._tracked.get(name)
        if tracked is None:
            return
        tracked.reported = True  # the caller reports PREEMPTED itself
        tracked.app_state = model.AppState.PREEMPTED
        try:
            await self._api.delete("pod", tracked.obj, self._ns, grace_s=0, uid=tracked.uid)
        except ApiError as exc:
            log.warning("could not delete Pod %s to preempt it: %s", tracked.obj, describe(exc))

    def report_api_errors(self, hook: Callable[[int], None]) -> None:
        """Call `hook(status)` for each failed try of an API call (0: no answer)."""
        self._api.on_error = hook

    # ---- jobs on pool workers (kube_jobs.py) -------------------------------------------------

    async def run_job(self, start: backend.JobStart) -> backend.BackendJob:
        """Exec the job into its worker's Pod (or attach to it there); see kube_jobs.py."""
        tracked = self._tracked.get(start.job.replica)
        if tracked is None or tracked.token != start.worker_token or not self._worker_alive(tracked.name):
            raise backend.JobStartError(f"worker {start.job.replica} is not running")
        return await self._jobs.run(start, tracked.obj)

    async def cancel_job(self, token: str, *, grace_s: float) -> None:
        """SIGTERM the job's processes in its Pod, SIGKILL after `grace_s`; see kube_jobs.py."""
        await self._jobs.cancel(token, grace_s=grace_s)

    def get_job(self, token: str) -> backend.BackendJob | None:
        """Job `token`, if this backend ran it since it started."""
        return self._jobs.get(token)

    async def watch_jobs(self) -> AsyncIterator[backend.JobEnded]:
        """Job ends, as their exec sessions report them (or their Pods' ends imply)."""
        async for ended in self._jobs.ended():
            yield ended

    def _worker_alive(self, name: str) -> bool:
        tracked = self._tracked.get(name)
        if tracked is None or tracked.gone or tracked.reported:
            return False
        st = tracked.status
        return st.running and not st.deleting and not st.disruption

    # ---- helpers ---------------------------------------------------------------------------

    def _endpoint(self, tracked: Tracked) -> str:
        if tracked.worker:
            return ""  # a pool worker serves nothing
        port = tracked.port
        if self._opts.endpoint == "service":
            host = f"{tracked.obj}.{self._ns}.svc.{self._opts.cluster_domain}"
            return kube_status.endpoint(host, port)
        if self._opts.endpoint in ("node_port", "load_balancer"):
            node_host = self._opts.node_address or tracked.status.host_ip
            return kube_status.service_endpoint(tracked.service, port, mode=self._opts.endpoint, node_host=node_host)
        if self._opts.port_annotation and tracked.pod is not None:
            annotations = (tracked.pod.get("metadata") or {}).get("annotations") or {}
            with contextlib.suppress(KeyError, ValueError):
                port = int(annotations[self._opts.port_annotation])
        return kube_status.endpoint(tracked.status.pod_ip, port) if tracked.status.pod_ip else ""

    def _describe(self, tracked: Tracked) -> backend.BackendReplica:
        return backend.BackendReplica(
            name=tracked.name,
            token=tracked.token,
            endpoint=self._endpoint(tracked),
            zone=tracked.zone,
            price_per_hour=0.0,
            is_spot=tracked.is_spot,
            app_state=tracked.app_state,
            exit_code=tracked.exit_code,
            start_time=tracked.created_at,
            accelerator=tracked.accelerator,
            resources_path=tracked.resources_path,
        )
