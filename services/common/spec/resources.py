"""The `resources` section: ports, spot, sizes, accelerators, placement and any_of/ordered.

Each any_of/ordered entry is a whole alternative (the top-level keys are defaults it overrides),
and every alternative must serve on one port (`serving_port`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from replicaplane.common.v1 import spec_pb2
from services.common.spec import checks, schema

_CPUS_RE = re.compile(r"\d+(\.\d+)?\+?")
_MEMORY_RE = re.compile(r"\d+(\.\d+)?([KkMmGgTt][Bb]?)?[+x]?")
_PORT_RANGE_RE = re.compile(r"(\d+)\s*-\s*(\d+)")
_CLOUD_ALIASES = {"k8s": "kubernetes"}


class Alternative:
    """One launchable set of resources with where each field came from, for error paths."""

    def __init__(self, resources: spec_pb2.Resources, path: str, given: set[str], *, bad_ports: bool) -> None:
        self.resources = resources
        self.path = path
        self.given = given
        # True when the ports this alternative uses were invalid (and already reported).
        self.bad_ports = bad_ports

    def field(self, key: str) -> str:
        """Path of `key`: on the entry when the entry set it, else on the top level."""
        return f"{self.path}.{key}" if key in self.given else f"resources.{key}"


def parse(c: checks.Checker, raw: Any, out: spec_pb2.Resources) -> list[Alternative]:
    """Fills `out`; returns the launchable alternatives (any_of/ordered entries, else the top)."""
    section = c.mapping(raw, "resources")
    if section is None:
        return []
    given, bad_ports = _fields(c, section, "resources", out, nested=False)
    alternatives: list[Alternative] = []
    lists = [k for k in ("any_of", "ordered") if section.get(k) is not None]
    if len(lists) == 2:
        c.add("resources.ordered", "any_of and ordered are mutually exclusive")
    for kind in lists:
        entries = section[kind]
        if not isinstance(entries, list) or not entries:
            got = "an empty list" if entries == [] else checks.kind(entries)
            c.add(f"resources.{kind}", f"must be a non-empty list of resource mappings, got {got}")
            continue
        for i, raw_entry in enumerate(entries):
            path = f"resources.{kind}[{i}]"
            entry = c.mapping(raw_entry, path)
            if entry is None:
                continue
            parsed = spec_pb2.Resources()
            entry_given, entry_bad_ports = _fields(c, entry, path, parsed, nested=True)
            merged = _merge(out, parsed, entry_given)
            getattr(out, kind).append(merged)
            bad = entry_bad_ports or ("ports" not in entry_given and bad_ports)
            alternatives.append(Alternative(merged, path, entry_given, bad_ports=bad))
    if not lists:
        alternatives.append(Alternative(out, "resources", given, bad_ports=bad_ports))
    elif alternatives and all(a.resources.use_spot == alternatives[0].resources.use_spot for a in alternatives):
        out.use_spot = alternatives[0].resources.use_spot
    spot = {a.resources.use_spot for a in alternatives}
    if len(spot) > 1:
        c.add(
            "resources.use_spot",
            "resources must be all spot or all on-demand; to mix, use base_ondemand_fallback_replicas "
            "or dynamic_ondemand_fallback with use_spot: true",
        )
    return alternatives


def _fields(
    c: checks.Checker, section: dict[Any, Any], path: str, out: spec_pb2.Resources, *, nested: bool
) -> tuple[set[str], bool]:
    """Reads one resources mapping (without any_of/ordered).

    Returns:
        The proto fields it set, and whether it gave ports that were invalid (and reported).
    """
    if nested:
        c.keys(section, path, schema.RESOURCE_ENTRY_KEYS, schema.UNSUPPORTED_RESOURCE_ENTRY)
    else:
        c.keys(section, path, schema.RESOURCE_KEYS, schema.UNSUPPORTED_RESOURCES)
    given: set[str] = set()
    bad_ports = False

    def present(key: str) -> bool:
        return section.get(key) is not None

    def take(key: str, read: Callable[[Any, str], Any]) -> None:
        if present(key):
            value = read(section[key], f"{path}.{key}")
            if value is not None:
                setattr(out, key, value)
                given.add(key)

    if present("ports"):
        ports = _ports(c, section["ports"], f"{path}.ports")
        if ports is not None:
            out.ports.extend(ports)
            given.add("ports")
        else:
            bad_ports = True
    take("use_spot", c.boolean)
    take("cpus", lambda raw, where: _quantity(c, raw, where, _CPUS_RE))
    take("memory", lambda raw, where: _quantity(c, raw, where, _MEMORY_RE))
    take("accelerators", lambda raw, where: _accelerators(c, raw, where))
    take("cloud", lambda raw, where: _cloud(c, raw, where))
    for key in ("region", "zone", "instance_type"):
        take(key, lambda raw, where: _stripped(c, raw, where))
    if present("infra"):
        if any(present(k) for k in ("cloud", "region", "zone")):
            c.add(f"{path}.infra", "infra and cloud/region/zone are mutually exclusive")
        else:
            parts = _infra(c, section["infra"], f"{path}.infra")
            if parts is not None:
                out.cloud, out.region, out.zone = parts
                given.update({"cloud", "region", "zone"})
    take("disk_size", c.integer)
    take("image_id", lambda raw, where: _image_id(c, raw, where))
    if present("labels"):
        labels = c.mapping(section["labels"], f"{path}.labels")
        if labels is not None:
            for key, value in labels.items():
                if not isinstance(key, str) or not key:
                    c.add(f"{path}.labels", "label names must be non-empty strings")
                elif c.string(value, f"{path}.labels.{checks.short(key)}") is not None:
                    out.labels[key] = value
            given.add("labels")
    return given, bad_ports


def _merge(top: spec_pb2.Resources, entry: spec_pb2.Resources, given: set[str]) -> spec_pb2.Resources:
    """The top-level resources with the fields an entry set replaced by the entry's."""
    merged = spec_pb2.Resources()
    merged.CopyFrom(top)
    merged.ClearField("any_of")
    merged.ClearField("ordered")
    for key in given:
        if key == "ports":
            merged.ClearField("ports")
            merged.ports.extend(entry.ports)
        elif key == "labels":
            merged.ClearField("labels")
            merged.labels.update(entry.labels)
        else:
            setattr(merged, key, getattr(entry, key))
    return merged


