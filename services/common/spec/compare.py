"""Comparing specs: whether replicas of one spec can be kept under another (spec.md 7.2)."""

from __future__ import annotations

from replicaplane.common.v1 import spec_pb2


def launch_config(spec: spec_pb2.ServiceSpec) -> spec_pb2.ServiceSpec:
    """Returns the part of a spec that decides how a replica is launched, normalized.

    The `service` section (a pool's `pool` policy included), the YAML text and the task name are
    cleared, `resources.any_of` is sorted and an unset `kind` reads as SERVICE (specs stored
    before pools), so two specs launch alike exactly when their launch configs are equal. A
    service and a pool never launch alike.

    Args:
        spec: A parsed spec.

    Returns:
        A new message; `spec` is not changed.
    """
    out = spec_pb2.ServiceSpec()
    out.CopyFrom(spec)
    out.ClearField("service")
    out.ClearField("yaml")
    out.ClearField("name")
    if out.kind == spec_pb2.FLEET_KIND_UNSPECIFIED:
        out.kind = spec_pb2.FLEET_KIND_SERVICE
    entries = sorted(out.resources.any_of, key=lambda r: r.SerializeToString(deterministic=True))
    copies = [spec_pb2.Resources() for _ in entries]
    for copy, entry in zip(copies, entries, strict=True):
        copy.CopyFrom(entry)
    out.resources.ClearField("any_of")
    out.resources.any_of.extend(copies)
    return out


def is_in_place_update(old: spec_pb2.ServiceSpec, new: spec_pb2.ServiceSpec) -> bool:
    """Says whether replicas of `old` can be kept, version bumped, under `new` (spec.md 7.2).

    True when the specs differ only in the `service:` section (for a pool: only in `pool:`, its
    sizes, thresholds and delays), both are services or both pools, neither has a workdir or a
    non-empty file_mounts, and `resources.any_of` is equal ignoring order. A change of the
    serving port (`service.ports`) is not in place: the replica was launched serving the old one.

    Args:
        old: The spec a replica runs.
        new: The spec of the new version.

    Returns:
        True if the replica can be kept.
    """
    if old.workdir or new.workdir or old.file_mounts or new.file_mounts:
        return False
    if old.service.port != new.service.port:
        return False
    return launch_config(old) == launch_config(new)
