"""Autoscalers (spec.md section 6): plain functions from a policy, load and replicas to a target.

Four kinds, selected from the spec in SkyPilot's order: spot with on-demand fallback, then
instance-aware (per-accelerator QPS targets), then request rate, else fixed size. They share
one state (target, hysteresis clocks, load window), so an update that changes the kind carries
the state over as it is.

Hysteresis is measured in time, not in counted decisions: a higher target is adopted once the
candidate has stayed higher for `upscale_delay_s` (lower: `downscale_delay_s`), and the caller
is told when to decide next, so the adoption happens the moment the delay has elapsed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from services.controller.domain import status as st

FIXED = "fixed"
REQUEST_RATE = "request_rate"
INSTANCE_AWARE = "instance_aware"
FALLBACK = "fallback"

DECISION_INTERVAL_S = 20.0
"""Decisions are made at least this often (SkyPilot's 20 s)."""
ZERO_DECISION_INTERVAL_S = 5.0
"""... and this often while the target is 0 (SkyPilot's 5 s)."""
QPS_WINDOW_S = 60.0
"""Load reports count over this window."""

# Statuses whose accelerators count toward the capacity an instance-aware autoscaler sees.
_CAPACITY = frozenset({st.ReplicaStatus.READY, st.ReplicaStatus.STARTING, st.ReplicaStatus.PROVISIONING})


@dataclasses.dataclass(frozen=True)
class Policy:
    """The replica policy of the latest version, as plain values."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_qps: float = 0.0
    """Target QPS per replica; 0 when unset."""
    target_qps_per_accelerator: Mapping[str, float] = dataclasses.field(default_factory=dict)
    upscale_delay_s: float = 300.0
    downscale_delay_s: float = 1200.0
    num_overprovision: int = 0
    use_spot: bool = False
    base_ondemand: int = 0
    dynamic_fallback: bool = False
    spot_placer: bool = False
    """Spot replicas are placed by the `dynamic_fallback` placer."""

    @property
    def kind(self) -> str:
        """Which autoscaler the policy selects, in SkyPilot's order."""
        if self.use_spot and (self.base_ondemand > 0 or self.dynamic_fallback):
            return FALLBACK
        if self.target_qps_per_accelerator:
            return INSTANCE_AWARE
        if self.target_qps > 0:
            return REQUEST_RATE
        return FIXED

    def clip(self, n: int) -> int:
        """`n` within [min_replicas, max_replicas]."""
        return max(self.min_replicas, min(max(self.max_replicas, self.min_replicas), n))

    def final(self, target: int) -> int:
        """The replica count to run for `target`: overprovision on top."""
        return target + max(self.num_overprovision, 0)


@dataclasses.dataclass(frozen=True)
class Hysteresis:
    """The adopted target and since when a different candidate has held (wall-clock seconds)."""

    target: int
    upscale_since: float | None = None
    downscale_since: float | None = None


@dataclasses.dataclass(frozen=True)
class Decision:
    """The outcome of one decision."""

    state: Hysteresis
    reason: str
    next_in_s: float
    """Seconds until the next decision is due (the cadence, or sooner when a delay elapses)."""


# ---- load ------------------------------------------------------------------------------------


def add_load(window: dict[int, int], times: Sequence[float], count: int, now: float, *, window_s: float) -> int:
    """Add requests to a per-second bucket window and drop buckets older than `window_s`.

    Args:
        window: second -> request count; changed in place.
        times: arrival times of single requests (any order).
        count: requests without times, counted at `now`.
        now: the current time.
        window_s: the window length.

    Returns:
        The requests added (times older than the window are not).
    """
    horizon = now - window_s
    added = 0
    for t in times:
        if t >= horizon:
            key = int(t)
            window[key] = window.get(key, 0) + 1
            added += 1
    if count > 0:
        window[int(now)] = window.get(int(now), 0) + count
        added += count
    for key in [k for k in window if k + 1 <= horizon]:
        del window[key]
    return added


def qps(window: Mapping[int, int], now: float, *, window_s: float) -> float:
    """Requests per second over the last `window_s` seconds."""
    horizon = now - window_s
    return sum(n for k, n in window.items() if k + 1 > horizon) / window_s


# ---- targets ---------------------------------------------------------------------------------


def accelerator_qps(policy: Policy, accelerator: str) -> float:
    """An accelerator's target QPS: exact key, else a key whose name before ':' matches, else the
    smallest target (SkyPilot's lookup)."""
    table = policy.target_qps_per_accelerator
    if accelerator in table:
        return table[accelerator]
    for key, value in table.items():
        if key.split(":", 1)[0] == accelerator:
            return value
    return min(table.values())


def _ceil(x: float) -> int:
    return math.ceil(x - 1e-9)  # 3 requests / 3 s at 1 QPS per replica is 1 replica, not 2


def candidate(policy: Policy, load_qps: float, replicas: Sequence[st.ReplicaView]) -> int:
    """The target the load asks for, clipped to [min, max] (overprovision not included).

    Args:
        policy: the latest version's policy.
        load_qps: requests per second over the window.
        replicas: every replica record (used by the instance-aware autoscaler).
    """
    if policy.target_qps_per_accelerator:
        return policy.clip(_instance_aware(policy, load_qps, replicas))
    if policy.target_qps > 0:
        return policy.clip(_ceil(load_qps / policy.target_qps))
    return policy.min_replicas


def _instance_aware(policy: Policy, load_qps: float, replicas: Sequence[st.ReplicaView]) -> int:
    biggest = max(policy.target_qps_per_accelerator.values())
    counted = [r for r in replicas if r.status in _CAPACITY]
    capacity = sum(accelerator_qps(policy, r.accelerator) for r in counted)
    if capacity <= 0:
        # SkyPilot returns min_replicas here, which never scales a service up from zero.
        return _ceil(load_qps / biggest) if load_qps > 0 else policy.min_replicas
    if load_qps >= capacity:
        # Fix over SkyPilot: count live replicas, not every record (failed ones included).
        return len(counted) + _ceil((load_qps - capacity) / biggest)
    ready = sorted(
        (accelerator_qps(policy, r.accelerator) for r in counted if r.status is st.ReplicaStatus.READY),
        reverse=True,
    ) or [biggest]
    total = 0.0
    for n, each in enumerate(ready, start=1):
        total += each
        if total > load_qps:
            return n
    return len(ready) + max(_ceil((load_qps - total) / biggest), 1)


# ---- hysteresis ------------------------------------------------------------------------------


def decide(
    policy: Policy,
    state: Hysteresis,
    wanted: int,
    now: float,
    *,
    interval_s: float = DECISION_INTERVAL_S,
    zero_interval_s: float = ZERO_DECISION_INTERVAL_S,
) -> Decision:
    """Move the adopted target toward `wanted` with upscale/downscale delays.

    A target of 0 is left at once (fast scale from zero); a candidate equal to the target
    clears both clocks; a higher (lower) candidate starts the upscale (downscale) clock and
    clears the other, and is adopted once its clock reaches the delay.
    """

    def cadence(target: int) -> float:
        return zero_interval_s if policy.final(target) == 0 else interval_s

    current = state.target
    if wanted == current:
        held = Hysteresis(current)
        return Decision(held, f"target {current} holds", cadence(current))
    if current == 0:
        return Decision(Hysteresis(wanted), f"scale from zero to {wanted} at once", cadence(wanted))
    up = wanted > current
    delay = policy.upscale_delay_s if up else policy.downscale_delay_s
    since = state.upscale_since if up else state.downscale_since
    since = now if since is None else since
    word = "up" if up else "down"
    if now - since >= delay:
        return Decision(
            Hysteresis(wanted), f"scaled {word} from {current} to {wanted} after {delay:g} s", cadence(wanted)
        )
    pending = Hysteresis(current, since if up else None, None if up else since)
    left = since + delay - now
    reason = f"scale {word} to {wanted} in {left:.3g} s unless the load changes"
    return Decision(pending, reason, min(cadence(current), left))


# ---- spot with on-demand fallback ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FallbackPlan:
    """Launches of each kind and scale-down victims among latest-version replicas."""

    spot_launch: int = 0
    ondemand_launch: int = 0
    victims: tuple[int, ...] = ()


def fallback_counts(policy: Policy, *, target: int, spot_ready: int) -> tuple[int, int]:
    """(spot, on-demand) replicas wanted.

    Spot = final target - base; on-demand = base, plus (dynamic) the spot replicas wanted but
    not READY, at most the target without overprovision.
    """
    spot = max(policy.final(target) - policy.base_ondemand, 0)
    ondemand = policy.base_ondemand + (max(spot - spot_ready, 0) if policy.dynamic_fallback else 0)
    return spot, min(ondemand, target)


def most_replicas(policy: Policy) -> int:
    """The most replicas `policy` can ask for at once: the final target at max_replicas, and with
    spot fallback the on-demand ones beside the spot ones (dynamic fallback starts a stand-in for
    every spot replica that is not READY). What the controller's replica budget reserves."""
    top = policy.clip(max(policy.max_replicas, policy.min_replicas))
    if policy.kind == FALLBACK:
        spot, ondemand = fallback_counts(policy, target=top, spot_ready=0)
        return spot + ondemand
    return policy.final(top)


def fallback_plan(policy: Policy, latest_live: Sequence[st.ReplicaView], *, target: int) -> FallbackPlan:
    """What to launch and remove so the latest version runs the fallback mix.

    Args:
        policy: the latest version's policy.
        latest_live: non-terminal replicas of the latest version.
        target: the adopted target, without overprovision.
    """
    spot = [r for r in latest_live if r.is_spot]
    ondemand = [r for r in latest_live if not r.is_spot]
    spot_ready = sum(1 for r in spot if r.status is st.ReplicaStatus.READY)
    want_spot, want_ondemand = fallback_counts(policy, target=target, spot_ready=spot_ready)
    victims = st.scale_down_victims(spot, len(spot) - want_spot)
    victims += st.scale_down_victims(ondemand, len(ondemand) - want_ondemand)
    return FallbackPlan(
        spot_launch=max(want_spot - len(spot), 0),
        ondemand_launch=max(want_ondemand - len(ondemand), 0),
        victims=tuple(r.replica_id for r in victims),
    )