def serving_port(c: checks.Checker, alternatives: list[Alternative], service_port: int | None) -> int | None:
    """Resolves the one port replicas serve on, checking it against every alternative."""
    if not alternatives:
        return service_port
    if any(a.bad_ports for a in alternatives):
        return None
    if service_port is not None:
        ok = True
        for alt in alternatives:
            if service_port not in alt.resources.ports:
                c.add("service.ports", f"port {service_port} must be one of {alt.field('ports')}")
                ok = False
        return service_port if ok else None
    found: set[int] = set()
    complete = True
    for alt in alternatives:
        ports = list(alt.resources.ports)
        if len(ports) != 1:
            complete = False
            got = "none" if not ports else f"{len(ports)} ports"
            c.add(
                alt.field("ports"),
                f"a service needs exactly one port here, or service.ports naming one of them (got {got})",
            )
        else:
            found.add(ports[0])
    if len(found) > 1:
        c.add(
            "resources.ports",
            f"alternatives serve on different ports {sorted(found)}; use one port or set service.ports",
        )
        return None
    return found.pop() if complete and found else None


def port_value(c: checks.Checker, raw: Any, path: str) -> int | None:
    """One port number, 1..65535, given as an integer or a string of digits."""
    if isinstance(raw, str) and raw.strip().isdigit():
        raw = int(raw.strip())
    if isinstance(raw, bool) or not isinstance(raw, int):
        c.add(path, f"must be a port number, got {checks.kind(raw)}")
        return None
    if not 1 <= raw <= 65535:
        c.add(path, f"port must be in 1..65535, got {raw}")
        return None
    return raw


def _ports(c: checks.Checker, raw: Any, path: str) -> list[int] | None:
    """Parses resources.ports: an int, "8080", "8080-8081", or a list of those; sorted, unique."""
    items = raw if isinstance(raw, list) else [raw]
    ports: set[int] = set()
    ok = True
    for i, item in enumerate(items):
        where = f"{path}[{i}]" if isinstance(raw, list) else path
        if isinstance(item, str) and (match := _PORT_RANGE_RE.fullmatch(item.strip())):
            low, high = int(match.group(1)), int(match.group(2))
            if not (1 <= low <= 65535 and 1 <= high <= 65535):
                c.add(where, f"ports must be in 1..65535, got range {low}-{high}")
                ok = False
            elif low > high:
                c.add(where, f"range start must not exceed its end, got {low}-{high}")
                ok = False
            else:
                ports.update(range(low, high + 1))
            continue
        if isinstance(item, str) and not item.strip().isdigit():
            c.add(where, "must be a port number or a range such as '8080-8081'")
            ok = False
            continue
        port = port_value(c, item, where)
        if port is None:
            ok = False
        else:
            ports.add(port)
    if isinstance(raw, list) and not raw:
        return []
    return sorted(ports) if ok else None


