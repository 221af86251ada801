"""The `kubernetes` backend: each replica is a Pod (plus an optional Service) in one namespace.

The official client's asyncio flavour (`kubernetes.aio`) is imported lazily, when the backend
starts, so the local backend never pays for it. Objects are built as plain dicts by
kube_objects.py; this module sends them and follows their Pods.

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
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from services.common import waits
from services.provisioner import (
    alternatives,
    backend,
    causes,
    kube_client,
    kube_jobs,
    kube_objects,
    kube_pods,
    kube_status,
    model,
)
from services.provisioner.kube_client import ApiError, Options, describe
from services.provisioner.kube_pods import Tracked

log = logging.getLogger(__name__)


class _NotPlaced(backend.LaunchError):
    """An alternative's Pod could not be placed: it stayed unschedulable, or the API server
    refused it for what it asks. Another alternative may do.

    Attributes:
        summary: what happened, after the alternative's name in the launch log.
    """

    def __init__(self, message: str, *, summary: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.summary = summary


class _DeleteFailed(Exception):
    """Deleting a replica's objects failed; the message says which and why."""


class KubernetesBackend(backend.Backend):
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
            if found is not None and _token(found) == tracked.token:
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

    async def create(self, request: backend.CreateRequest) -> backend.BackendReplica:
        """Create the replica's objects and wait until its container has finished setup; with
        several resources alternatives, try them in turn (see the module docstring)."""
        launch = request.launch
        listed = alternatives.of_spec(launch.spec)
        if len(listed) == 1:
            try:
                return await self._create_on(request, listed[0], schedule_timeout_s=self._opts.schedule_timeout_s)
            except kube_objects.ManifestError as exc:
                raise backend.LaunchError(
                    str(exc), cause=causes.kubernetes(causes.Kube.UNRUNNABLE_SPEC), permanent=True
                ) from None
        keys = [self._placement_key(launch, alt) for alt in listed]
        now = time.monotonic()
        for key, seen in builtins.list(self._found_full.items()):
            if now - seen > self._opts.alternative_retry_s:
                del self._found_full[key]
        full = {i for i, key in enumerate(keys) if key and key in self._found_full}
        tries = alternatives.order(launch.spec, full)
        timeout = min(self._opts.alternative_timeout_s, self._opts.schedule_timeout_s)
        failures: builtins.list[alternatives.Failure] = []
        for n, i in enumerate(tries):
            alt = listed[i]
            own_zone = alt.resources.get("zone", "")
            if launch.zone and own_zone and own_zone != launch.zone:
                message = f"asks for zone {own_zone}, but this launch is placed in zone {launch.zone}"
                _note(request.launch_log, f"skipping {alt.label}: {message}")
                failures.append(alternatives.Failure(alt, message, causes.INFRASTRUCTURE))
                continue
            later = " (it found no capacity recently, so it comes last)" if i in full else ""
            _note(request.launch_log, f"trying {alt.label}, {n + 1} of {len(tries)}{later}")
            try:
                created = await self._create_on(request, alt, schedule_timeout_s=timeout)
            except kube_objects.ManifestError as exc:
                cause = causes.kubernetes(causes.Kube.UNRUNNABLE_SPEC)
                failures.append(alternatives.Failure(alt, str(exc), cause, permanent=True))
                _note(request.launch_log, f"{alt.label} cannot run as a Pod: {exc}")
                continue
            except _NotPlaced as exc:
                failures.append(
                    alternatives.Failure(alt, exc.message, exc.cause, exc.permanent, exc.capacity_unavailable)
                )
                if exc.capacity_unavailable and keys[i]:
                    self._found_full[keys[i]] = time.monotonic()
                following = f"trying {listed[tries[n + 1]].label}" if n + 1 < len(tries) else "no alternative left"
                _note(request.launch_log, f"{alt.label} {exc.summary.rstrip('.')}; {following}")
                try:
                    await self.delete(launch.name, grace_s=0)
                except backend.TeardownError as err:
                    message = f"the Pod of {alt.label} could not be removed: {err}"
                    raise backend.LaunchError(message, cause=causes.kubernetes(causes.Kube.API_ERROR)) from None
                continue
            self._found_full.pop(keys[i], None)
            _note(request.launch_log, f"running on {alt.label}")
            return created
        raise alternatives.combined(failures)

    def _placement_key(self, launch: model.LaunchRequest, alt: alternatives.Alternative) -> str:
        """What the scheduler sees of one alternative ("" when it cannot be a Pod)."""
        try:
            return kube_objects.placement(launch, alt, self._cfg).key
        except kube_objects.ManifestError:
            return ""

    async def _create_on(
        self, request: backend.CreateRequest, alternative: alternatives.Alternative, *, schedule_timeout_s: float
    ) -> backend.BackendReplica:
        """One Pod of the launch, on one resources alternative.

        Raises:
            _NotPlaced: the Pod was unschedulable for `schedule_timeout_s` or refused for what it asks.
            kube_objects.ManifestError: the alternative cannot be expressed as a Pod.
            backend.LaunchError: any other failure.
        """
        launch = request.launch
        token = uuid.uuid4().hex
        created_at = self._clock()
        pod, notes = kube_objects.pod_manifest(
            launch, self._cfg, token=token, created_at=created_at, alternative=alternative
        )
        if launch.name in self._tracked:
            try:
                await self.delete(launch.name, grace_s=0)  # leftovers of an earlier attempt
            except backend.TeardownError as exc:
                message = f"the earlier attempt's objects could not be removed: {exc}"
                raise backend.LaunchError(message, cause=causes.kubernetes(causes.Kube.API_ERROR)) from None
        obj = pod["metadata"]["name"]
        tracked = Tracked(
            name=launch.name,
            obj=obj,
            token=token,
            is_spot=launch.use_spot,
            zone=kube_objects.zone_of(launch, alternative),
            created_at=created_at,
            port=kube_objects.serving_port(launch.spec),
            has_setup=bool(launch.spec.setup.strip()),
            launching=True,
            app_log=request.app_log,
            launch_log=request.launch_log,
            accelerator=alternative.accelerator,
            resources_path=alternative.path,
            splits_setup=bool(launch.spec.setup.strip()),
            worker=launch.spec.worker,
        )
        self._tracked[launch.name] = tracked
        for note in notes:
            _note(request.launch_log, note)
        image = pod["spec"]["containers"][0]["image"]
        try:
            if launch.spec.secrets:
                await self._create("secret", kube_objects.secret_manifest(launch, self._cfg, token=token), token)
            _note(request.launch_log, f"creating Pod {self._ns}/{obj} (image {image})")
            created = await self._create("pod", pod, token)
            tracked.uid = str((created.get("metadata") or {}).get("uid") or "")
            self._logs.follow(tracked)
            owner = kube_objects.owner_reference(created)
            if launch.spec.secrets and owner:
                await self._own("secret", obj, owner, request.launch_log)
            if self._cfg.service_type and not launch.spec.worker:  # a worker serves nothing
                service = kube_objects.service_manifest(launch, self._cfg, token=token, owner=owner)
                tracked.service = await self._create("service", service, token)
            result = await self._await_start(tracked, request.launch_log, image, schedule_timeout_s)
        except asyncio.CancelledError:
            tracked.deleting = True
            with contextlib.suppress(Exception):
                await self._delete_objects(obj, grace_s=0)
            raise
        finally:
            tracked.launching = False
        self._report(tracked)  # an app that exited before we looked
        return result

    async def _create(self, kind: str, body: dict[str, Any], token: str) -> dict[str, Any]:
        """Create one object of this launch attempt and return it as stored.

        A 409 is looked at: our own object (this token: a retried create whose first answer was
        lost) is taken; a Secret or Service of ours from an earlier incarnation is replaced; a
        Pod of ours or anything not ours is a conflict.
        """
        name = body["metadata"]["name"]
        try:
            return await self._api.create(kind, body)
        except ApiError as exc:
            if exc.status != 409:
                raise _launch_error(kind, name, self._ns, exc) from None
            conflict = exc
        try:
            existing = await self._api.get(kind, name, self._ns)
            if existing is not None and _token(existing) == token:
                return existing
            if existing is None or (kind != "pod" and kube_objects.matches(existing, self._labels)):
                if existing is not None:
                    uid = str(existing["metadata"].get("uid", ""))
                    await self._api.delete(kind, name, self._ns, uid=uid)
                    log.info("replaced %s %s/%s left by an earlier launch", kind, self._ns, name)
                return await self._api.create(kind, body)
        except ApiError as exc:
            raise _launch_error(kind, name, self._ns, exc) from None
        if kube_objects.matches(existing, self._labels):
            note = "an earlier Pod of this replica is still there, terminating?"
        else:
            note = "the object of that name is not this provisioner's"
        raise backend.LaunchError(
            f"could not create {kind} {self._ns}/{name}: {describe(conflict)} ({note})",
            cause=causes.kubernetes(causes.Kube.API_ERROR, status=conflict.status, message=conflict.message),
        )

    async def _own(self, kind: str, name: str, owner: dict[str, str], launch_log: str) -> None:
        """Make the Pod own an object created before it (best effort: teardown deletes it anyway)."""
        try:
            await self._api.patch(kind, name, self._ns, {"metadata": {"ownerReferences": [owner]}})
        except ApiError as exc:
            log.warning("could not make Pod %s own %s %s/%s: %s", owner["name"], kind, self._ns, name, describe(exc))
            _note(launch_log, f"{kind} {name} is not owned by its Pod ({describe(exc)}); teardown deletes it")

    async def _await_start(
        self, tracked: Tracked, launch_log: str, image: str, schedule_timeout_s: float
    ) -> backend.BackendReplica:
        start = time.monotonic()
        said: set[str] = set()

        def say(key: str, text: str) -> None:
            if key not in said:
                said.add(key)
                _note(launch_log, text)

        while True:
            st = tracked.status
            waited = time.monotonic() - start
            if tracked.gone or st.deleting:
                raise backend.LaunchError(
                    f"Pod {tracked.obj} was deleted during the launch", cause=causes.kubernetes(causes.Kube.DELETED)
                )
            if st.finished:
                await self._logs.settled(tracked)
                if st.disruption:
                    raise backend.LaunchError(
                        f"Pod {tracked.obj} was {st.disruption} during the launch",
                        cause=causes.kubernetes(causes.Kube.DISRUPTED),
                    )
                if tracked.has_setup and not st.started and not _app_started(st):
                    message = st.termination_message.splitlines()[0] if st.termination_message else ""
                    if not message.startswith(kube_objects.SETUP_FAILED_PREFIX):
                        message = f"the container exited with code {st.exit_code} before setup finished"
                    raise backend.LaunchError(message, cause=causes.kubernetes(causes.Kube.SETUP_EXITED))
                return self._describe(tracked)
            if st.running and st.started:
                say("running", f"app started in Pod {tracked.obj} on node {st.node or '?'}")
                if self._opts.endpoint == "load_balancer" and not tracked.worker:
                    await self._await_load_balancer(tracked, say)
                return self._describe(tracked)
            if st.running:
                say("setup", "container running; waiting for setup to finish")
            if st.waiting_reason in kube_objects.IMAGE_PULL_ERRORS:
                cause = causes.kubernetes(causes.Kube.IMAGE_PULL, message=st.waiting_message)
                raise backend.LaunchError(
                    f"image {image} could not be pulled ({st.waiting_reason}): {st.waiting_message}".rstrip(": "),
                    cause=cause,
                    permanent=st.waiting_reason == "InvalidImageName" and cause == model.FailureCause.USER,
                )
            if st.waiting_reason in kube_objects.CONTAINER_ERRORS:
                raise backend.LaunchError(
                    f"{st.waiting_reason}: {st.waiting_message}".rstrip(": "),
                    cause=causes.kubernetes(causes.Kube.CONTAINER_ERROR),
                )
            if st.unschedulable:
                say("unschedulable", f"Pod cannot be scheduled yet: {st.unschedulable}")
                if waited > schedule_timeout_s:
                    within = f"could not be scheduled within {schedule_timeout_s:g} s: {st.unschedulable}"
                    raise _NotPlaced(
                        f"Pod {within}",
                        summary=within,
                        cause=causes.kubernetes(causes.Kube.UNSCHEDULABLE),
                        capacity_unavailable=True,
                    )
            elif st.node:
                say("scheduled", f"Pod scheduled to node {st.node}")
            if not st.running and waited > self._opts.start_timeout_s:
                reason = st.waiting_reason or st.phase or "no status"
                raise backend.LaunchError(
                    f"Pod did not start within {self._opts.start_timeout_s:g} s ({reason})",
                    cause=causes.kubernetes(causes.Kube.START_TIMEOUT),
                )
            changed = tracked.changed
            # Look again at the latest when the schedule timeout ends (nothing may change then).
            pause = 2.0
            if st.unschedulable:
                pause = min(pause, max(0.05, schedule_timeout_s - waited + 0.01))
            if not await waits.wait_event(changed, pause):
                try:
                    await self._refresh(tracked)  # the watch may be reconnecting: look directly
                except ApiError as exc:
                    if exc.status not in (401, 403):
                        log.debug("could not read Pod %s: %s", tracked.obj, describe(exc))
                    else:
                        raise backend.LaunchError(
                            f"could not read Pod {self._ns}/{tracked.obj}: {describe(exc)}",
                            cause=causes.kubernetes(causes.Kube.API_ERROR, status=exc.status, message=exc.message),
                        ) from None

    async def _await_load_balancer(self, tracked: Tracked, say: Callable[[str, str], None]) -> None:
        """Wait until the cloud gave the replica's LoadBalancer Service an address.

        Raises:
            backend.LaunchError: none within `load_balancer_timeout_s`.
        """
        deadline = time.monotonic() + self._opts.load_balancer_timeout_s
        while not self._endpoint(tracked):
            if time.monotonic() > deadline:
                raise backend.LaunchError(
                    f"Service {self._ns}/{tracked.obj} got no load-balancer address within "
                    f"{self._opts.load_balancer_timeout_s:g} s",
                    cause=causes.kubernetes(causes.Kube.START_TIMEOUT),
                )
            say("load-balancer", f"waiting for the load-balancer address of Service {tracked.obj}")
            await asyncio.sleep(0.2 if time.monotonic() + 5 > deadline else 1.0)
            try:
                tracked.service = await self._api.get("service", tracked.obj, self._ns)
            except ApiError as exc:
                log.debug("could not read Service %s: %s", tracked.obj, describe(exc))

    async def _refresh(self, tracked: Tracked) -> None:
        pod = await self._api.get("pod", tracked.obj, self._ns)
        if pod is None:
            if tracked.pod is not None:  # seen before, gone now
                self._on_pod("DELETED", tracked.pod)
        elif _token(pod) == tracked.token:
            self._on_pod("MODIFIED", pod)

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

    # ---- the watch -------------------------------------------------------------------------

    async def _watch(self, version: str) -> None:
        """Watch from `version` forever: resume after every end, relist only when it expired."""
        delay = 0.0
        while True:
            opened, seen = time.monotonic(), False
            try:
                if not version:
                    items, version = await self._api.list("pod", self._ns, self._selector, retry=False)
                    self._apply_list(items)
                async for kind, obj in self._api.watch_pods(self._ns, self._selector, version):
                    seen, delay = True, 0.0
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                    if kind != "BOOKMARK":
                        self._on_pod(kind, obj)
                if not seen and time.monotonic() - opened < 1.0:
                    # A server (or proxy) that ends watches at once must not make this a busy loop.
                    delay = min(5.0, max(0.2, delay * 2))
                    await asyncio.sleep(delay)
            except kube_client.Gone:
                log.info("pod watch: resourceVersion %s is too old (410); listing again", version)
                version = ""
            except TimeoutError:
                log.info("pod watch silent for %.0f s; reopening it from version %s", self._opts.watch_idle_s, version)
            except ApiError as exc:
                if not exc.counted:  # a list's failures were counted by _call
                    self._api.on_error(exc.status)
                delay = min(5.0, max(0.2, delay * 2))
                log.warning("pod watch failed: %s; retrying in %.1f s", describe(exc), delay)
                await asyncio.sleep(delay)
            except Exception:  # a bug must not end the only watch: log it, start over from a list
                delay = min(5.0, max(0.2, delay * 2))
                log.exception("pod watch broke unexpectedly; listing again in %.1f s", delay)
                version = ""
                await asyncio.sleep(delay)

    def _apply_list(self, items: builtins.list[dict[str, Any]]) -> None:
        listed = set()
        for pod in items:
            name = self._on_pod("ADDED", pod)
            if name:
                listed.add(name)
        for name, tracked in builtins.list(self._tracked.items()):
            # A Pod we saw before and the list no longer has was deleted while the watch was down.
            if name not in listed and tracked.pod is not None and not tracked.gone:
                self._on_pod("DELETED", tracked.pod)

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> str:
        """Apply one Pod event; returns the replica name it belongs to ("" for a foreign Pod)."""
        if not kube_objects.matches(pod, self._labels):
            return ""
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        name = annotations.get(kube_objects.ANNOTATION_REPLICA, "")
        token = annotations.get(kube_objects.ANNOTATION_TOKEN, "")
        if not name or not token or token in self._deleted:
            return ""
        tracked = self._tracked.get(name)
        if tracked is None:
            if kind == "DELETED":
                return ""
            tracked = self._adopt(name, token, pod)
        elif tracked.token != token:
            return ""  # an older incarnation's Pod (its last events)
        tracked.pod = pod
        tracked.uid = str((pod.get("metadata") or {}).get("uid") or tracked.uid)
        tracked.status = kube_status.read_status(pod)
        if kind == "DELETED":
            tracked.gone = True
        tracked.touch()
        self._report(tracked)
        return name

    def _adopt(self, name: str, token: str, pod: dict[str, Any]) -> Tracked:
        meta = pod.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        container: dict[str, Any] = next(iter((pod.get("spec") or {}).get("containers") or []), {})
        port = next(
            (p.get("containerPort") for p in container.get("ports") or [] if p.get("name") == "serve"),
            kube_objects.DEFAULT_PORT,
        )
        try:
            created = float(annotations.get(kube_objects.ANNOTATION_CREATED, "0"))
        except ValueError:
            created = 0.0
        tracked = Tracked(
            name=name,
            obj=str(meta.get("name", "")),
            token=token,
            is_spot=(meta.get("labels") or {}).get(kube_objects.LABEL_SPOT) == "true",
            zone=annotations.get(kube_objects.ANNOTATION_ZONE, ""),
            created_at=created,
            port=int(port),
            has_setup="startupProbe" in container,
            # Pods made before setup's end was marked in the log have it all as the app's.
            splits_setup="startupProbe" in container
            and any(kube_objects.SETUP_FINISHED_LINE in str(arg) for arg in container.get("command") or []),
            accelerator=annotations.get(kube_objects.ANNOTATION_ACCELERATOR, ""),
            resources_path=annotations.get(kube_objects.ANNOTATION_RESOURCES, ""),
            worker=annotations.get(kube_objects.ANNOTATION_WORKER) == "true",
        )
        if self._log_path is not None:
            tracked.app_log = self._log_path(name, model.LogKind.APP)
            tracked.launch_log = self._log_path(name, model.LogKind.LAUNCH)
        self._tracked[name] = tracked
        self._logs.follow(tracked)
        return tracked

    def _report(self, tracked: Tracked) -> None:
        """Turn a finished, evicted or deleted Pod into one backend event per incarnation."""
        if tracked.launching or tracked.deleting or tracked.reported:
            return
        st = tracked.status
        outside = tracked.gone or st.deleting or bool(st.disruption)
        if outside:
            state = model.AppState.PREEMPTED if tracked.is_spot else model.AppState.VANISHED
            how = st.disruption or "deleted by someone else"
            message = f"Pod {tracked.obj} was {how}"
            code = 0
            cause = causes.kubernetes(causes.Kube.DISRUPTED if st.disruption else causes.Kube.DELETED)
        elif st.finished and tracked.worker:
            state, code = model.AppState.EXITED, st.exit_code or 0
            message = f"the worker's container exited with code {code}"
            cause = causes.kubernetes(causes.Kube.WORKER_EXITED)
        elif st.finished:
            state, code, message = model.AppState.EXITED, st.exit_code or 0, kube_status.exit_message(st)
            cause = causes.kubernetes(causes.Kube.APP_EXITED)
        else:
            return
        tracked.reported = True
        tracked.app_state = state
        tracked.exit_code = code
        event = backend.BackendEvent(
            name=tracked.name,
            token=tracked.token,
            app_state=state,
            exit_code=code,
            time=self._clock(),
            message=message,
            cause=cause,
        )
        if tracked.log_task is None or tracked.log_task.done():
            self._events.put_nowait(event)
            return

        async def after_logs() -> None:
            # Reported once the app's last lines are in its log, so a follower sees them all.
            await self._logs.settled(tracked)
            self._events.put_nowait(event)

        task = asyncio.get_running_loop().create_task(after_logs())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

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


