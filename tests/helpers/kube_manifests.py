"""The settings deploy/kubernetes gives each service, read from the kustomization's ConfigMaps.

The e2e suite runs the services with these, so a test cannot drift from the manifests; the
unit suite checks that kustomize builds the same ConfigMaps from them.
"""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes" / "base"


def read_env_file(path: Path) -> dict[str, str]:
    """A kustomize env file: KEY=VALUE lines; blank lines and # comments skipped."""
    out: dict[str, str] = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{path}: {raw!r} is not KEY=VALUE")
        out[key.strip()] = value
    return out


def config_map(name: str, base: Path = BASE) -> dict[str, str]:
    """The data of generated ConfigMap `name` (its env files and literals, in order)."""
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text(encoding="utf-8"))
    (generator,) = [g for g in kustomization.get("configMapGenerator") or [] if g["name"] == name]
    data: dict[str, str] = {}
    for env_file in generator.get("envs") or []:
        data.update(read_env_file(base / env_file))
    for literal in generator.get("literals") or []:
        key, _, value = literal.partition("=")
        data[key] = value
    return data


def service_env(component: str) -> dict[str, str]:
    """What the manifests set for `component` (controller, provisioner, prober, loadbalancer)."""
    return config_map(f"replicaplane-{component}")
