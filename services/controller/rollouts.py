"""One service's canary rollout: its persisted state, the analysis series fed by load reports, and
each decision of the state machine (domain/rollout.py) turned into what the core needs: the
canary's replica count, the traffic weights, events, and the rollback or completion to apply.

The core asks `decide()` on each pass of a service while a rollout is known; the driver decides
nothing else and performs nothing itself: a rollback (an update to the stable spec) and the
completion are the caller's, through the callbacks it passes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import pbtime
from services.controller import event_log, store
from services.controller.domain import analysis, scaling
from services.controller.domain import rollout as ro
from services.controller.domain import status as st

log = logging.getLogger(__name__)


def config_of(spec: spec_pb2.ServiceSpec) -> ro.Config:
    """The spec's `service.rollout` section as the state machine's config (defaults when absent)."""
    if not spec.service.HasField("rollout"):
        return ro.Config()
    r = spec.service.rollout
    steps = tuple(ro.Step(s.weight, pbtime.seconds(s.pause) if s.HasField("pause") else 60.0) for s in r.steps)
    a = r.analysis
    thresholds = analysis.Thresholds(
        max_error_rate_increase_pct=a.max_error_rate_increase_pct if a.max_error_rate_increase_pct else 5.0,
        window_s=pbtime.seconds(a.window) if a.HasField("window") else 30.0,
        min_requests=a.min_requests if a.min_requests else 20,
        max_latency_p99_ratio=a.max_latency_p99_ratio if a.HasField("max_latency_p99_ratio") else None,
    )
    return ro.Config(
        steps=steps or ro.Config().steps,
        progress_deadline_s=pbtime.seconds(r.progress_deadline) if r.HasField("progress_deadline") else 600.0,
        auto_rollback=r.auto_rollback,
        thresholds=thresholds,
    )


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A decision as the core applies it."""

    decision: ro.Decision
    plan: scaling.ScalePlan


