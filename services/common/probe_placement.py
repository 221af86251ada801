"""Where each probe target goes in the prober fleet: one live stream each, least-loaded, rebalanced.

Pure bookkeeping, no I/O: the fleet client (probe_fleet) reports streams going live or dead and
targets added or removed; the placement says which stream holds each target and queues the
changes each stream has to send. Targets are spread evenly over streams first, then over probers.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses

import grpc

from replicaplane.prober.v1 import prober_service_pb2 as pb


@dataclasses.dataclass(eq=False)
class Stream:
    """One Probe stream to one prober, and the targets assigned to it."""

    addr: str
    index: int
    live: bool = False
    prober_id: str = ""
    targets: set[str] = dataclasses.field(default_factory=set)
    upserts: dict[str, pb.ProbeTarget] = dataclasses.field(default_factory=dict)
    removes: set[str] = dataclasses.field(default_factory=set)
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    call: grpc.aio.StreamStreamCall | None = None

    def queue_upsert(self, target: pb.ProbeTarget) -> None:
        """Send `target` (new or changed) on this stream."""
        self.removes.discard(target.target_id)
        self.upserts[target.target_id] = target
        self.wake.set()

    def queue_remove(self, target_id: str) -> None:
        """Tell this stream's prober to stop probing `target_id`."""
        self.upserts.pop(target_id, None)
        self.removes.add(target_id)
        self.wake.set()


class Placement:
    """Every target, the live stream each is on, and the ones no live stream could take."""

    def __init__(self) -> None:
        self.targets: dict[str, pb.ProbeTarget] = {}
        self.assigned: dict[str, Stream] = {}
        self.unassigned: set[str] = set()
        self.live: list[Stream] = []
        self._prober_load: collections.Counter[str] = collections.Counter()

    def _key(self, stream: Stream) -> tuple[int, int]:
        # Even over streams first, then over probers: ties go to the least-loaded prober.
        return len(stream.targets), self._prober_load[stream.addr]

    def _least_loaded(self) -> Stream | None:
        if not self.live:
            return None
        return min(self.live, key=self._key)

    def _assign(self, target_id: str, stream: Stream) -> None:
        self.unassigned.discard(target_id)
        self.assigned[target_id] = stream
        stream.targets.add(target_id)
        self._prober_load[stream.addr] += 1
        stream.queue_upsert(self.targets[target_id])

    def _unassign(self, target_id: str, stream: Stream) -> None:
        self.assigned.pop(target_id, None)
        stream.targets.discard(target_id)
        self._prober_load[stream.addr] -= 1

    def place(self, target_ids: list[str]) -> list[str]:
        """Put targets on the least-loaded live streams.

        Returns:
            The targets no live stream could take (they stay unassigned).
        """
        homeless = []
        for target_id in target_ids:
            if target_id not in self.targets:
                continue
            stream = self._least_loaded()
            if stream is None:
                self.unassigned.add(target_id)
                homeless.append(target_id)
            else:
                self._assign(target_id, stream)
        return homeless

    def remove(self, target_id: str) -> None:
        """Forget `target_id`; its stream is told to stop probing it."""
        self.targets.pop(target_id, None)
        self.unassigned.discard(target_id)
        stream = self.assigned.get(target_id)
        if stream is not None:
            self._unassign(target_id, stream)
            stream.queue_remove(target_id)

    def rebalance(self) -> None:
        """Move targets until streams differ by at most one target, and probers too.

        Each move lowers (spread over streams, spread over probers), so this ends.
        """
        while len(self.live) > 1:
            most = max(self.live, key=self._key)
            least = min(self.live, key=self._key)
            gap = len(most.targets) - len(least.targets)
            if gap >= 2:
                count = gap // 2
            elif gap == 1 and self._prober_load[most.addr] - self._prober_load[least.addr] >= 2:
                count = 1
            else:
                return
            for _ in range(count):
                target_id = next(iter(most.targets))
                self._unassign(target_id, most)
                most.queue_remove(target_id)
                self._assign(target_id, least)

    def went_live(self, stream: Stream) -> None:
        """`stream` was accepted: it takes the unassigned targets and its share of the others."""
        stream.live = True
        # Interleave streams of different probers, so ties spread over probers.
        self.live.append(stream)
        self.live.sort(key=lambda s: (s.index, s.addr))
        self.place(sorted(self.unassigned))
        self.rebalance()

    def went_dead(self, stream: Stream) -> list[str]:
        """`stream` broke: it holds nothing any more and sends nothing.

        Returns:
            Its targets, for the caller to place again.
        """
        stream.live = False
        self.live.remove(stream)
        moved = list(stream.targets)
        for target_id in moved:
            self._unassign(target_id, stream)
        stream.upserts.clear()
        stream.removes.clear()
        return moved

    def prober_left(self, addr: str) -> None:
        """Forget the load of a prober that left the fleet (its streams went dead first)."""
        self._prober_load.pop(addr, None)
