"""Launching replica Pods, the `kubernetes` backend's part (mixed into `kube.KubernetesBackend`).

A launch attempt creates the replica's Secret, Pod and Service (a create whose answer was lost
meets its own object on the retry and takes it), then follows the Pod until its container has
finished setup, saying each step in the launch log. With several resources alternatives they
are tried one Pod at a time (see kube.py's docstring); a Pod that stays unschedulable or is
refused for what it asks is `_NotPlaced`, and the next alternative is tried.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.common import waits
from services.provisioner import (
    alternatives,
    backend,
    causes,
    kube_client,
    kube_manifests,
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


class PodLaunches:
    """The launch operations of `kube.KubernetesBackend`, which owns the state declared here."""

    _opts: Options
    _cfg: kube_objects.PodConfig
    _ns: str
    _labels: dict[str, str]
    _clock: Callable[[], float]
    _api: kube_client.Api
    _tracked: dict[str, Tracked]
    _logs: kube_pods.LogCopier
    # Placement key -> when a Pod of that shape last found no capacity (any_of tries it last).
    _found_full: dict[str, float]

    if TYPE_CHECKING:

        async def delete(self, name: str, *, grace_s: float) -> None: ...

        async def _delete_objects(self, obj: str, *, grace_s: float) -> str: ...

        async def _refresh(self, tracked: Tracked) -> None: ...

        def _report(self, tracked: Tracked) -> None: ...

        def _endpoint(self, tracked: Tracked) -> str: ...

        def _describe(self, tracked: Tracked) -> backend.BackendReplica: ...

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
            return kube_manifests.placement(launch, alt, self._cfg).key
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
        pod, notes = kube_manifests.pod_manifest(
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
            zone=kube_manifests.zone_of(launch, alternative),
            created_at=created_at,
            port=kube_manifests.serving_port(launch.spec),
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
                await self._create("secret", kube_manifests.secret_manifest(launch, self._cfg, token=token), token)
            _note(request.launch_log, f"creating Pod {self._ns}/{obj} (image {image})")
            created = await self._create("pod", pod, token)
            tracked.uid = str((created.get("metadata") or {}).get("uid") or "")
            self._logs.follow(tracked)
            owner = kube_manifests.owner_reference(created)
            if launch.spec.secrets and owner:
                await self._own("secret", obj, owner, request.launch_log)
            if self._cfg.service_type and not launch.spec.worker:  # a worker serves nothing
                service = kube_manifests.service_manifest(launch, self._cfg, token=token, owner=owner)
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
            if existing is not None and kube_objects.token_of(existing) == token:
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


def _app_started(status: kube_status.PodStatus) -> bool:
    """A container that ended after setup (the setup marker exists only inside it): the exit
    is the app's when the termination message is not setup's own."""
    return status.exit_code is not None and not status.termination_message.startswith(kube_objects.SETUP_FAILED_PREFIX)


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
