"""A replica incarnation's Pod as the kubernetes backend tracks it, and the copy of its log.

The Pod log holds setup's output, then the app's: `LogCopier` copies it into the replica's launch
log and app log (kept apart at `kube_objects.SETUP_FINISHED_LINE`, as the local backend keeps
them) for as long as the container runs. Where it got to is saved next to the logs, so a
restarted provisioner reads on from there and repeats nothing (`kube_status.LogPosition`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from services.common import waits
from services.provisioner import kube_client, kube_objects, kube_status, model
from services.provisioner.kube_client import ApiError, describe

log = logging.getLogger(__name__)

LOG_SETTLE_S = 5.0
"""How long an app's end (or a teardown) waits for the last lines of its Pod log."""
POSITION_FILE = "kube-log-position.json"


@dataclasses.dataclass
class Tracked:
    """One replica incarnation's Pod, as last seen."""

    name: str
    obj: str
    token: str
    is_spot: bool
    zone: str
    created_at: float
    port: int
    uid: str = ""
    has_setup: bool = False
    pod: dict[str, Any] | None = None
    status: kube_status.PodStatus = dataclasses.field(default_factory=kube_status.PodStatus)
    gone: bool = False
    launching: bool = False
    deleting: bool = False
    reported: bool = False
    app_state: model.AppState = model.AppState.RUNNING
    exit_code: int = 0
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    app_log: str = ""
    launch_log: str = ""
    accelerator: str = ""
    resources_path: str = ""
    splits_setup: bool = False
    log_task: asyncio.Task[None] | None = None
    service: dict[str, Any] | None = None
    worker: bool = False

    def touch(self) -> None:
        """Wake whoever waits for a change."""
        self.changed.set()
        self.changed = asyncio.Event()


class LogCopier:
    """Copies the Pod logs of one backend's replicas; see the module docstring.

    Args:
        api: the backend's API client.
        namespace: the namespace of the replicas' Pods.
        follow_logs: whether to copy at all (Options.follow_logs).
        reconnect_margin_s: how far back a read that starts again asks for (Options.log_reconnect_margin_s).
        current: the replica's tracked incarnation now (None once it is forgotten).
    """

    def __init__(
        self,
        api: kube_client.Api,
        namespace: str,
        *,
        follow_logs: bool,
        reconnect_margin_s: float,
        current: Callable[[str], Tracked | None],
    ) -> None:
        self._api = api
        self._ns = namespace
        self._follow_logs = follow_logs
        self._reconnect_margin_s = reconnect_margin_s
        self._current = current

    def follow(self, tracked: Tracked) -> None:
        """Start copying the Pod's log into the replica's logs (once per incarnation)."""
        if not self._follow_logs or not tracked.app_log or tracked.log_task is not None:
            return
        tracked.log_task = asyncio.get_running_loop().create_task(self._copy(tracked))

    async def settled(self, tracked: Tracked, timeout: float = LOG_SETTLE_S) -> None:
        """Wait (bounded) until the log copy of a finished or deleted Pod has ended."""
        task = tracked.log_task
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=timeout)

    async def _copy(self, tracked: Tracked) -> None:
        """Copy the Pod's log (setup's part to the launch log, the rest to the app log) until the
        container has ended and everything it wrote is copied, or the Pod is gone. Reads that
        end early start again from the last line's time; lines already copied are skipped."""
        position = _load_position(tracked)
        delay = 0.2
        while True:
            st = tracked.status
            if tracked.gone or self._current(tracked.name) not in (tracked, None):
                return
            if not (st.running or st.exit_code is not None):
                changed = tracked.changed
                await waits.wait_event(changed, 2.0)
                continue
            since = None
            if position.time_ns:
                since = int((time.time_ns() - position.time_ns) / 1e9 + self._reconnect_margin_s)
            position.restart()
            try:
                await self._copy_stream(tracked, position, since)
            except ApiError as exc:
                if exc.status == 404:
                    return  # the Pod is gone, and its log with it
                log.debug("log of Pod %s: %s; reading again in %.1f s", tracked.obj, describe(exc), delay)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)
                continue
            except TimeoutError:
                continue  # the stream's time was up: read on from where it was
            except OSError as exc:
                log.warning("could not write the log of replica %s: %s", tracked.name, exc)
                return
            finally:
                _save_position(tracked, position)
            if tracked.status.finished or tracked.status.deleting or tracked.deleting or tracked.gone:
                return
            # It ended while the Pod looks alive: the container just exited, or a proxy cut it.
            await asyncio.sleep(delay)
            delay = min(5.0, delay * 2)

    async def _copy_stream(self, tracked: Tracked, position: kube_status.LogPosition, since: int | None) -> None:
        with contextlib.ExitStack() as files:
            app = files.enter_context(open(tracked.app_log, "ab"))  # noqa: ASYNC230 - local file, appends
            launch = files.enter_context(open(tracked.launch_log, "ab"))  # noqa: ASYNC230
            saved = time.monotonic()
            async for line in self._api.pod_log(self._ns, tracked.obj, since_s=since):
                if time.monotonic() - saved > 1.0:  # a provisioner killed mid-stream repeats little
                    saved = time.monotonic()
                    _save_position(tracked, position)
                text = position.take(line)
                if text is None:
                    continue
                if tracked.splits_setup and not position.setup_done:
                    if text.rstrip(b"\n") == kube_objects.SETUP_FINISHED_LINE.encode():
                        position.setup_done = True
                        continue
                    launch.write(text)
                    launch.flush()
                else:
                    app.write(text)
                    app.flush()


def _position_file(tracked: Tracked) -> str:
    return os.path.join(os.path.dirname(tracked.app_log), POSITION_FILE)


def _load_position(tracked: Tracked) -> kube_status.LogPosition:
    """Where an earlier provisioner left off copying this incarnation's log, if it did."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        with open(_position_file(tracked), encoding="utf-8") as fh:
            found = kube_status.LogPosition.from_dict(json.load(fh))
        if found.token == tracked.token:
            return found
    return kube_status.LogPosition(token=tracked.token)


def _save_position(tracked: Tracked, position: kube_status.LogPosition) -> None:
    path = _position_file(tracked)
    with contextlib.suppress(OSError):
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(position.to_dict(), fh)
        os.replace(path + ".tmp", path)
