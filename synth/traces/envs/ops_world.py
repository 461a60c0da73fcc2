"""The `ops` environment's world and tools: services, people, metrics, logs, deploys and alerts, and how each tool
renders its response.

One world per split (train / validation / test): service and person names come from one registry
(`base.disjoint_names`), so no name of one split appears in another; deploy and alert ids come from split-disjoint
number ranges. Regions, teams, metrics, windows and log levels are a fixed vocabulary shared by all splits (they are
the schema, not entities). Observations (metric values, log counts, deploys, alerts) are drawn per task: a task is one
day of the fleet.

Responses are compact (two to seven lines) and echo their call in the first line, as an ops CLI would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvsteward.synth.rng import mix
from kvsteward.synth.traces.envs.base import disjoint_names
from kvsteward.synth.traces.world import SPLITS

REGIONS = ("eu-west", "eu-central", "us-east", "us-west", "ap-south", "ap-northeast", "sa-east", "ca-central")
TEAMS = ("payments", "search", "identity", "checkout", "messaging", "storage", "ads", "maps")
SUFFIXES = ("api", "gateway", "worker", "cache", "proxy", "indexer", "scheduler", "store", "router", "queue")
WINDOWS = ("1h", "6h", "24h")
LEVELS = ("error", "warn")


@dataclass(frozen=True)
class Metric:
    key: str  # the tool's metric argument
    unit: str  # " ms" or " %": appended to a value
    low: int  # plausible value range
    high: int

    def show(self, value: int) -> str:
        return f"{value}{self.unit}"


METRICS = {m.key: m for m in (
    Metric("p95_ms", " ms", 60, 900),
    Metric("cpu_pct", " %", 8, 97),
    Metric("mem_pct", " %", 15, 96),
)}

# Split-disjoint id ranges: the numeric part of `dep-NNNN` / `ALR-NNNN` ids.
ID_RANGES = {"train": (1000, 7999), "validation": (8000, 8999), "test": (9000, 9999)}

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr", "vl")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei")
_CODAS = ("", "", "n", "r", "l", "s", "x", "m")


def _syllables(r: random.Random, n: int) -> str:
    return "".join(r.choice(_ONSETS) + r.choice(_VOWELS) + r.choice(_CODAS) for _ in range(n))


def _service_name(r: random.Random) -> str:
    return f"{_syllables(r, 2)}-{r.choice(SUFFIXES)}"


def _person_name(r: random.Random) -> str:
    return f"{_syllables(r, 1).capitalize()} {_syllables(r, 2).capitalize()}"


@dataclass(frozen=True)
class Service:
    name: str
    team: str
    tier: int
    oncall: str
    regions: tuple[str, ...]


@dataclass
class World:
    """One split's fleet: services (each owned by a team, deployed in some regions) and people (on-call, authors)."""

    split: str
    services: list[Service]
    people: list[str]
    upstreams: list[str]  # service names that only appear inside log messages (dependencies outside the tasks)

    def team_region(self, team: str, region: str) -> list[Service]:
        return [s for s in self.services if s.team == team and region in s.regions]

    def lists(self, lo: int, hi: int) -> list[tuple[str, str]]:
        """(team, region) pairs whose service list has between `lo` and `hi` entries."""
        return [(t, g) for t in TEAMS for g in REGIONS if lo <= len(self.team_region(t, g)) <= hi]

    def ids(self, r: random.Random, prefix: str, n: int) -> list[str]:
        """`n` distinct record ids of this split's range, e.g. `dep-8812`."""
        lo, hi = ID_RANGES[self.split]
        return [f"{prefix}-{k}" for k in r.sample(range(lo, hi + 1), n)]


def build_worlds(seed: int, services_per_team: int) -> dict[str, World]:
    """The three split worlds, generated together so that their names are disjoint."""
    n_services = services_per_team * len(TEAMS)
    names = disjoint_names(mix(seed, "ops", "services"), n_services + 12, _service_name)
    people = disjoint_names(mix(seed, "ops", "people"), 40, _person_name)
    worlds = {}
    for split in SPLITS:
        r = random.Random(mix(seed, "ops", "world", split))
        services = []
        for k, name in enumerate(names[split][:n_services]):
            regions = tuple(sorted(r.sample(REGIONS, r.randint(3, 7)), key=REGIONS.index))
            services.append(Service(name, TEAMS[k % len(TEAMS)], r.randint(1, 3), r.choice(people[split]), regions))
        worlds[split] = World(split, services, people[split], names[split][n_services:])
    return worlds


