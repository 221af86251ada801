"""One Python environment (a venv) per service version for local replicas, made once and shared.

A replica's `setup` (`pip install ...`) installs into its version's venv, not into the Python of
the host (which runs the provisioner, often as root), and a version never sees what another
version installed. The venv is made with the standard `venv` module from the provisioner's base
interpreter, without pip of its own and, by default, with the system site-packages visible:
making one takes milliseconds and a few dozen KB, and packages the host already has need no
install. `pip` in the venv runs `python -m pip`, which installs into the venv: the base
interpreter's pip, or where there is none (or system packages are hidden) the provisioner's own,
made importable by a `.pth` file that adds only a link to it. Only without either is pip
installed into each venv with `ensurepip`, which takes seconds.

Until a setup has succeeded in a venv, the setups of its replicas run one at a time, so parallel
`pip install`s never write into one environment at once; after that they run side by side
(installing what is there already is a quick no-op). A venv is removed with its last replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import venv
from collections.abc import AsyncIterator, Callable

from services.provisioner import model

log = logging.getLogger(__name__)

_MADE = ".replicaplane-made"
_PIP_WRAPPER = '#!/bin/sh\nexec "{python}" -m pip "$@"\n'


class EnvError(Exception):
    """A venv could not be made; the message says why and how to turn venvs off."""


@dataclasses.dataclass
class Env:
    """One service version's venv.

    Attributes:
        key: the directory name under the envs root.
        path: the venv directory.
        users: replicas using it.
        made: the venv is complete on disk.
        ready: a setup has succeeded in it, so later setups may run side by side.
    """

    key: str
    path: str
    users: int = 0
    made: bool = False
    ready: bool = False
    guard: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    turn: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


class PythonEnvs:
    """The venvs of one local backend, under `root`.

    Args:
        root: where venvs live (`<state_dir>/envs`).
        system_site_packages: whether replicas also see the base interpreter's packages.
    """

    def __init__(self, root: str, *, system_site_packages: bool = True) -> None:
        self._root = root
        self._system = system_site_packages
        self._envs: dict[str, Env] = {}
        self._pip: str | None = None  # where venvs get pip: "base", "ensurepip", or a link dir

    @staticmethod
    def key(launch: model.LaunchRequest) -> str:
        """The venv of a launch: its service, version and incarnation, and the setup that fills it."""
        prefix = f"{launch.service}-{launch.replica_id}"
        incarnation = launch.name[len(prefix) + 1 :] if launch.name.startswith(prefix + "-") else ""
        digest = hashlib.sha256(f"{incarnation}\0{launch.spec.setup}".encode()).hexdigest()[:10]
        return f"{launch.service}-v{launch.version}-{digest}"

    def hold(self, key: str) -> None:
        """Count a replica re-found after a restart as a user of its venv."""
        env = self._envs.setdefault(key, Env(key, os.path.join(self._root, key)))
        env.users += 1
        env.made = os.path.exists(os.path.join(env.path, _MADE))

    def prune(self) -> None:
        """Remove venvs no replica uses, and unfinished ones (blocking; at start)."""
        if not os.path.isdir(self._root):
            return
        for name in os.listdir(self._root):
            if name.startswith("."):
                continue  # the pip link dir, shared by every venv
            env = self._envs.get(name)
            if env is None or not env.made:
                shutil.rmtree(os.path.join(self._root, name), ignore_errors=True)

    async def acquire(self, key: str, note: Callable[[str], None]) -> Env:
        """The venv `key`, made if it does not exist yet; the caller becomes one of its users.

        Raises:
            EnvError: it could not be made.
        """
        env = self._envs.setdefault(key, Env(key, os.path.join(self._root, key)))
        env.users += 1
        try:
            async with env.guard:
                if env.made:
                    note(f"python environment {env.path} (shared by this version's replicas)")
                else:
                    started = time.monotonic()
                    await self._make(env, note)
                    env.made = True
                    note(f"python environment {env.path} made in {(time.monotonic() - started) * 1000:.0f} ms")
        except BaseException:
            await self.release(key)
            raise
        return env

    async def release(self, key: str) -> None:
        """One user fewer; the last one removes the venv."""
        env = self._envs.get(key)
        if env is None:
            return
        env.users -= 1
        if env.users > 0:
            return
        async with env.guard:
            if env.users == 0 and env.made:
                env.made = env.ready = False
                await asyncio.to_thread(shutil.rmtree, env.path, True)
        if env.users == 0 and self._envs.get(key) is env:
            del self._envs[key]

    @contextlib.asynccontextmanager
    async def setup_turn(self, env: Env) -> AsyncIterator[None]:
        """Hold while a setup runs: one at a time until one has succeeded (see the module docstring)."""
        if env.ready:
            yield
            return
        async with env.turn:
            yield

    def activate(self, key: str, base: dict[str, str]) -> dict[str, str]:
        """`base` with venv `key` active (a worker's jobs run in its setup's venv)."""
        return self.environment(self._envs.get(key) or Env(key, os.path.join(self._root, key)), base)

    @staticmethod
    def environment(env: Env, base: dict[str, str]) -> dict[str, str]:
        """`base` with the venv active, as `source bin/activate` would make it."""
        out = dict(base)
        out.pop("PYTHONHOME", None)
        out["VIRTUAL_ENV"] = env.path
        out["PATH"] = os.pathsep.join(p for p in (os.path.join(env.path, "bin"), base.get("PATH", "")) if p)
        return out

    async def _make(self, env: Env, note: Callable[[str], None]) -> None:
        await asyncio.to_thread(self._create, env.path)
        python = os.path.join(env.path, "bin", "python")
        if self._pip is None:
            self._pip = await self._find_pip(python)
        if self._pip == "ensurepip":
            note("installing pip into the python environment (no pip to lend it)")
            if not await _succeeds(python, "-m", "ensurepip", "--default-pip"):
                note("this Python has no ensurepip: `pip` will not work in setup or run")
        elif self._pip != "base":
            await asyncio.to_thread(_lend_pip, env.path, self._pip)
        await asyncio.to_thread(_mark_made, env.path)

    async def _find_pip(self, python: str) -> str:
        """Where venvs get pip from: the base interpreter, the provisioner's own, or ensurepip."""
        if self._system and await _succeeds(python, "-c", "import pip"):
            return "base"
        spec = importlib.util.find_spec("pip")
        locations = list(spec.submodule_search_locations or []) if spec else []
        if not locations:
            return "ensurepip"
        links = os.path.join(self._root, ".pip")
        await asyncio.to_thread(_link, locations[0], os.path.join(links, "pip"))
        return links

    def _create(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(self._root, mode=0o700, exist_ok=True)
        try:
            venv.EnvBuilder(system_site_packages=self._system, symlinks=True, with_pip=False).create(path)
        except (OSError, subprocess.CalledProcessError) as exc:
            raise EnvError(
                f"could not make the replica's python environment {path}: {exc}; set the provisioner's "
                "local_venv=false (REPLICAPLANE_PROVISIONER_LOCAL_VENV=false) to run replicas without one"
            ) from None
        python = os.path.join(path, "bin", "python")
        for name in ("pip", "pip3", f"pip3.{sys.version_info.minor}"):
            wrapper = os.path.join(path, "bin", name)
            with open(wrapper, "w", encoding="utf-8") as fh:
                fh.write(_PIP_WRAPPER.format(python=python))
            os.chmod(wrapper, 0o755)


async def _succeeds(*args: str) -> bool:
    proc = await asyncio.create_subprocess_exec(
        *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        return await proc.wait() == 0
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise


def _link(target: str, link: str) -> None:
    os.makedirs(os.path.dirname(link), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(link)
    os.symlink(target, link)


def _lend_pip(path: str, links: str) -> None:
    """Make the pip package in `links` importable in the venv at `path` (and nothing else)."""
    site = sysconfig.get_paths(scheme="venv", vars={"base": path, "platbase": path})["purelib"]
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "_replicaplane_pip.pth"), "w", encoding="utf-8") as fh:
        fh.write(links + "\n")


def _mark_made(path: str) -> None:
    with open(os.path.join(path, _MADE), "w", encoding="utf-8") as fh:
        fh.write("")
