"""The Pod watch of the `kubernetes` backend (mixed into `kube.KubernetesBackend`).

One watch over this instance's Pods: a list, then a watch from its resourceVersion, resumed
from the last version seen whenever it ends, listed again only after a 410 Gone. Each Pod event
updates the replica it belongs to (adopting Pods this process did not launch), and an ended,
evicted or deleted Pod becomes one backend event per incarnation.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import logging
import time
from collections.abc import Callable
from typing import Any

from services.provisioner import backend, causes, kube_client, kube_objects, kube_pods, kube_status, model
from services.provisioner.kube_client import ApiError, Options, describe
from services.provisioner.kube_pods import Tracked

log = logging.getLogger(__name__)


class PodWatch:
    """The Pod watch of `kube.KubernetesBackend`, which owns the state declared here."""

    _opts: Options
    _ns: str
    _labels: dict[str, str]
    _selector: str
    _clock: Callable[[], float]
    _api: kube_client.Api
    _tracked: dict[str, Tracked]
    _logs: kube_pods.LogCopier
    _log_path: Callable[[str, model.LogKind], str] | None
    _events: asyncio.Queue[backend.BackendEvent]
    _reports: set[asyncio.Task[None]]
    # Tokens of incarnations deleted here: a replayed event of theirs must not re-adopt them.
    _deleted: collections.deque[str]

    async def _refresh(self, tracked: Tracked) -> None:
        pod = await self._api.get("pod", tracked.obj, self._ns)
        if pod is None:
            if tracked.pod is not None:  # seen before, gone now
                self._on_pod("DELETED", tracked.pod)
        elif kube_objects.token_of(pod) == tracked.token:
            self._on_pod("MODIFIED", pod)

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
