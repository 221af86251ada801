"""Scrape a live `/metrics` endpoint and read samples with prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import urllib.request
from collections.abc import Callable, Mapping

from prometheus_client import parser


@dataclasses.dataclass(frozen=True)
class Scrape:
    """One scrape: every family, by name, as the text parser read it."""

    families: dict[str, parser.Metric]
    text: str

    def family(self, name: str) -> parser.Metric:
        """The family `name` (for counters, without `_total`); AssertionError if it is missing."""
        assert name in self.families, f"no metric family {name}; have {sorted(self.families)}"
        return self.families[name]

    def samples(self, name: str, **labels: str) -> list[parser.Sample]:
        """Samples named `name` (a sample name: `x_total`, `x_bucket`, ...) whose labels include `labels`."""
        out = []
        for family in self.families.values():
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    out.append(sample)
        return out

    def value(self, name: str, **labels: str) -> float:
        """The sum of the matching samples' values (0 if none match)."""
        return sum(s.value for s in self.samples(name, **labels))

    def has(self, name: str, **labels: str) -> bool:
        """True if a sample matches."""
        return bool(self.samples(name, **labels))


def scrape(url: str, *, timeout: float = 10.0) -> Scrape:
    """GET `url` and parse it (blocking: call through asyncio.to_thread from async tests)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        assert resp.status == 200, resp.status
        assert resp.headers["Content-Type"].startswith("text/plain"), resp.headers["Content-Type"]
        text = resp.read().decode()
    return Scrape({f.name: f for f in parser.text_string_to_metric_families(text)}, text)


async def ascrape(url: str) -> Scrape:
    """scrape() from async code."""
    return await asyncio.to_thread(scrape, url)


async def until(
    url: str, pred: Callable[[Scrape], bool], *, timeout: float = 30.0, what: str = "the metrics"
) -> Scrape:
    """Scrape until `pred` holds (bounded by `timeout`); AssertionError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    last: Scrape | None = None
    while time.monotonic() < deadline:
        last = await ascrape(url)
        if pred(last):
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what} never got there within {timeout:.0f} s; last scrape:\n{last.text if last else ''}")


def labels_of(scrape: Scrape, name: str) -> list[Mapping[str, str]]:
    """The label sets of every sample named `name`."""
    return [s.labels for s in scrape.samples(name)]
