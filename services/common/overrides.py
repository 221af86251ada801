"""Env and secret overrides (SkyPilot's `--env` and `--secret`) applied to a task YAML.

They are applied to the YAML before it is parsed, so a key the YAML lists with no value
(`HF_TOKEN:`, SkyPilot's way of saying "give this at launch") is filled and then validated like
any other. Only the `envs:` and `secrets:` mappings change: the document is edited as a YAML node
tree and emitted again, so anchors, duplicate keys and everything the parser checks reach it
as sent. Comments are not kept.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import yaml

from services.common import errors

_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STR_TAG = "tag:yaml.org,2002:str"
_MAP_TAG = "tag:yaml.org,2002:map"
_NULL_TAG = "tag:yaml.org,2002:null"
# Larger documents are refused by the parser anyway; they are not worth composing here.
_MAX_YAML_CHARS = 1 << 20


def apply(yaml_text: str, *, envs: Mapping[str, str], secrets: Mapping[str, str]) -> str:
    """Return the YAML with `envs` set in its `envs:` and `secrets` in its `secrets:`.

    A given key replaces the YAML's value (empty or not) or is added. A document that cannot
    take them (malformed, not one mapping, a section that is not a mapping) is returned
    unchanged, for the parser to refuse with its own violation.

    Args:
        yaml_text: the task YAML as sent.
        envs: environment variables to set.
        secrets: secrets to set; their values never appear in an error.

    Returns:
        The YAML to parse; `yaml_text` itself when there is nothing to set.

    Raises:
        errors.ValidationError: a key is not an environment variable name (field
            `env_overrides.KEY` or `secret_overrides.KEY`).
    """
    if not envs and not secrets:
        return yaml_text
    errors.require(_bad_keys(envs, "env_overrides") + _bad_keys(secrets, "secret_overrides"), subject="overrides")
    root = _compose(yaml_text)
    if root is None:
        return yaml_text
    for section, values in (("envs", envs), ("secrets", secrets)):
        if values and not _set(root, section, values):
            return yaml_text
    return str(yaml.serialize(root, Dumper=yaml.SafeDumper, allow_unicode=True, width=1 << 16))


def _bad_keys(values: Mapping[str, str], field: str) -> list[errors.FieldViolation]:
    return [
        errors.FieldViolation(
            f"{field}.{key[:64]}", "must be a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)"
        )
        for key in values
        if not _ENV_NAME_RE.fullmatch(key)
    ]


def _compose(yaml_text: str) -> yaml.MappingNode | None:
    if len(yaml_text) > _MAX_YAML_CHARS:
        return None
    try:
        root = yaml.compose(yaml_text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, ValueError, RecursionError):
        return None
    return root if isinstance(root, yaml.MappingNode) else None


def _set(root: yaml.MappingNode, section: str, values: Mapping[str, str]) -> bool:
    """Set `values` in the top-level mapping `section`; False if it cannot be done."""
    entries = [
        (i, value)
        for i, (key, value) in enumerate(root.value)
        if isinstance(key, yaml.ScalarNode) and key.value == section
    ]
    if len(entries) > 1:
        return False  # a duplicate key: the parser says so
    if not entries:
        root.value.append((_str(section), yaml.MappingNode(_MAP_TAG, [])))
        entries = [(len(root.value) - 1, root.value[-1][1])]
    index, node = entries[0]
    if isinstance(node, yaml.ScalarNode) and node.tag == _NULL_TAG:
        node = yaml.MappingNode(_MAP_TAG, [])
    elif isinstance(node, yaml.MappingNode):
        # A copy: the section may be an alias of a mapping used elsewhere in the document.
        node = yaml.MappingNode(node.tag, list(node.value), flow_style=node.flow_style)
    else:
        return False
    root.value[index] = (root.value[index][0], node)
    for name, value in values.items():
        found = [j for j, (key, _) in enumerate(node.value) if isinstance(key, yaml.ScalarNode) and key.value == name]
        if len(found) > 1:
            return False
        if found:
            node.value[found[0]] = (node.value[found[0]][0], _str(value))
        else:
            node.value.append((_str(name), _str(value)))
    return True


def _str(text: str) -> yaml.ScalarNode:
    # Double quotes can spell any string, so the value reads back exactly as given.
    return yaml.ScalarNode(_STR_TAG, text, style='"')