def _quantity(c: checks.Checker, raw: Any, path: str, pattern: re.Pattern[str]) -> str | None:
    """Normalizes cpus/memory: a number, or text such as '2', '2+', '0.5', '16+' ('8x' for memory)."""
    if isinstance(raw, bool):
        c.add(path, "must be a number or a string such as '2+'")
        return None
    if isinstance(raw, int | float):
        if not math.isfinite(raw) or raw < 0:
            c.add(path, "must be a finite number >= 0")
            return None
        return checks.fmt_number(float(raw))
    if isinstance(raw, str) and pattern.fullmatch(raw.strip()):
        return raw.strip()
    c.add(path, "must be a number or a string such as '2', '2+' or '0.5'")
    return None


def _accelerators(c: checks.Checker, raw: Any, path: str) -> str | None:
    """Normalizes accelerators to "NAME:COUNT[,NAME:COUNT...]" from a string, list or mapping."""
    bad = "must name accelerators such as 'A100', 'A100:2', a list of them, or a mapping {A100: 1}"
    if isinstance(raw, Mapping):
        pairs = list(raw.items())
    else:
        texts = raw.split(",") if isinstance(raw, str) else raw if isinstance(raw, list) else [raw]
        pairs = [(text, None) for text in texts]
    items: list[tuple[str, float]] = []
    for key, value in pairs:
        match = schema.ACCELERATOR_RE.fullmatch(key.strip()) if isinstance(key, str) else None
        # {A100: 1} maps names to counts; the set form {A100:1, H100:1} (no space after the
        # colon) is read by YAML as keys "A100:1" with no value.
        if match is None or (match.group(2) and value is not None):
            c.add(path, bad)
            return None
        if match.group(2):
            count = float(match.group(2))
            if count <= 0:
                c.add(path, "accelerator counts must be > 0")
                return None
        elif value is None:
            count = 1.0
        else:
            number = c.number(value, f"{path}.{checks.short(key)}", positive=True)
            if number is None:
                return None
            count = number
        items.append((match.group(1), count))
    if not items:
        c.add(path, bad)
        return None
    return ",".join(f"{name}:{checks.fmt_number(count)}" for name, count in items)


def _infra(c: checks.Checker, raw: Any, path: str) -> tuple[str, str, str] | None:
    """Splits `infra: cloud[/region[/zone]]`; for Kubernetes the rest is the context name."""
    text = c.string(raw, path)
    if text is None:
        return None
    parts = [p.strip() for p in text.strip().split("/")]
    bad = "must look like 'aws', 'aws/us-east-1' or 'aws/us-east-1/us-east-1a'"
    if not parts[0]:
        c.add(path, bad)
        return None
    cloud = _cloud_name(parts[0])
    if cloud == "kubernetes":
        return cloud, "/".join(parts[1:]), ""
    if len(parts) > 3 or any(not p for p in parts):
        c.add(path, bad)
        return None
    parts += ["", ""]
    # '*' is SkyPilot's "any" for a part.
    cloud = "" if cloud == "*" else cloud
    return cloud, "" if parts[1] == "*" else parts[1], "" if parts[2] == "*" else parts[2]


def _cloud_name(text: str) -> str:
    lowered = text.lower()
    return _CLOUD_ALIASES.get(lowered, lowered)


def _cloud(c: checks.Checker, raw: Any, path: str) -> str | None:
    text = _stripped(c, raw, path)
    return None if text is None else _cloud_name(text)


def _stripped(c: checks.Checker, raw: Any, path: str) -> str | None:
    text = c.string(raw, path)
    return None if text is None else text.strip()


def _image_id(c: checks.Checker, raw: Any, path: str) -> str | None:
    if isinstance(raw, Mapping):
        c.add(path, "a per-region image_id mapping is not supported; give one image id")
        return None
    return c.string(raw, path)
