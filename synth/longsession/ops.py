"""The second long-session domain: an on-call operations session (a service's inventory, alert thresholds and
failover runbook in YAML), with probes that read them back.

Other facts than the settlement domain's (`longsession_defs`): region names, millisecond and percent thresholds, a
pager alias, an incident code, a drain timeout, all drawn per seed, written only into the three definition
messages. The values come in confusable pairs on purpose, as the settlement domain's fee rate and quantum do: two
regions (primary and failover), three numeric thresholds in one block, two durations. Its filler is prose (the
Python reference manual and stdlib docstrings, `synth/longsession/prose_filler.py`), not code.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvsteward.synth.longsession.defs import _WORDS, Definition, ProbeDraft, _region, probes_from_table

_SUFFIXES = ("gateway", "ledger", "ingest", "scheduler", "router", "indexer", "notifier", "billing")
_AREAS = ("eu", "us", "ap", "sa", "me", "af", "ca")
_DIRECTIONS = ("north", "south", "east", "west", "central", "northeast", "southwest")
_WEEKDAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")

OPS_FACT_KINDS = ("latency_p99_ms", "error_rate_pct", "failover_region", "primary_region", "pager", "incident_code",
                  "drain_timeout_s")
OPS_DEFAULT_FACTS = ("latency_p99_ms", "failover_region", "pager")


@dataclass(frozen=True)
class OpsSpec:
    """The randomized facts of one operations session."""

    project: str  # the service name (the system message names it too: not a secret, not recalled)
    team: str
    primary_region: str
    failover_region: str
    port: str
    latency_p99_ms: str
    error_rate_pct: str
    saturation_pct: str
    pager: str
    incident_code: str
    drain_timeout_s: str
    cooldown_s: str
    min_replicas: str
    window: str

    def secrets(self) -> list[str]:
        """Strings that identify this session's facts: they may appear only in the definition messages."""
        return [self.team, self.primary_region, self.failover_region, self.pager, self.incident_code,
                self.latency_p99_ms, self.error_rate_pct, self.saturation_pct, self.port]


def _region_name(rng: random.Random) -> str:
    return f"{rng.choice(_AREAS)}-{rng.choice(_DIRECTIONS)}-{rng.randint(1, 9)}"


def make_ops_spec(seed: int) -> OpsSpec:
    """Draw every name and value of an operations session from `seed` (same seed, same spec)."""
    rng = random.Random(f"longsession-ops:{seed}")
    w_service, w_team, w_pager = (w.lower() for w in rng.sample(_WORDS, 3))
    primary = _region_name(rng)
    failover = _region_name(rng)
    while failover == primary:
        failover = _region_name(rng)
    drain = rng.randrange(15, 240, 5)
    cooldown = rng.choice([c for c in range(30, 600, 15) if c != drain])
    return OpsSpec(
        project=f"{w_service}-{rng.choice(_SUFFIXES)}",
        team=f"team-{w_team}",
        primary_region=primary,
        failover_region=failover,
        port=str(rng.randint(7001, 9899)),
        latency_p99_ms=str(rng.choice([v for v in range(210, 2990) if v % 10])),
        error_rate_pct=f"{rng.randint(1, 9)}.{rng.randint(1, 9)}",
        saturation_pct=str(rng.randint(71, 96)),
        pager=f"@{w_pager}-oncall",
        incident_code=f"INC-{rng.randint(1000, 9999)}",
        drain_timeout_s=str(drain),
        cooldown_s=str(cooldown),
        min_replicas=str(rng.randint(2, 7)),
        window=f"{rng.choice(_WEEKDAYS)} {rng.randint(0, 23):02d}:{rng.choice(('00', '15', '30', '45'))} UTC",
    )


def ops_system_message_text(s: OpsSpec) -> str:
    return (f"You are a careful site-reliability assistant on call for the {s.project} service. The user shares its "
            "configuration, runbooks and reference notes over a long session; follow the configuration exactly.")


def _inventory_step(s: OpsSpec) -> Definition:
    lines = {"primary_region": f'primary_region: "{s.primary_region}"',
             "failover_region": f'failover_region: "{s.failover_region}"', "port": f"port: {s.port}"}
    block = (f'service: "{s.project}"\nowner: "{s.team}"\n{lines["primary_region"]}\n{lines["failover_region"]}\n'
             f"{lines['port']}\nmin_healthy_replicas: {s.min_replicas}\n")
    user = (f"I'm handing you the on-call rotation for {s.project} this week. First, the service inventory entry; "
            f"these names are what the tooling expects:\n\n```yaml\n{block}```\n\nTraffic is served from the primary "
            "region; the failover region only takes traffic during an incident.")
    regions = {k: _region(user, v) for k, v in lines.items()}
    regions["inventory"] = _region(user, block)
    return Definition(user, "Got it. I'll use that inventory entry exactly as written.", regions)


