"""The test Kubernetes API server keeps the real one's protocol where the backend relies on it.

These pin down tests/helpers/kube_api.py itself (the kubernetes backend's tests trust it):
versions, watch resume, 410, bookmarks, server-side timeouts, selectors, graceful deletion,
finalizers, garbage collection, admission, exec and scripted faults; and the fake scheduler of
tests/helpers/kube_emulator.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.helpers import kube_api, kube_emulator

NS = "/api/v1/namespaces/ns"


class _Client:
    def __init__(self, api: kube_api.KubeApi, session: aiohttp.ClientSession) -> None:
        self.api = api
        self.session = session

    async def call(self, method: str, path: str, body: Any = None, **params: str) -> tuple[int, dict[str, Any]]:
        headers = {"Content-Type": kube_api.MERGE_PATCH if method == "PATCH" else "application/json"}
        data = json.dumps(body) if body is not None else None
        async with self.session.request(method, self.api.url + path, data=data, params=params, headers=headers) as r:
            return r.status, await r.json()

    async def watch(self, path: str, **params: str) -> list[dict[str, Any]]:
        """Every event of one watch, until the server ends it."""
        events = []
        async with self.session.get(self.api.url + path, params={"watch": "true", **params}) as r:
            async for line in r.content:
                events.append(json.loads(line))
        return events


@pytest.fixture
async def kc() -> AsyncIterator[_Client]:
    api = kube_api.KubeApi(bookmark_interval_s=0.2, gc_delay_s=0.01)
    api.add_namespace("ns")
    await api.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            yield _Client(api, session)
    finally:
        await api.stop()


def _pod(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}, "spec": {"containers": [{"name": "c", "image": "x"}]}}


async def test_watches_resume_from_a_version_and_expire_once_compacted(kc: _Client) -> None:
    status, a = await kc.call("POST", f"{NS}/pods", _pod("a", app="x"))
    assert status == 201 and a["metadata"]["uid"] and a["status"] == {"phase": "Pending"}
    _, listing = await kc.call("GET", f"{NS}/pods")
    version = listing["metadata"]["resourceVersion"]
    await kc.call("POST", f"{NS}/pods", _pod("b", app="x"))
    await kc.call("PATCH", f"{NS}/pods/a", {"metadata": {"labels": {"app": "y"}}})
    # From the list's version: only what came after, and a change out of the selector is DELETED.
    events = await kc.watch(f"{NS}/pods", resourceVersion=version, labelSelector="app=x", timeoutSeconds="1")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "b"), ("DELETED", "a")]
    # Without a version: the current objects as ADDED.
    events = await kc.watch(f"{NS}/pods", labelSelector="app=x", timeoutSeconds="1")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "b")]
    kc.api.compact()
    (expired,) = await kc.watch(f"{NS}/pods", resourceVersion=version, timeoutSeconds="1")
    assert expired["type"] == "ERROR" and expired["object"]["code"] == 410
    assert expired["object"]["reason"] == "Expired"


async def test_quiet_watches_get_bookmarks_and_end_at_their_timeout(kc: _Client) -> None:
    _, listing = await kc.call("GET", f"{NS}/pods")
    await kc.call("POST", f"{NS}/secrets", {"metadata": {"name": "s"}})  # not a Pod: only the version moves
    events = await kc.watch(
        f"{NS}/pods",
        resourceVersion=listing["metadata"]["resourceVersion"],
        allowWatchBookmarks="true",
        timeoutSeconds="1",
    )
    # It ended: a watch the server kept open would have hit the session's 10 s timeout and raised.
    assert events and {e["type"] for e in events} == {"BOOKMARK"}
    assert int(events[-1]["object"]["metadata"]["resourceVersion"]) == kc.api.rv


async def test_bound_pods_are_deleted_gracefully_and_finalizers_hold_any_object(kc: _Client) -> None:
    await kc.call("POST", f"{NS}/pods", _pod("a"))
    await kc.call("POST", f"{NS}/pods/a/binding", {"target": {"name": "node-1"}})
    status, pod = await kc.call("DELETE", f"{NS}/pods/a", gracePeriodSeconds="5")
    assert status == 200 and pod["metadata"]["deletionGracePeriodSeconds"] == 5
    assert kc.api.get("pods", "ns", "a") is not None  # terminating until the kubelet is done
    await kc.call("DELETE", f"{NS}/pods/a", gracePeriodSeconds="0")
    assert kc.api.get("pods", "ns", "a") is None

    await kc.call("POST", f"{NS}/secrets", {"metadata": {"name": "s", "finalizers": ["x/hold"]}})
    await kc.call("DELETE", f"{NS}/secrets/s")
    assert kc.api.get("secrets", "ns", "s")["metadata"]["deletionTimestamp"]
    await kc.call("PATCH", f"{NS}/secrets/s", {"metadata": {"finalizers": None}})
    assert kc.api.get("secrets", "ns", "s") is None
    status, _ = await kc.call("PATCH", f"{NS}/pods/gone", {"metadata": {"labels": {"a": "b"}}})
    assert status == 404


async def test_owned_objects_go_with_their_owner(kc: _Client) -> None:
    _, pod = await kc.call("POST", f"{NS}/pods", _pod("a"))
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "a", "uid": pod["metadata"]["uid"]}
    await kc.call("POST", f"{NS}/secrets", {"metadata": {"name": "owned", "ownerReferences": [owner]}})
    await kc.call("POST", f"{NS}/secrets", {"metadata": {"name": "free"}})
    await kc.call("DELETE", f"{NS}/pods/a")  # never bound: goes at once
    async with asyncio.timeout(5):
        while kc.api.get("secrets", "ns", "owned") is not None:
            await asyncio.sleep(0.01)
    assert kc.api.names("secrets", "ns") == ["free"]


async def test_errors_are_status_objects_and_faults_are_scripted(kc: _Client) -> None:
    assert (await kc.call("POST", f"{NS}/pods", _pod("Bad_Name")))[0] == 422
    assert (await kc.call("POST", "/api/v1/namespaces/none/pods", _pod("a")))[0] == 404
    await kc.call("POST", f"{NS}/pods", _pod("a"))
    status, body = await kc.call("POST", f"{NS}/pods", _pod("a"))
    assert (status, body["reason"]) == (409, "AlreadyExists")
    kc.api.fail("create", "pods", 500, after_commit=True)
    assert (await kc.call("POST", f"{NS}/pods", _pod("b")))[0] == 500
    assert kc.api.get("pods", "ns", "b") is not None  # applied, answer lost
    kc.api.fail("get", "pods", 429, retry_after=2)
    async with kc.session.get(kc.api.url + f"{NS}/pods/a") as r:
        assert (r.status, r.headers["Retry-After"]) == (429, "2")
    assert (await kc.call("GET", f"{NS}/pods/a"))[0] == 200  # the fault was used up


def _sized(name: str, **limits: str) -> dict[str, Any]:
    pod = _pod(name)
    pod["spec"]["containers"][0]["resources"] = {"limits": limits}
    return pod


async def test_limit_ranges_and_quotas_refuse_pods_as_the_admission_plugins_do(kc: _Client) -> None:
    # A request left out is the limit (the API server's defaulting).
    _, pod = await kc.call("POST", f"{NS}/pods", _sized("a", cpu="1"))
    assert pod["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "1"}

    kc.api.set_limit_range("ns", {"cpu": "2"})
    status, body = await kc.call("POST", f"{NS}/pods", _sized("b", cpu="4"))
    assert (status, body["reason"]) == (403, "Forbidden")
    assert body["message"] == 'pods "b" is forbidden: maximum cpu usage per Container is 2, but limit is 4'
    kc.api.set_limit_range("ns", {})

    # A quota counts the Pods that have not ended.
    kc.api.set_quota("ns", "gpus", {"requests.nvidia.com/gpu": "1"})
    assert (await kc.call("POST", f"{NS}/pods", _sized("g1", **{"nvidia.com/gpu": "1"})))[0] == 201
    status, body = await kc.call("POST", f"{NS}/pods", _sized("g2", **{"nvidia.com/gpu": "1"}))
    assert status == 403
    assert body["message"] == (
        'pods "g2" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=1, '
        "used: requests.nvidia.com/gpu=1, limited: requests.nvidia.com/gpu=1"
    )
    assert kc.api.get("pods", "ns", "g2") is None  # refused: nothing stored
    await kc.call("PATCH", f"{NS}/pods/g1/status", {"status": {"phase": "Succeeded"}})
    assert (await kc.call("POST", f"{NS}/pods", _sized("g2", **{"nvidia.com/gpu": "1"})))[0] == 201


async def test_the_fake_scheduler_places_by_free_resources_and_retries_when_they_free_up(tmp_path) -> None:
    emu = kube_emulator.Emulator(str(tmp_path), namespace="ns", nodes=[kube_emulator.gpu_node("a100", "A100", 1)])
    emu.start()

    def gpu_pod(name: str, accelerator: str) -> dict[str, Any]:
        pod = _sized(name, **{"nvidia.com/gpu": "1"})
        pod["spec"]["containers"][0]["command"] = ["sleep", "30"]
        pod["spec"]["nodeSelector"] = {"replicaplane.dev/accelerator": accelerator}
        return pod

    async def scheduled(name: str) -> dict[str, Any]:
        async with asyncio.timeout(10):
            while True:
                pod = await emu.pod(name)
                conditions = {c["type"]: c for c in ((pod or {}).get("status") or {}).get("conditions") or []}
                if pod is not None and ("PodScheduled" in conditions or pod["spec"].get("nodeName")):
                    return pod
                await asyncio.sleep(0.02)

    def why_not(pod: dict[str, Any]) -> str:
        (condition,) = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
        assert (condition["status"], condition["reason"]) == ("False", "Unschedulable")
        return str(condition["message"])

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            kc = _Client(emu.api, session)
            await kc.call("POST", f"{NS}/pods", gpu_pod("first", "a100"))
            assert (await scheduled("first"))["spec"]["nodeName"] == "a100"
            await kc.call("POST", f"{NS}/pods", gpu_pod("second", "a100"))
            assert why_not(await scheduled("second")) == "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
            await kc.call("DELETE", f"{NS}/pods/first", gracePeriodSeconds="0")
            async with asyncio.timeout(10):  # its GPU is free again: the waiting Pod gets it
                while not ((await emu.pod("second")) or {}).get("spec", {}).get("nodeName"):
                    await asyncio.sleep(0.02)

            await kc.call("POST", f"{NS}/pods", gpu_pod("third", "h100"))
            reasons = why_not(await scheduled("third"))
            assert reasons == "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
            nodes = [kube_emulator.gpu_node("a100", "A100", 1), kube_emulator.gpu_node("h100", "H100", 1)]
            await emu.call(emu.kubelet.set_nodes(nodes))  # a cluster autoscaler adds a node
            async with asyncio.timeout(10):
                while ((await emu.pod("third")) or {}).get("spec", {}).get("nodeName") != "h100":
                    await asyncio.sleep(0.02)
    finally:
        emu.stop()


async def test_exec_runs_in_the_pods_container_streams_channels_and_dies_with_it(tmp_path) -> None:
    emu = kube_emulator.Emulator(str(tmp_path), namespace="ns").start()
    pod = _pod("worker")
    pod["spec"]["containers"][0].update(command=["sh", "-c", "sleep 30"], env=[{"name": "WHO", "value": "pod-env"}])

    async def exec_(command: list[str]) -> list[tuple[int, bytes]]:
        query = [("command", c) for c in command] + [("stdout", "true"), ("stderr", "true")]
        url = emu.url.replace("http", "ws", 1) + f"{NS}/pods/worker/exec"
        frames: list[tuple[int, bytes]] = []
        async with session.ws_connect(url, params=query, protocols=("v4.channel.k8s.io",)) as ws:
            async for message in ws:
                frames.append((message.data[0], bytes(message.data[1:])))
        return frames

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            kc = _Client(emu.api, session)
            async with session.get(emu.url + f"{NS}/pods/worker/exec", params={"command": "true"}) as r:
                assert r.status == 404  # no such Pod
            await kc.call("POST", f"{NS}/pods", pod)
            async with asyncio.timeout(10):
                while not emu.kubelet.alive():
                    await asyncio.sleep(0.02)
            frames = await exec_(["sh", "-c", 'echo "$WHO in $(basename $PWD)"; echo oops >&2; exit 3'])
            out = b"".join(d for c, d in frames if c == 1).decode()
            assert out.startswith("pod-env in worker-") and b"".join(d for c, d in frames if c == 2) == b"oops\n"
            status = json.loads(next(d for c, d in frames if c == 3))
            assert status["reason"] == "NonZeroExitCode" and status["details"]["causes"][0]["message"] == "3"
            # What an exec starts in a group of its own dies with the container.
            await exec_(["sh", "-c", "setsid sleep 30 >/dev/null 2>&1 < /dev/null &"])
            await emu.call(emu.kubelet.delete_pod("worker"))
            async with asyncio.timeout(10):
                while emu.kubelet.alive():
                    await asyncio.sleep(0.05)
            async with session.get(emu.url + f"{NS}/pods/worker/exec", params={"command": "true"}) as r:
                assert r.status == 404
    finally:
        emu.stop()