class Rollout:
    """The canary rollout of one service (none, in progress, or the last one).

    The core calls `scale()` on each pass (its answer replaces the rolling plan while a rollout is
    active), `weights()` when it publishes endpoints and `decorate()` on the service it shows.
    """

    def __init__(
        self,
        name: str,
        *,
        db: store.Store,
        log_: event_log.Events,
        kick: Callable[[], None] = lambda: None,
        on_action: Callable[[ro.Action, ro.State], None] = lambda action, state: None,
        save: Callable[[bytes | None], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.name = name
        self._db = db
        self._events = log_
        self.kick = kick
        """Asks the core for a pass (a pause or deadline ended, a load report arrived)."""
        self.on_action = on_action
        """Performs a rollback or notes a completion; called outside the pass, soon after it."""
        self._clock = clock
        # How the state is kept: through the core's writer; by default straight into the store.
        self._write = save or (lambda data: db.put_rollout_state(name, data))
        self._timer: asyncio.TimerHandle | None = None
        self._weights: dict[int, int] = {}
        self.latest_version = 0
        self.state: ro.State | None = None
        self.config = ro.Config()
        self._series: dict[int, analysis.Series] = {}
        data = db.get_rollout_state(name)
        if data is not None:
            try:
                self.state = ro.State.load(data)
            except (ValueError, TypeError, KeyError):
                log.warning("%s: the stored rollout state could not be read; no rollout resumed", name)

    @property
    def active(self) -> bool:
        """A rollout is progressing or held after a failure (it shapes traffic and scaling)."""
        return self.state is not None and self.state.phase in (ro.Phase.PROGRESSING, ro.Phase.FAILED)

    def set_spec(self, spec: spec_pb2.ServiceSpec) -> None:
        """The canary version's spec (its `service.rollout` section drives the rollout)."""
        self.config = config_of(spec)

    def begin(self, stable_version: int, canary_version: int, now: float) -> None:
        """Start a rollout (a canary update). Persisted with the caller's transaction, if any."""
        self.state = ro.start(stable_version, canary_version, now)
        self._series.clear()
        self._save()
        self._events.record(
            self.name,
            event_log.Draft(
                event_log.NORMAL,
                "RolloutStarted",
                f"canary rollout of version {canary_version} from version {stable_version}: "
                + ", ".join(f"{s.weight} % for {s.pause_s:g} s" for s in self.config.steps),
                f"version/{canary_version}",
            ),
        )

    def restore(self, state: ro.State | None, config: ro.Config) -> None:
        """Put back the rollout an update replaced (the update failed)."""
        self.state, self.config = state, config
        self._save()

    def end(self) -> None:
        """Forget the rollout (an update in another mode replaces it)."""
        if self.state is not None:
            self.state = None
            self._series.clear()
            self._write(None)

    def add_samples(self, samples: dict[int, analysis.Sample], now: float) -> None:
        """A load report's per-version outcomes (already deduplicated); a pass judges them."""
        for version, sample in samples.items():
            self._series.setdefault(version, analysis.Series()).add(sample, now)
        if samples and self.active:
            self.kick()

    def verdict(self, now: float) -> analysis.Verdict | None:
        """The analysis of the canary against the stable version now."""
        if self.state is None:
            return None
        s = self.state
        return analysis.analyze(
            self._series.get(s.stable_version), self._series.get(s.canary_version), self.config.thresholds, now
        )

    def decide(
        self, views: Sequence[st.ReplicaView], *, target: int, canary_stopped: str, now: float
    ) -> Outcome | None:
        """The rollout's decision for this pass, persisted and its events recorded; None without
        an active rollout."""
        if self.state is None or not self.active:
            return None
        s = self.state
        ready = sum(1 for v in views if v.version == s.canary_version and v.status is st.ReplicaStatus.READY)
        seen = ro.Observed(
            now=now, target=target, canary_ready=ready, canary_stopped=canary_stopped, verdict=self.verdict(now)
        )
        return self._apply(ro.decide(s, self.config, seen), views, canary_stopped)

    def promote(self, *, full: bool, now: float) -> None:
        """Move on now (ValueError when no rollout is active)."""
        if self.state is None:
            raise ValueError("no rollout")
        self.state = ro.promote(self.state, self.config, now, full=full)
        self._save()
        where = "the final step" if self.state.step > len(self.config.steps) else f"step {self.state.step}"
        self._events.record(
            self.name,
            event_log.Draft(event_log.NORMAL, "RolloutPromoted", f"promoted by a user to {where}", self._object()),
        )

    def abort(self, views: Sequence[st.ReplicaView], *, target: int, now: float) -> Outcome:
        """Roll back now (ValueError when no rollout is active)."""
        if self.state is None:
            raise ValueError("no rollout")
        return self._apply(ro.abort(self.state, self.config, now, target=target), views, "")

    def abort_now(self, now: float) -> None:
        """Abort outside a pass: every request to the stable version at once, then the rollback."""
        if self.state is None or not self.active:
            raise ValueError("no rollout")
        decision = ro.abort(self.state, self.config, now, target=1)
        self.state = decision.state
        self._save()
        self._weights = decision.weights
        self._wake(None)
        for reason, message in decision.events:
            self._events.record(self.name, event_log.Draft(event_log.WARNING, reason, message, self._object()))
        state = decision.state
        asyncio.get_running_loop().call_soon(self.on_action, ro.Action.ROLLBACK, state)

    def _apply(self, decision: ro.Decision, views: Sequence[st.ReplicaView], canary_stopped: str) -> Outcome:
        changed = decision.state != self.state
        self.state = decision.state
        if changed:
            self._save()
        for reason, message in decision.events:
            kind = event_log.WARNING if reason in ("RolloutRolledBack", "RolloutFailed") else event_log.NORMAL
            self._events.record(self.name, event_log.Draft(kind, reason, message, self._object()))
        plan = ro.scale(views, decision, canary_version=decision.state.canary_version, stopped=bool(canary_stopped))
        return Outcome(decision, plan)

    # ---- the core's hooks ------------------------------------------------------------------

    def scale(
        self, views: Sequence[st.ReplicaView], *, target: int, latest_version: int, stopped: str
    ) -> scaling.ScalePlan | None:
        """The pass's launches and teardowns while a rollout is active, else None (the core's own).

        Args:
            views: every replica record of the service.
            target: the autoscaler's target.
            latest_version: the service's newest version.
            stopped: the stop rule's message for the latest version, or empty.
        """
        self.latest_version = latest_version
        s = self.state
        if s is not None and s.phase is ro.Phase.ROLLED_BACK and s.canary_version == latest_version:
            # Until the restored spec is the latest version: nothing of the canary is launched.
            self._weights = self._resting_weights(latest_version)
            hold = ro.Decision(s, self._weights, 0, keep_stable=True)
            return ro.scale(views, hold, canary_version=s.canary_version, stopped=True)
        if not self.active or s is None or s.canary_version != latest_version:
            self._weights = self._resting_weights(latest_version)
            return None
        outcome = self.decide(views, target=target, canary_stopped=stopped, now=self._clock())
        if outcome is None:
            return None
        decision = outcome.decision
        self._weights = decision.weights
        self._wake(decision.wake_at)
        if decision.action is not ro.Action.NONE:
            state = decision.state
            asyncio.get_running_loop().call_soon(self.on_action, decision.action, state)
        return outcome.plan

    def weights(self, latest_version: int) -> dict[int, int]:
        """Per-mille weights by version for the endpoint set of a service whose newest version is
        `latest_version`; empty: no split.

        After a rollback they follow `latest_version` at the moment of publishing, not at the
        last pass: the restore relabels the stable replicas as the new version between passes,
        and endpoints published then with the old weights would leave no replica routable.
        """
        s = self.state
        if s is not None and s.phase is ro.Phase.ROLLED_BACK:
            return self._resting_weights(latest_version)
        return dict(self._weights)

    def decorate(self, svc: res.Service) -> None:
        """Add the rollout's status and the stable version to a service view."""
        status = self.status()
        if status is not None:
            svc.rollout.CopyFrom(status)
        s = self.state
        if s is not None and s.phase is ro.Phase.SUCCEEDED:
            svc.stable_version = s.canary_version
        elif s is not None and s.phase is not ro.Phase.ROLLED_BACK:
            svc.stable_version = s.stable_version
        elif svc.active_versions and svc.ready_replicas >= svc.target_replicas:
            svc.stable_version = max(svc.active_versions)
        elif svc.active_versions:
            svc.stable_version = min(svc.active_versions)

    def _resting_weights(self, latest_version: int) -> dict[int, int]:
        """Weights while no rollout is active: after a rollback every request goes to the stable
        version, then to the version that restores its spec (until the next update); else no split."""
        s = self.state
        if s is not None and s.phase is ro.Phase.ROLLED_BACK:
            # The restored spec's version alone, so a canary replica still draining gets nothing.
            return {s.stable_version if latest_version == s.canary_version else latest_version: 1000}
        return {}

    def _wake(self, at: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if at is not None:
            delay = max(at - self._clock(), 0.0) + 0.01
            self._timer = asyncio.get_running_loop().call_later(delay, self.kick)

    def close(self) -> None:
        """Stop the timer."""
        self._wake(None)

    def status(self) -> res.RolloutStatus | None:
        """The rollout as the API shows it in `Service.rollout`."""
        return None if self.state is None else status_of(self.state, self.config)

    def _object(self) -> str:
        return f"version/{self.state.canary_version}" if self.state else "service"

    def _save(self) -> None:
        self._write(None if self.state is None else self.state.dump())


def status_of(s: ro.State, config: ro.Config) -> res.RolloutStatus:
    """A rollout as the API shows it in `Service.rollout`."""
    weight = ro.weight_of(s, config)
    out = res.RolloutStatus(
        stable_version=s.stable_version,
        canary_version=s.canary_version,
        state=int(s.phase),  # type: ignore[arg-type]
        step=s.step,
        step_count=len(config.steps),
        canary_weight=weight if s.phase in (ro.Phase.PROGRESSING, ro.Phase.FAILED) else 0,
        start_time=pbtime.timestamp(s.started_at),
        message=s.message,
        analysis=s.analysis,
    )
    if s.phase is ro.Phase.SUCCEEDED:
        out.canary_weight = 100
    if s.step_ready_at is not None:
        out.step_start_time.CopyFrom(pbtime.timestamp(s.step_ready_at))
    elif s.phase is ro.Phase.PROGRESSING:
        out.deadline_time.CopyFrom(pbtime.timestamp(s.progress_at + config.progress_deadline_s))
    if s.ended_at is not None:
        out.end_time.CopyFrom(pbtime.timestamp(s.ended_at))
    return out