# --- observations drawn per task -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Deploy:
    id: str
    service: str
    minute: int  # minutes after 00:00 UTC
    author: str
    version: str
    change: str
    previous: str  # id of the deploy before it on the same service


@dataclass(frozen=True)
class Alert:
    id: str
    service: str
    region: str
    minute: int
    metric: str
    limit: int
    severity: int


CHANGES = ("raise connection pool to {n}", "bump client library", "new retry policy ({n} tries)",
           "cache ttl {n}s", "feature flag rollout {n}%", "schema migration step {n}", "timeout {n}0 ms",
           "rebuild on new base image", "log sampling {n}%", "batch size {n}")
TOP_ERROR = ("timeout calling {dep} after {n}00 ms", "connection reset by {dep}", "circuit open to {dep}",
             "retry budget exhausted for {dep}", "5xx from {dep} ({n} in a row)", "pool exhausted ({n}/{n})")
TOP_WARN = ("slow response from {dep} ({n}00 ms)", "cache miss rate {n}%", "queue lag {n} s behind {dep}",
            "deprecated call to {dep}", "gc pause {n}0 ms", "token refresh retried {n}x")


def clock(minute: int) -> str:
    return f"{minute // 60:02d}:{minute % 60:02d}"


def version(r: random.Random) -> str:
    return f"{r.randint(1, 9)}.{r.randint(0, 40)}.{r.randint(0, 19)}"


def top_message(r: random.Random, level: str, dep: str) -> str:
    return r.choice(TOP_ERROR if level == "error" else TOP_WARN).format(dep=dep, n=r.randint(2, 9))


# --- tool responses --------------------------------------------------------------------------------------------

def render_list(region: str, team: str, services: list[Service]) -> str:
    rows = [f"{s.name} · on-call {s.oncall}" for s in services]
    return f"{team} services in {region}: {len(rows)}\n" + "\n".join(rows)


def render_service(s: Service) -> str:
    return (f"{s.name}: team {s.team}, tier-{s.tier}, on-call {s.oncall}\n"
            f"regions ({len(s.regions)}): {', '.join(s.regions)}")


def render_metric(r: random.Random, service: str, region: str, metric: str, window: str, value: int) -> str:
    m = METRICS[metric]
    lo = max(1, value * r.randint(45, 80) // 100)
    hi = value + max(1, value * r.randint(10, 60) // 100)
    if m.unit == " %":
        hi = min(100, max(hi, value + 1))
    extra = f"p50 {m.show(lo)}, max {m.show(hi)}" if metric == "p95_ms" else f"min {m.show(lo)}, max {m.show(hi)}"
    return f"{service} @ {region}, {metric} over {window}: {m.show(value)}\n{extra}"


def render_logs(service: str, region: str, level: str, window: str, count: int, top: str, top_count: int) -> str:
    return (f"{service} @ {region}, {level} logs over {window}: {count} lines\n"
            f"top ({top_count}x): {top}")


def render_deploys(service: str, deploys: list[Deploy], newest_first: bool) -> str:
    rows = sorted(deploys, key=lambda d: d.minute, reverse=newest_first)
    lines = [f"{d.id} · {clock(d.minute)} · {d.author}" for d in rows]
    return f"{service}: {len(lines)} deploys today\n" + "\n".join(lines)


def render_deploy(d: Deploy) -> str:
    return (f"{d.id}: {d.service}, version {d.version}\n"
            f"out {clock(d.minute)} UTC by {d.author} · change: {d.change} · previous {d.previous}")


def render_alert(a: Alert) -> str:
    m = METRICS[a.metric]
    return (f"{a.id}: {a.service} @ {a.region}, fired {clock(a.minute)} UTC\n"
            f"condition {a.metric} > {m.show(a.limit)} for 5 min · sev-{a.severity} · firing")