def _alerts_step(s: OpsSpec) -> Definition:
    lines = {"latency_p99_ms": f"latency_p99_ms: {s.latency_p99_ms}",
             "error_rate_pct": f"error_rate_pct: {s.error_rate_pct}",
             "saturation_pct": f"saturation_pct: {s.saturation_pct}", "pager": f'pager: "{s.pager}"',
             "incident_code": f'incident_code: "{s.incident_code}"'}
    block = (f"alerts:\n  {lines['latency_p99_ms']}\n  {lines['error_rate_pct']}\n  {lines['saturation_pct']}\n"
             f"{lines['pager']}\n{lines['incident_code']}\n")
    user = ("Next, the alert thresholds and paging config. They were agreed with the service owners, so keep the "
            f"numbers exact:\n\n```yaml\n{block}```")
    regions = {k: _region(user, v) for k, v in lines.items()}
    return Definition(user, "Understood. I'll keep those thresholds and the paging config exactly as given.", regions)


def _runbook_step(s: OpsSpec) -> Definition:
    lines = {"drain_timeout_s": f"drain_timeout_s: {s.drain_timeout_s}", "cooldown_s": f"cooldown_s: {s.cooldown_s}",
             "window": f'maintenance_window: "{s.window}"'}
    rule = ("- Failover: when latency_p99_ms or error_rate_pct is breached for five minutes, page the pager alias, "
            "open an incident under incident_code, drain the primary region for at most drain_timeout_s seconds, "
            "then shift traffic to the failover region; do not fail back before cooldown_s seconds have passed.")
    user = (f"Last piece: the failover runbook.\n\n```yaml\n{lines['drain_timeout_s']}\n{lines['cooldown_s']}\n"
            f"{lines['window']}\n```\n\n{rule}")
    regions = {k: _region(user, v) for k, v in lines.items()}
    regions["failover_rule"] = _region(user, rule)
    return Definition(user, "Clear. I'll run failovers exactly by that runbook.", regions)


def ops_definitions(spec: OpsSpec) -> list[Definition]:
    """The three definition steps, in session order."""
    return [_inventory_step(spec), _alerts_step(spec), _runbook_step(spec)]


_ASK = " Reply with just the line of YAML."
_OPS_FACT_PROBES = {
    # kind -> (question, answer prefix, needed regions, gold getter). The prefix runs up to the value's first
    # character (the space after a YAML colon, the opening quote of a string), so the greedy answer cannot drift
    # into prose: a prefix ending at the colon is continued with a newline as often as with the value.
    "latency_p99_ms": ("Quick check before we tune the dashboards: what p99 latency threshold did we set?" + _ASK,
                       "latency_p99_ms: ", ["latency_p99_ms"], lambda s: s.latency_p99_ms),
    "error_rate_pct": ("What error-rate threshold did we set?" + _ASK, "error_rate_pct: ", ["error_rate_pct"],
                       lambda s: s.error_rate_pct),
    "failover_region": ("Which region do we fail over to?" + _ASK, 'failover_region: "', ["failover_region"],
                        lambda s: s.failover_region),
    "primary_region": ("Which region serves traffic normally?" + _ASK, 'primary_region: "', ["primary_region"],
                       lambda s: s.primary_region),
    "pager": ("Which alias do we page for this service?" + _ASK, 'pager: "', ["pager"], lambda s: s.pager),
    "incident_code": ("Under which incident code do we open incidents?" + _ASK, 'incident_code: "',
                      ["incident_code"], lambda s: s.incident_code),
    "drain_timeout_s": ("How long may a drain take at most?" + _ASK, "drain_timeout_s: ", ["drain_timeout_s"],
                        lambda s: s.drain_timeout_s),
}
_OPS_REGIONS = ["inventory", "primary_region", "failover_region", "port", "latency_p99_ms", "error_rate_pct",
                "saturation_pct", "pager", "incident_code", "drain_timeout_s", "cooldown_s", "window", "failover_rule"]


def ops_probes(spec: OpsSpec, facts: tuple[str, ...] = OPS_DEFAULT_FACTS) -> list[ProbeDraft]:
    """Fact probes in the order asked, then one recall probe (the domain has no code probes)."""
    out = probes_from_table(_OPS_FACT_PROBES, spec, facts, what="operations fact")
    question = ("Before the handover, recap from memory everything we fixed at the start of this session: the "
                "owning team, both regions, the port, every alert threshold, the pager alias, the incident "
                "code, and the runbook's timeouts.")
    required = [spec.team, spec.primary_region, spec.failover_region, spec.port, spec.latency_p99_ms,
                spec.error_rate_pct, spec.saturation_pct, spec.pager, spec.incident_code, spec.drain_timeout_s,
                spec.cooldown_s]
    out.append(ProbeDraft("recall", "recall", question, list(_OPS_REGIONS), required=required))
    return out


def ops_facts(spec: OpsSpec) -> dict[str, str]:
    return dict(vars(spec))
