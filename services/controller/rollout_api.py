"""The API edge of rollouts: which mode an update runs in, and the per-version statistics of load
reports, checked and read as analysis samples."""

from __future__ import annotations

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import errors, latency, pbtime, spec
from services.controller.domain import analysis

MAX_VERSIONS = 64
"""Entries in one report's `version_stats`."""
MAX_BUCKETS = latency.MAX_KEY - latency.MIN_KEY + 1
"""Latency buckets in one entry: as many as there are keys, so a larger map has bad keys (it is
refused with one violation instead of one per key)."""

_MODES: dict[int, res.UpdateMode.ValueType] = {
    spec_pb2.ROLLOUT_STRATEGY_ROLLING: res.UPDATE_MODE_ROLLING,
    spec_pb2.ROLLOUT_STRATEGY_BLUE_GREEN: res.UPDATE_MODE_BLUE_GREEN,
    spec_pb2.ROLLOUT_STRATEGY_CANARY: res.UPDATE_MODE_CANARY,
}


def update_mode(requested: res.UpdateMode.ValueType, yaml_text: str) -> res.UpdateMode.ValueType:
    """The mode an update runs in: the request's, else the new spec's `service.rollout.strategy`.

    A spec that does not parse keeps the requested mode: the update's own validation reports why.
    """
    mode = requested
    if mode == res.UPDATE_MODE_UNSPECIFIED:
        try:
            # No replica cap here: the controller applies its own when it parses the spec again.
            strategy = spec.parse(yaml_text, replica_cap=2**31 - 1).service.rollout.strategy
        except errors.ValidationError:
            strategy = spec_pb2.ROLLOUT_STRATEGY_UNSPECIFIED
        mode = _MODES.get(strategy, res.UPDATE_MODE_UNSPECIFIED)
    return mode


def version_samples(request: api.ReportLoadRequest) -> dict[int, analysis.Sample]:
    """A report's per-version statistics as analysis samples, by version.

    Raises:
        errors.ValidationError: with every malformed entry, each violation naming its field
            (`version_stats[2].server_errors`); nothing is recorded.
    """
    entries = request.version_stats
    if len(entries) > MAX_VERSIONS:
        raise errors.ValidationError(
            [errors.FieldViolation("version_stats", f"at most {MAX_VERSIONS} entries, got {len(entries)}")],
            subject="load report",
        )
    violations: list[errors.FieldViolation] = []
    first_at: dict[int, int] = {}
    out: dict[int, analysis.Sample] = {}
    for i, s in enumerate(entries):
        found = _problems(s, f"version_stats[{i}]")
        if s.version in first_at:
            found.append(
                errors.FieldViolation(
                    f"version_stats[{i}].version",
                    f"version {s.version} is listed twice (first at version_stats[{first_at[s.version]}])",
                )
            )
        first_at.setdefault(s.version, i)
        violations += found
        if not found:
            out[s.version] = analysis.Sample(
                requests=s.requests,
                server_errors=s.server_errors,
                transport_errors=s.transport_errors,
                latency_buckets=dict(s.latency_buckets),
                latency_sum_s=pbtime.seconds(s.latency_sum),
            )
    errors.require(violations, subject="load report")
    return out


def _problems(s: res.VersionStats, at: str) -> list[errors.FieldViolation]:
    out = []
    if s.version < 1:
        out.append(errors.FieldViolation(f"{at}.version", f"must be at least 1, got {s.version}"))
    for name in ("requests", "server_errors", "transport_errors"):
        value = getattr(s, name)
        if value < 0:
            out.append(errors.FieldViolation(f"{at}.{name}", f"must not be negative, got {value}"))
    failed = s.server_errors + s.transport_errors
    if s.server_errors >= 0 and s.transport_errors >= 0 and s.requests >= 0 and failed > s.requests:
        out.append(
            errors.FieldViolation(
                f"{at}.server_errors",
                f"server_errors + transport_errors ({failed}) must not exceed requests ({s.requests})",
            )
        )
    buckets = s.latency_buckets
    if len(buckets) > MAX_BUCKETS:
        out.append(errors.FieldViolation(f"{at}.latency_buckets", f"at most {MAX_BUCKETS} buckets, got {len(buckets)}"))
    else:
        for key in sorted(buckets):
            if not latency.MIN_KEY <= key <= latency.MAX_KEY:
                out.append(
                    errors.FieldViolation(
                        f"{at}.latency_buckets[{key}]", f"key must be {latency.MIN_KEY}..{latency.MAX_KEY}"
                    )
                )
            elif buckets[key] < 0:
                out.append(
                    errors.FieldViolation(f"{at}.latency_buckets[{key}]", f"must not be negative, got {buckets[key]}")
                )
        answered = sum(c for c in buckets.values() if c > 0)
        if answered > max(s.requests - s.transport_errors, 0) and not out:
            out.append(
                errors.FieldViolation(
                    f"{at}.latency_buckets",
                    f"holds {answered} latencies, more than the {s.requests - s.transport_errors} answered attempts",
                )
            )
    problem = pbtime.duration_problem(s.latency_sum, negative=False)
    if problem:
        out.append(errors.FieldViolation(f"{at}.latency_sum", problem))
    return out