def _app_started(status: kube_status.PodStatus) -> bool:
    """A container that ended after setup (the setup marker exists only inside it): the exit
    is the app's when the termination message is not setup's own."""
    return status.exit_code is not None and not status.termination_message.startswith(kube_objects.SETUP_FAILED_PREFIX)


def _token(pod: dict[str, Any]) -> str:
    return str(((pod.get("metadata") or {}).get("annotations") or {}).get(kube_objects.ANNOTATION_TOKEN, ""))


def _launch_error(kind: str, name: str, namespace: str, exc: ApiError) -> backend.LaunchError:
    """A create failure as a launch error, with whose fault it was: permanent when the API server
    refused what the spec asks for, retried when the cluster (or its operator) may fix it.

    A Pod refused for what it asks (a quota, a LimitRange, an invalid object) is _NotPlaced:
    another resources alternative may be accepted.
    """
    what = f"could not create {kind} {namespace}/{name}"
    cause = causes.kubernetes(causes.Kube.API_ERROR, status=exc.status, message=exc.message)
    quota = exc.status == 403 and "quota" in exc.message.lower()
    code = f"{exc.status} {exc.reason}".strip()
    if quota:
        text = f"{what}: quota exceeded ({code}): {exc.message}"
    elif exc.status == 403 and cause == model.FailureCause.USER:
        text = f"{what}: over the namespace's LimitRange ({code}): {exc.message}"
    elif exc.status == 404:
        return backend.LaunchError(f"{what}: namespace {namespace} not found: {describe(exc)}", cause=cause)
    else:
        text = f"{what}: {describe(exc)}"
    permanent = cause == model.FailureCause.USER
    if kind == "pod" and (quota or permanent):
        return _NotPlaced(
            text, summary=f"was refused: {text}", cause=cause, permanent=permanent, capacity_unavailable=quota
        )
    return backend.LaunchError(text, cause=cause, permanent=permanent, capacity_unavailable=quota)


def _note(path: str, text: str) -> None:
    """Append a provisioner line to a launch log."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as fh:
        fh.write(f"[{stamp}Z provisioner] {text}\n")
