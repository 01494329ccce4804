"""A Prometheus /metrics page as plain data, for tests: sample name -> [(labels, value)]."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse(text: str) -> Samples:
    """Sample name (a counter's ends in `_total`) -> [(labels, value)] of one /metrics page."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def family_names(text: str) -> set[str]:
    """The metric families of one /metrics page (a counter's name without `_total`)."""
    return {fam.name for fam in text_string_to_metric_families(text)}


def scrape(url: str, timeout: float = 10.0) -> Samples:
    return parse(httpx.get(f"{url}/metrics", timeout=timeout).text)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the `name` samples whose labels include `labels` (0.0 when there is none)."""
    return sum(
        (v for lab, v in samples.get(name, []) if all(lab.get(k) == w for k, w in labels.items())),
        0.0,
    )


def values(samples: Samples, name: str) -> list[float]:
    return [v for _, v in samples.get(name, [])]


def counter(url: str, name: str, **labels: str) -> float:
    """Sum of a counter's samples at `url`/metrics whose labels include `labels`."""
    return total(scrape(url), name, **labels)
