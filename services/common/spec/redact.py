"""Redaction: a spec safe to show, with header and secret values masked everywhere.

`redacted()` masks the stored message; `shown_yaml()` re-emits its YAML from the loaded values,
masked, since YAML can spell one value in many ways and the raw text cannot be searched safely.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from replicaplane.common.v1 import spec_pb2
from services.common import errors
from services.common.spec import loading

REDACTED = "<redacted>"

# Where a spec holds secret values; the stored message and the YAML use the same names.
_SECRET_SECTIONS = (("secrets",), ("service", "readiness_probe", "headers"))


def redacted(spec: spec_pb2.ServiceSpec, *, with_yaml: bool = True) -> spec_pb2.ServiceSpec:
    """Returns a copy safe to show: header and secret values replaced by `<redacted>`.

    Every occurrence of a header or secret value in any string of the spec is masked too, since
    secrets are substituted into `service`, `file_mounts` and `workdir`. `yaml` is not the text
    the user sent but the document re-emitted from its loaded values with the same masking
    (see `shown_yaml`).

    Args:
        spec: A parsed spec.
        with_yaml: False: `yaml` is left empty (re-emitting it is most of the cost).

    Returns:
        A new message.
    """
    out = spec_pb2.ServiceSpec()
    out.CopyFrom(spec)
    values = secret_values(spec)
    for section in _message_sections(out):
        # Keys are listed first: assigning to a protobuf map while iterating it skips entries.
        for key in list(section):
            section[key] = REDACTED
    if values:
        _mask_strings(out, lambda text: mask_secrets(text, values))
    out.yaml = shown_yaml(spec.yaml, values) if with_yaml else ""
    return out


def secret_values(spec: spec_pb2.ServiceSpec) -> list[str]:
    """The header and secret values of a spec, longest first (so a value holding another is masked whole)."""
    values = {value for section in _message_sections(spec) for value in section.values()}
    return sorted((v for v in values if v), key=len, reverse=True)


def mask_secrets(text: str, values: list[str]) -> str:
    """Replaces every occurrence of each value (from `secret_values`) in text."""
    for value in values:
        if value in text:
            text = text.replace(value, REDACTED)
    return text


def shown_yaml(yaml_text: str, values: list[str]) -> str:
    """Re-emits a spec's YAML for display, with header and secret values replaced.

    The text is loaded, every value under `secrets:` and `service.readiness_probe.headers:` is
    replaced, every key and value holding one of `values` (from `secret_values`) is masked, and
    the result is dumped again. Masking works on the loaded values, which have one spelling
    whatever the quoting, escapes, line folding or anchors of the text; the raw text is never
    returned. Comments and formatting are not kept.

    Args:
        yaml_text: The YAML a spec was parsed from.
        values: The values to mask anywhere.

    Returns:
        The YAML to show; empty if the text does not load as a spec document (it did when it
        was accepted).
    """
    if not yaml_text:
        return ""
    try:
        config = loading.load(yaml_text)
    except errors.ValidationError:
        return ""
    # Replaced in place first, where the document says they are secret; aliases of these
    # mappings elsewhere are replaced with them.
    for section in _yaml_sections(config):
        for key in list(section):
            section[key] = REDACTED
    try:
        return yaml.dump(
            _hide(config, values),
            Dumper=_ShownDumper,
            sort_keys=False,
            allow_unicode=True,
            default_flow_style=False,
            width=100,
        )
    except (yaml.YAMLError, RecursionError, ValueError, TypeError):
        return ""


def _message_sections(spec: spec_pb2.ServiceSpec) -> list[Any]:
    """The secret maps of a stored message."""
    return [functools.reduce(getattr, path, spec) for path in _SECRET_SECTIONS]


def _yaml_sections(config: dict[Any, Any]) -> list[dict[Any, Any]]:
    """The secret mappings of a loaded document, where present."""
    found = []
    for path in _SECRET_SECTIONS:
        node: Any = config
        for key in path:
            node = node.get(key) if isinstance(node, Mapping) else None
        if isinstance(node, dict):
            found.append(node)
    return found


# The values are masked before they are dumped, so the faster C emitter is as safe.
_SafeDumper: type[yaml.SafeDumper] = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _ShownDumper(_SafeDumper):  # type: ignore[valid-type,misc]
    """A safe dumper that writes multi-line strings (run scripts) as literal blocks."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    # PyYAML falls back to a quoted style where a block cannot hold the text exactly.
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_ShownDumper.add_representer(str, _represent_str)


def _hide(node: Any, values: list[str]) -> Any:
    """A copy of loaded YAML with every key and value holding one of `values` masked."""
    if isinstance(node, str):
        return mask_secrets(node, values)
    if isinstance(node, Mapping):
        return {_hide(key, values): _hide(value, values) for key, value in node.items()}
    if isinstance(node, list | tuple | set | frozenset):
        return [_hide(item, values) for item in node]
    if node is None or not values:
        return node
    # A number, boolean, date or bytes: SkyPilot stringifies env and secret values, so a
    # secret `PIN: 1234` is "1234"; its text is checked the same way.
    text = node.decode("utf-8", "replace") if isinstance(node, bytes) else str(node)
    return REDACTED if mask_secrets(text, values) != text else node


def _mask_strings(message: Any, fill: Callable[[str], str]) -> None:
    """Applies fill to every string field, map key and value of a message, recursively."""
    for field, value in list(message.ListFields()):
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            entries = list(value.items())
            for key, _ in entries:
                del value[key]
            for key, item in entries:
                new_key = fill(key) if isinstance(key, str) else key
                if value_field.message_type is not None:
                    _mask_strings(item, fill)
                    value[new_key].CopyFrom(item)
                else:
                    value[new_key] = fill(item) if isinstance(item, str) else item
        elif field.message_type is not None:
            items = value if field.is_repeated else [value]
            for item in items:
                _mask_strings(item, fill)
        elif field.type == field.TYPE_STRING:
            if field.is_repeated:
                value[:] = [fill(item) for item in value]
            else:
                setattr(message, field.name, fill(value))
