"""The benchmarks' full-size specs pass the checks of the controller each bench configures.

`make bench-smoke` runs every bench on tiny sizes (and dry-runs these specs against a running
controller); this catches the same rot in the unit suite, without starting anything.
"""

from __future__ import annotations

import importlib.util
import os
import types

import pytest

from services.common import errors, spec
from services.controller import server as controller_server

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_bench(name: str) -> types.ModuleType:
    """Import bench/<name>.py (a script, not a package) without running it."""
    module_spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(REPO, "bench", f"{name}.py"))
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def violations(yaml_text: str, cap: int) -> list[str]:
    try:
        spec.parse(yaml_text, require_name=True, replica_cap=cap)
    except errors.ValidationError as exc:
        return [f"{v.field}: {v.description}" for v in exc.violations]
    return []


def test_controller_scale_bench_sizes_fit_its_controller_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    scale = load_bench("controller_scale")
    for key in [k for k in os.environ if k.startswith("REPLICAPLANE_")]:
        monkeypatch.delenv(key)
    for key, value in scale.controller_env("/nonexistent", "127.0.0.1:1", "127.0.0.1:2").items():
        monkeypatch.setenv(key, value)
    settings = controller_server.load_settings()
    for size in scale.SIZES:
        assert violations(scale.spec_yaml("big", size), settings.max_replicas_per_service) == [], size
        assert size <= settings.max_replicas_total, size
    assert settings.max_replicas_total >= scale.SERVICES * scale.PER_SERVICE


def test_autoscaler_bench_spec_fits_its_controller_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    autoscaler = load_bench("autoscaler")
    for key in [k for k in os.environ if k.startswith("REPLICAPLANE_")]:
        monkeypatch.delenv(key)
    for key, value in autoscaler.controller_env("/nonexistent", "127.0.0.1:1", "127.0.0.1:2").items():
        monkeypatch.setenv(key, value)
    cap = controller_server.load_settings().max_replicas_per_service
    assert violations(autoscaler.big_yaml(autoscaler.FULL_REPLICAS), cap) == []
    assert violations(autoscaler.LATENCY_YAML, cap) == []
