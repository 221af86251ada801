"""Loading spec YAML safely: size and alias-bomb limits, duplicate keys, unstorable strings.

Every failure is one violation on field `yaml` (or on the path of an unstorable string) and
never quotes the text, which may hold a secret.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml

from services.common import errors
from services.common.spec import checks, schema


def _refuse_duplicate_keys(node: yaml.MappingNode) -> None:
    """A second `run:` is a mistake, not an override."""
    seen: set[str] = set()
    for key_node, _ in node.value:
        # Merge keys (<<) may repeat and override on purpose; only plain scalar keys count.
        if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
            continue
        if key_node.value in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {checks.short(key_node.value)!r}", key_node.start_mark
            )
        seen.add(key_node.value)


class _Loader(yaml.SafeLoader):
    """A safe loader that rejects duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        _refuse_duplicate_keys(node)
        return super().construct_mapping(node, deep=deep)


class _FastLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """`_Loader` with libyaml's parser, about 10x faster where PyYAML has it. It refuses a few
    documents the pure parser reads (a lone surrogate escape): any document it refuses is read
    again by `_Loader`, so what is accepted and every error stay the pure parser's."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        _refuse_duplicate_keys(node)
        return super().construct_mapping(node, deep=deep)


def load(yaml_text: str) -> dict[Any, Any]:
    """Loads a spec document.

    Args:
        yaml_text: The task YAML.

    Returns:
        The top-level mapping.

    Raises:
        errors.ValidationError: If the text is too large, malformed, not a mapping, expands past
            the node limit, or holds a string no process argument or UTF-8 store can hold.
    """

    def fail(description: str) -> errors.ValidationError:
        return errors.ValidationError([errors.FieldViolation("yaml", description)], subject="service spec")

    if not isinstance(yaml_text, str):
        raise fail("the spec must be YAML text")
    if len(yaml_text.encode("utf-8", "surrogatepass")) > schema.MAX_YAML_BYTES:
        raise fail(f"the spec is larger than {schema.MAX_YAML_BYTES} bytes")
    try:
        # Both loaders are safe loaders: no arbitrary Python objects.
        try:
            config = yaml.load(yaml_text, Loader=_FastLoader)
        except (yaml.YAMLError, ValueError, OverflowError, TypeError, RecursionError):
            config = yaml.load(yaml_text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        # str(exc) quotes the offending line, which may hold a secret: report position only.
        where = ""
        if exc.problem_mark is not None:
            where = f" at line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}"
        problem = exc.problem or exc.context or "syntax error"
        raise fail(f"malformed YAML: {problem}{where}") from None
    except yaml.YAMLError:
        raise fail("malformed YAML") from None
    except (ValueError, OverflowError, TypeError):
        # An impossible date (2001-13-45) or an integer over Python's digit limit: the message
        # would quote the value.
        raise fail("malformed YAML: a value cannot be read (an impossible date or a number too long)") from None
    except RecursionError:
        raise fail("malformed YAML: nested too deeply") from None
    if not isinstance(config, dict):
        got = "an empty document" if config is None else checks.kind(config)
        raise fail(f"the document must be a mapping of task keys (name, service, resources, run, ...), got {got}")
    if _expanded_size(config) > schema.MAX_EXPANDED_NODES:
        raise fail(f"the document expands to more than {schema.MAX_EXPANDED_NODES} values (alias bomb or recursion)")
    unreadable = [errors.FieldViolation(path, problem) for path, problem in _unstorable_strings(config, "")]
    if unreadable:
        raise errors.ValidationError(unreadable[:20], subject="service spec")
    return config


def _unstorable_strings(node: Any, path: str) -> Iterator[tuple[str, str]]:
    """Yields (path, problem) for keys and values no process argument or UTF-8 store can hold."""

    def problem(text: str) -> str | None:
        if "\x00" in text:
            return "must not contain a NUL character"
        if any("\ud800" <= ch <= "\udfff" for ch in text):
            return "must not contain a lone surrogate (invalid unicode)"
        return None

    if isinstance(node, str):
        bad = problem(node)
        if bad:
            yield path or "yaml", bad
    elif isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, str) and (bad := problem(key)):
                yield path or "yaml", f"a key {bad}"
                continue
            yield from _unstorable_strings(
                value, checks.join(path, checks.short(key)) if isinstance(key, str) else path
            )
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _unstorable_strings(item, f"{path}[{i}]")


def _expanded_size(root: Any) -> int:
    """Counts values as if aliases were copied; a cycle counts as too many."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Any) -> int:
        if not isinstance(node, list | dict):
            return 1
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            return schema.MAX_EXPANDED_NODES + 1
        active.add(key)
        children = list(node.keys()) + list(node.values()) if isinstance(node, dict) else node
        total = 1
        for child in children:
            total += size(child)
            if total > schema.MAX_EXPANDED_NODES:
                break
        active.discard(key)
        sizes[key] = total
        return total

    try:
        return size(root)
    except RecursionError:
        return schema.MAX_EXPANDED_NODES + 1
