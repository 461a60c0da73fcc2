"""The `ops` environment: a data / operations agent answering questions about a fleet of services.

The agent lists services, reads metrics and log counts, walks deploy histories and alerts (`ops_world` holds the
world and the tools' response formats). Three task families with different dependency shapes:

- `filter` (fan-out + criterion): "among team T's services in region G whose METRIC is above X, which logged the
  most errors?" The service list is read again while a listed service is untouched; a metric response is read again
  (at the final answer) exactly when its value meets the criterion, and so is that service's log count. The agent's
  order varies per trace (metric then logs per service, logs then metric, logs only for services that pass, or all
  metrics first), so what call comes next says little.
- `incident` (chains): "alerts A and B fired; each one's cause is its service's last deploy before it fired; which
  cause went out first? Give its version." alert → deploy list → deploy detail, two or three times. The alert is read
  until its cause is open, the list until its cause is open; the cause's detail (which shares no word with the task)
  is read at the end; other deploys of the same service (a detour) are not. The question may ask to restate the
  alerts' firing times or the services' deploy counts, which keeps those responses until the end.
- `regional` (running extreme): "in which region is service S's METRIC highest?" The record is read while a region is
  untouched; each region's metric is read again while it is among the current extremes the question asks for
  (highest, lowest, both, or the top two), all of them naming the task's service.

After every response the agent's note is `grammar.note` (a restatement of the response, a neutral acknowledgement or
a random relevance claim, by a per-trace `NoteStyle`), often followed by a phrasing of its next call: nothing it
writes says whether the response meets the criterion, is the cause or leads. Detours (`detour_rate`) add calls of
the same tools with a wrong window, metric or level, a deploy of the right service that is not the cause, or a look
at the alerting service's record.

Cues (`Trace.cues`, one per response; when the script reads it again):

| cue | response | read again |
|---|---|---|
| `service_list` | list_services | while a listed service has no call yet |
| `metric_pass` / `metric_fail` | the criterion metric of a listed service | pass: at the final answer; fail: never |
| `logs_pass` / `logs_fail` | the asked log count of a listed service | pass: at the final answer; fail: never |
| `wrong_query` | a metric / log call with the wrong window, metric or level | never |
| `service_record` | get_service | while a region of the service has no call yet |
| `region_kept` / `region_beaten` | a region's metric | while among the current extremes; kept: at the final |
| `alert` / `alert_recap` | get_alert | until its cause is open; recap: also at the final |
| `deploy_list` / `deploy_list_recap` | get_deploys | until its cause is open; recap: also at the final |
| `cause_deploy` / `other_deploy` | get_deploy | cause: at the final; other: never |
| `side_lookup` | get_service during an incident (on-call, tier) | never |
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from kvsteward.synth.rng import mix
from kvsteward.synth.traces.envs.base import Recorder
from kvsteward.synth.traces.envs.ops_world import (
    CHANGES,
    LEVELS,
    METRICS,
    SUFFIXES,
    WINDOWS,
    Alert,
    Deploy,
    Metric,
    World,
    build_worlds,
    clock,
    render_alert,
    render_deploy,
    render_deploys,
    render_list,
    render_logs,
    render_metric,
    render_service,
    top_message,
    version,
)
from kvsteward.synth.traces.generate import split_of
from kvsteward.synth.traces.grammar import NoteStyle, join, note, say
from kvsteward.synth.traces.trace import Trace

__all__ = ["CUES", "FAMILIES", "Options", "SYSTEM_PROMPT", "generate"]

ENV = "ops"
FAMILIES = ("filter", "incident", "regional")
CUES = ("service_list", "metric_pass", "metric_fail", "logs_pass", "logs_fail", "wrong_query", "service_record",
        "region_kept", "region_beaten", "alert", "alert_recap", "deploy_list", "deploy_list_recap", "cause_deploy",
        "other_deploy", "side_lookup")
MAX_RESPONSES = 14
REGIONAL_MIN = 5  # fewest regions of a regional task's service (6 responses with the record)

SYSTEM_PROMPT = (
    "You are an operations agent; answer from tool data only.\n"
    "Tools: list_services(region, team); get_service(service); get_metrics(service, region, metric, window) with "
    "metric p95_ms, cpu_pct or mem_pct and window 1h, 6h or 24h; query_logs(service, region, level, window) with "
    "level error or warn; get_deploys(service); get_deploy(deploy_id); get_alert(alert_id).\n"
    "Call a tool by ending your turn with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>; each "
    "result starts with [cursor N]. End with a line 'Final answer: ...'."
)


@dataclass
class Options:
    """The ops generator's knobs (`steward synth traces --env ops -o KEY=VALUE`); every field has a default."""

    detour_rate: float = 0.35  # per deploy chain: a deploy that is not the cause; per metric / logs call: half
    min_items: int = 3  # fewest services in a filter task's list
    max_items: int = 5  # most services in a filter task's list
    three_alert_rate: float = 0.25  # share of incident tasks with three alerts (else two)
    families: str = ",".join(FAMILIES)  # comma-separated subset of FAMILIES
    services_per_team: int = 9  # services per team in each split's world

    def family_list(self) -> list[str]:
        return [f.strip() for f in self.families.split(",") if f.strip()]

    def validate(self) -> None:
        for name in ("detour_rate", "three_alert_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 3 <= self.min_items <= self.max_items <= 6:
            raise ValueError(f"min_items / max_items must satisfy 3 <= min_items <= max_items <= 6, got "
                             f"{self.min_items}..{self.max_items}")
        fams = self.family_list()
        if not fams or any(f not in FAMILIES for f in fams):
            raise ValueError(f"families must be a comma-separated subset of {', '.join(FAMILIES)}, got "
                             f"{self.families!r}")
        if not 6 <= self.services_per_team <= 40:
            raise ValueError(f"services_per_team must be in 6..40, got {self.services_per_team}")


# --- phrasings ---------------------------------------------------------------------------------------------------

METRIC_WORDS = {"p95_ms": ("p95 latency", "p95", "95th-percentile latency"),
                "cpu_pct": ("CPU", "CPU usage", "CPU load"),
                "mem_pct": ("memory use", "memory", "memory usage")}
WINDOW_WORDS = {"1h": ("the last hour", "the past hour", "the last 60 minutes"),
                "6h": ("the last 6 hours", "the past six hours", "the last six hours"),
                "24h": ("the last 24 hours", "the past day", "the last day")}
LEVEL_WORDS = {"error": ("errors", "error lines"), "warn": ("warnings", "warning lines")}
CMP_WORDS = {True: ("above", "over", "higher than"), False: ("below", "under", "lower than")}
ORDER_WORDS = {True: ("went out first", "was deployed earliest", "is the oldest"),
               False: ("went out last", "was deployed most recently", "is the newest")}

ACTIONS = {
    "list_services": ("Listing the {team} services in {region}.", "What does {team} run in {region}?",
                      "Let me pull the {team} service list for {region}.", "I'll list {region}'s {team} services.",
                      "The service list for team {team} in {region} comes first."),
    "get_metrics": ("Now {svc}, {metric}.", "{metric} of {svc} next.", "Checking {svc} in {region}.",
                    "Next: {svc} over {window}.", "Let me get {svc}'s {metric}.", "Pulling {metric} for {svc}."),
    "query_logs": ("Now {svc}'s {level} logs.", "{level} logs of {svc} next.", "Counting {svc}'s {level} lines.",
                   "Next: {svc} logs over {window}.", "Let me query {svc}'s logs.", "Pulling {level} logs for {svc}."),
    "get_service": ("Looking up {svc}'s record.", "Where does {svc} run?", "Let me get the service record of {svc}.",
                    "I'll fetch {svc} to see its regions.", "The record of {svc} lists its regions."),
    "get_deploys": ("Now the deploys of {svc}.", "Listing today's deploys on {svc}.", "Next: deploy history for "
                    "{svc}.", "Let me see what was deployed to {svc} today.", "Pulling {svc}'s deploys."),
    "get_deploy": ("Opening {dep}.", "Let me look at {dep}.", "Fetching deploy {dep}.", "Details of {dep} next.",
                   "Checking {dep}.", "Now {dep}."),
    "get_alert": ("Looking up {alert}.", "Let me open {alert}.", "Fetching alert {alert}.", "Next, alert {alert}.",
                  "Now {alert}.", "Checking alert {alert}."),
}
INFOS = {
    "list_services": ("{n} services: {names}.", "The list: {names}.", "{team} runs {names} in {region}.",
                      "So {n} to check: {names}.", "Got {names}."),
    "get_metrics": ("{what}: {metric} {value}.", "{what} is at {value}.", "{metric} of {what}: {value}.",
                    "Got {value} for {what}.", "{what} reads {value}.", "{value} on {what} over {window}."),
    "query_logs": ("{svc} logged {count} {level} lines.", "{count} {level} lines for {svc}; top is '{top}'.",
                   "{svc}: {count} at level {level} over {window}.", "Logs for {svc}: {count} lines.",
                   "{count} {level} lines on {svc}."),
    "get_service": ("{svc} runs in {n} regions: {regions}.", "Regions of {svc}: {regions}.",
                    "{svc} is deployed in {regions}.", "{n} regions: {regions}.", "{svc} ({team}) covers {regions}."),
    "get_deploys": ("{svc} had {n} deploys today.", "{n} deploys on {svc}, {first} to {last}.",
                    "Deploys of {svc}: {ids}.", "{svc}'s deploys run from {first} to {last}.",
                    "Got {n} deploys for {svc}."),
    "get_deploy": ("{dep} is version {ver}, out {time} by {author}.", "{dep}: {ver} at {time}.",
                   "{dep} shipped {ver} to {svc} at {time}.", "Version {ver} ({dep}), {time}, {author}.",
                   "{dep} went out at {time} as {ver}."),
    "get_alert": ("{alert} is on {svc}, fired {time}.", "{alert}: {svc} @ {region}, {time}.",
                  "{alert} fired at {time} on {svc}.", "{svc} raised {alert} at {time} ({metric}).",
                  "{alert}: {metric} over {limit} on {svc} since {time}."),
}

FILTER_QUESTIONS = (
    "Among the {team} services in {region}, which one with {metric} {cmp} {thr} logged the {rank} {levels} in "
    "{window}?",
    "In {region}, look at the {team} team's services. Of those whose {metric} over {window} is {cmp} {thr}, which "
    "had the {rank} {levels}?",
    "Which {team} service in {region} has the {rank} {levels} in {window}, counting only services with {metric} "
    "{cmp} {thr}?",
    "Consider {team}'s services in {region} with {metric} {cmp} {thr} during {window}. Which of them logged the "
    "{rank} {levels}?",
    "For team {team} in {region}: among services whose {metric} was {cmp} {thr} in {window}, name the one with the "
    "{rank} {levels}.",
    "I need the {team} service in {region} that logged the {rank} {levels} in {window}, but only among those with "
    "{metric} {cmp} {thr}.",
)
FILTER_FINALS = (
    "Services with {metric} {cmp} {thr}: {figures}. {winner} has the {rank} {levels}.",
    "{winner} logged the {rank} {levels} among those {cmp} {thr} ({figures}).",
    "Qualifying: {figures}. The {rank} {levels}: {winner}.",
    "Of {figures}, {winner} comes out with the {rank} {levels}.",
    "{cmp_cap} {thr} on {metric}: {figures}. So {winner}.",
)
INCIDENT_QUESTIONS = (
    "Alerts {alerts} fired today. Take each alert's cause to be the last deploy of its service before it fired. "
    "Which of those deploys {order}? Give its version.",
    "For each of {alerts}, find the deploy on the alerting service that most recently preceded the alert. Of these, "
    "which one {order}? Answer with its version.",
    "{alerts} went off today. The likely culprit for each is its service's last deploy before the alert. Which "
    "culprit {order}? I want its version.",
    "We had alerts {alerts}. Blame each on the latest deploy of its service before it fired. Which blamed deploy "
    "{order}? Report its version.",
    "Check alerts {alerts}: for each, the causing deploy is the service's last one before the alert. Which causing "
    "deploy {order}? Give the version.",
)
RECAP_ALERTS = ("Also say at what time each alert fired.", "Include each alert's time.",
                "Quote the time of every alert too.", "Mention what time each alert went off.",
                "Give the alert times as well.")
RECAP_COUNTS = ("Also say how many deploys each service had today.", "Include each service's deploy count.",
                "Mention how many deploys every service got today.", "Give the deploy count per service too.",
                "Say how many deploys each of those services had.")
INCIDENT_FINALS = (
    "{chains}. {chosen} {order}.",
    "Causes: {chains}. The one that {order} is {chosen}.",
    "{chains}; so {chosen} {order}.",
    "Per alert: {chains}. {chosen} is the deploy that {order}.",
    "Looking at the causes ({chains}), {chosen} {order}.",
)
REGIONAL_QUESTIONS = {
    "max": ("In which region is {svc}'s {metric} highest over {window}?",
            "Where does {svc} show its highest {metric} in {window}?",
            "Across its regions, where was {svc}'s {metric} highest during {window}?",
            "{svc} runs in several regions; which one has the highest {metric} over {window}?",
            "Find the region where {svc} had its highest {metric} in {window}."),
    "min": ("In which region is {svc}'s {metric} lowest over {window}?",
            "Where does {svc} show its lowest {metric} in {window}?",
            "Across its regions, where was {svc}'s {metric} lowest during {window}?",
            "{svc} runs in several regions; which one has the lowest {metric} over {window}?",
            "Find the region where {svc} had its lowest {metric} in {window}."),
}
REGIONAL_EXTRA = {
    "maxmin": ("Also give the lowest region's figure for comparison.", "Quote the lowest region's value too.",
               "Compare it with the region where it is lowest.", "Give the lowest region and its value as well.",
               "Include the lowest one for contrast."),
    "top2": ("Also quote the runner-up's figure.", "Give the runner-up region's value too.",
             "Compare it with the runner-up.", "Include the runner-up and its value.",
             "Name the runner-up as well, with its value."),
}
REGIONAL_FINALS = {
    "max": ("{svc}'s {metric} over {window} peaks in {a} at {va}.", "Highest: {a} with {va}.",
            "{a} is the highest at {va}.", "The top region is {a} ({va}).", "{svc} is highest in {a}: {va}."),
    "min": ("{svc}'s {metric} over {window} is lowest in {a} at {va}.", "Lowest: {a} with {va}.",
            "{a} is the lowest at {va}.", "The lowest region is {a} ({va}).", "{svc} is lowest in {a}: {va}."),
    "maxmin": ("Highest in {a} ({va}), lowest in {b} ({vb}).", "{a} tops at {va}; {b} is lowest at {vb}.",
               "{svc} peaks in {a} at {va} and bottoms out in {b} at {vb}.", "{a}: {va} (highest); {b}: {vb}.",
               "Range: {b} {vb} up to {a} {va}."),
    "top2": ("Highest in {a} ({va}), runner-up {b} ({vb}).", "{a} leads at {va}, then {b} at {vb}.",
             "{svc} is highest in {a}: {va}; {b} follows with {vb}.", "Top two: {a} {va}, {b} {vb}.",
             "{a} ({va}) ahead of {b} ({vb})."),
}
PLANS = ("", "", "Let me work through this.", "I'll gather the data first.", "Step by step.", "Let me check.",
         "I'll look it up.")


# --- the agent -----------------------------------------------------------------------------------------------

@dataclass
class Done:
    """What a family returns besides the messages: the task's fields."""

    question: str
    answer: str
    kind: str
    hops: int


@dataclass
class Agent:
    """One trace being written: the recorder, the trace's note style, and the note owed on the last response.

    Every step reads the response right before it (ReAct) on top of what the script says it uses."""

    r: random.Random
    world: World
    rec: Recorder = field(default_factory=lambda: Recorder(SYSTEM_PROMPT))
    style: NoteStyle = field(init=False)
    owed: str | None = None  # informative note on the last response, said (or not) at the next step
    last: int | None = None

    def __post_init__(self) -> None:
        self.style = NoteStyle.draw(self.r)

    def _text(self, action: str) -> str:
        said = note(self.r, self.owed, self.style) if self.owed is not None else self.r.choice(PLANS)
        return join(said, action)

    def _reads(self, reads: set[int] | frozenset) -> set[int]:
        return set(reads) | ({self.last} if self.last is not None else set())

    def call(self, name: str, args: dict, body: str, cue: str, info: str, reads: set[int] | frozenset = frozenset(),
             **slots: str) -> int:
        """One step: note on the last response + a phrasing of this call; the response; its informative note."""
        action = say(self.r, ACTIONS[name], **slots) if self.owed is None or self.r.random() < 0.6 else ""
        self.last = self.rec.call(self._text(action), self._reads(reads), name, args, body, cue)
        self.owed = info
        return self.last

    def finish(self, statement: str, answer: str, reads: set[int]) -> None:
        self.rec.assistant(f"{self._text(statement)}\nFinal answer: {answer}", self._reads(reads))


def _info(r: random.Random, name: str, **slots: object) -> str:
    return say(r, INFOS[name], **slots)


# --- family: filter ----------------------------------------------------------------------------------------------

def _split_values(r: random.Random, m: Metric, n_pass: int, n_fail: int, above: bool) -> tuple[int, list, list]:
    """A threshold and distinct values on either side of it (passing ones first), close enough that the leading
    digits of a value do not give its side away."""
    span = m.high - m.low
    step = 10 if m.key == "p95_ms" else 5
    t = r.randrange(m.low + span // 4, m.high - span // 4) // step * step
    up = r.sample(range(t + 1, min(m.high, t + span // 2) + 1), n_pass if above else n_fail)
    down = r.sample(range(max(m.low, t - span // 2), t), n_fail if above else n_pass)
    return (t, up, down) if above else (t, down, up)


@dataclass
class _FilterTask:
    """The scenario of a filter task and the queries its agent makes."""

    region: str
    metric: Metric
    window: str
    level: str
    values: dict[str, int]
    counts: dict[str, int]
    passing: set[str]

    def metric_query(self, r: random.Random, svc: str, wrong: bool) -> tuple[dict, str, str]:
        """(arguments, response, the value as shown) of a metric call; `wrong`: another window or metric."""
        metric, window = self.metric.key, self.window
        if wrong and r.random() < 0.6:
            window = r.choice([w for w in WINDOWS if w != self.window])
        elif wrong:
            metric = r.choice([k for k in METRICS if k != self.metric.key])
        m = METRICS[metric]
        value = self.values[svc] if not wrong else r.randint(m.low, m.high)
        args = {"service": svc, "region": self.region, "metric": metric, "window": window}
        return args, render_metric(r, svc, self.region, metric, window, value), m.show(value)

    def logs_query(self, r: random.Random, svc: str, wrong: bool, dep: str) -> tuple[dict, str, int, str]:
        """(arguments, response, count, top message) of a log call; `wrong`: another window or level."""
        level, window = self.level, self.window
        if wrong and r.random() < 0.5:
            window = r.choice([w for w in WINDOWS if w != self.window])
        elif wrong:
            level = next(x for x in LEVELS if x != self.level)
        count = self.counts[svc] if not wrong else r.randint(3, 900)
        args = {"service": svc, "region": self.region, "level": level, "window": window}
        top = top_message(r, level, dep)
        return args, render_logs(svc, self.region, level, window, count, top,
                                 max(1, count * r.randint(10, 60) // 100)), count, top


def filter_family(ag: Agent, opts: Options) -> Done:
    r, w = ag.r, ag.world
    n = r.randint(opts.min_items, opts.max_items)  # list length drawn first: the world's lists skew long
    team, region = r.choice(w.lists(n, n) or w.lists(opts.min_items, opts.max_items))
    services = w.team_region(team, region)
    r.shuffle(services)
    names = [s.name for s in services]
    n = len(names)
    metric, window, level = METRICS[r.choice(list(METRICS))], r.choice(WINDOWS), r.choice(LEVELS)
    above, most = r.random() < 0.5, r.random() < 0.6
    n_pass = r.randint(1, (n + 1) // 2)
    thr, pass_v, fail_v = _split_values(r, metric, n_pass, n - n_pass, above)
    pass_names = r.sample(names, n_pass)
    fail_names = [s for s in names if s not in pass_names]
    values = dict(zip(pass_names + fail_names, pass_v + fail_v, strict=True))
    counts = dict(zip(names, r.sample(range(3, 900), n), strict=True))
    task = _FilterTask(region, metric, window, level, values, counts, set(pass_names))
    passing = [s for s in names if s in task.passing]
    winner = (max if most else min)(passing, key=counts.__getitem__)
    slots = {"team": team, "region": region, "metric": r.choice(METRIC_WORDS[metric.key]),
             "cmp": r.choice(CMP_WORDS[above]), "thr": metric.show(thr), "rank": "most" if most else "fewest",
             "levels": r.choice(LEVEL_WORDS[level]), "window": r.choice(WINDOW_WORDS[window])}
    ag.rec.user(say(r, FILTER_QUESTIONS, **slots))

    mode = r.choice(("sweep", "sweep", "logs_first", "gated", "batch", "batch"))
    if 1 + n + n_pass < 6 and mode in ("gated", "batch"):  # keep six responses at least
        mode = "sweep"
    base = 1 + (2 * n if mode in ("sweep", "logs_first") else n + n_pass)
    budget = MAX_RESPONSES - base
    lst = ag.call("list_services", {"region": region, "team": team}, render_list(region, team, services),
                  "service_list", _info(r, "list_services", n=n, names=", ".join(names), team=team, region=region),
                  team=team, region=region)
    mets: dict[str, int] = {}
    logs: dict[str, int] = {}

    def detour() -> bool:
        nonlocal budget
        if budget > 0 and r.random() < opts.detour_rate / 2:
            budget -= 1
            return True
        return False

    def fetch_metric(svc: str, reads: set[int], may_detour: bool = True) -> None:
        """The criterion metric of `svc`, maybe after a wrong one. Not after its logs (`may_detour` False): the logs
        would then wait, read, on a value not yet shown, and a reader could not tell whether they are needed."""
        for wrong in (True, False) if may_detour and detour() else (False,):
            args, body, value = task.metric_query(r, svc, wrong)
            cue = "wrong_query" if wrong else ("metric_pass" if svc in task.passing else "metric_fail")
            info = _info(r, "get_metrics", what=svc, metric=args["metric"], value=value, window=args["window"])
            c = ag.call("get_metrics", args, body, cue, info, reads, svc=svc, metric=args["metric"], region=region,
                        window=args["window"])
            reads = set()
        mets[svc] = c

    def fetch_logs(svc: str, reads: set[int]) -> None:
        for wrong in (True, False) if detour() else (False,):
            args, body, count, top = task.logs_query(r, svc, wrong, r.choice(w.upstreams))
            cue = "wrong_query" if wrong else ("logs_pass" if svc in task.passing else "logs_fail")
            info = _info(r, "query_logs", svc=svc, count=count, level=args["level"], window=args["window"],
                         top=top)
            c = ag.call("query_logs", args, body, cue, info, reads, svc=svc, level=args["level"], region=region,
                        window=args["window"])
            reads = set()
        logs[svc] = c

    for svc in names:
        if mode == "logs_first":
            fetch_logs(svc, {lst})
            fetch_metric(svc, set(), may_detour=False)
            continue
        fetch_metric(svc, {lst})
        if mode == "sweep" or (mode == "gated" and svc in task.passing):
            fetch_logs(svc, set())
    if mode == "batch":
        for svc in passing:
            fetch_logs(svc, {mets[svc]})

    order = sorted(passing, key=counts.__getitem__, reverse=most) if r.random() < 0.5 else passing
    level_word = r.choice(LEVEL_WORDS[level])
    figures = "; ".join(f"{s} {metric.show(values[s])}, {counts[s]} {level_word}" for s in order)
    statement = say(r, FILTER_FINALS, **slots, figures=figures, winner=winner,
                    cmp_cap=slots["cmp"][0].upper() + slots["cmp"][1:])
    ag.finish(statement, winner, {mets[s] for s in passing} | {logs[s] for s in passing})
    return Done(ag.rec.messages[1]["content"], winner, "filter", 1 + n + n_pass)


# --- family: incident --------------------------------------------------------------------------------------------

@dataclass
class _Chain:
    """One alert, the deploys of its service today and which of them caused it."""

    alert: Alert
    deploys: list[Deploy]
    cause: Deploy


def _chain(r: random.Random, w: World, svc_name: str, alert_id: str, ids: list[str], used: set[int]) -> _Chain:
    """An alert on `svc_name` and 3-5 deploys of it today: 2-3 before the alert (the last of them is the cause),
    1-2 after. `ids` gives one more id than deploys (the previous deploy of the earliest one, from yesterday);
    `used` holds the causes' minutes of earlier chains, so that no two causes share a minute."""
    svc = next(s for s in w.services if s.name == svc_name)
    at = r.randint(8 * 60, 21 * 60)
    n_before, n_after = r.randint(2, 3), r.randint(1, 2)
    before = sorted(r.sample([m for m in range(at - 300, at - 4) if m not in used], n_before))
    after = sorted(r.sample(range(at + 3, min(at + 240, 24 * 60 - 1)), n_after))
    used.add(before[-1])
    deploys, prev = [], ids[-1]
    for k, minute in enumerate(before + after):
        change = r.choice(CHANGES).format(n=r.randint(2, 9))
        deploys.append(Deploy(ids[k], svc.name, minute, r.choice(w.people), version(r), change, prev))
        prev = ids[k]
    metric = r.choice(list(METRICS))
    m = METRICS[metric]
    alert = Alert(alert_id, svc.name, r.choice(svc.regions), at, metric, r.randint(m.low + 20, m.high - 5) // 5 * 5,
                  r.randint(1, 3))
    return _Chain(alert, deploys, deploys[n_before - 1])


def _deploy_info(r: random.Random, d: Deploy) -> str:
    return _info(r, "get_deploy", dep=d.id, ver=d.version, time=clock(d.minute), author=d.author, svc=d.service)


@dataclass
class _Incident:
    """An incident task being walked: which responses hold each alert, deploy list and cause."""

    ag: Agent
    opts: Options
    recap_alerts: bool
    recap_counts: bool
    alerts: dict[str, int] = field(default_factory=dict)
    lists: dict[str, int] = field(default_factory=dict)
    causes: dict[str, int] = field(default_factory=dict)
    budget: int = 0  # detours still allowed (MAX_RESPONSES less the needed calls)

    def spend(self, rate: float) -> bool:
        """Whether to take a detour (at `rate`, while the response budget lasts)."""
        if self.budget > 0 and self.ag.r.random() < rate:
            self.budget -= 1
            return True
        return False

    def fetch_alert(self, c: _Chain) -> None:
        r, a = self.ag.r, c.alert
        info = _info(r, "get_alert", alert=a.id, svc=a.service, time=clock(a.minute), region=a.region,
                     metric=a.metric, limit=METRICS[a.metric].show(a.limit))
        self.alerts[a.id] = self.ag.call("get_alert", {"alert_id": a.id}, render_alert(a),
                                         "alert_recap" if self.recap_alerts else "alert", info, alert=a.id)

    def open_deploy(self, d: Deploy, cue: str, reads: set[int]) -> int:
        return self.ag.call("get_deploy", {"deploy_id": d.id}, render_deploy(d), cue, _deploy_info(self.ag.r, d),
                            reads, dep=d.id)

    def walk(self, c: _Chain) -> None:
        """get_deploys, then the cause; a detour opens another deploy of the service first (usually the newest, after
        the alert: it needs the list and the alert again) or after the cause (the `previous` one it names)."""
        ag, r, a = self.ag, self.ag.r, c.alert
        if self.spend(self.opts.detour_rate / 2):  # a side lookup: the service's record (on-call, tier)
            svc = next(s for s in ag.world.services if s.name == a.service)
            info = _info(r, "get_service", svc=svc.name, n=len(svc.regions), regions=", ".join(svc.regions),
                         team=svc.team)
            ag.call("get_service", {"service": svc.name}, render_service(svc), "side_lookup", info,
                    {self.alerts[a.id]}, svc=svc.name)
        mins = [d.minute for d in c.deploys]
        info = _info(r, "get_deploys", svc=a.service, n=len(c.deploys), first=clock(min(mins)), last=clock(max(mins)),
                     ids=", ".join(d.id for d in c.deploys))
        lst = ag.call("get_deploys", {"service": a.service}, render_deploys(a.service, c.deploys, r.random() < 0.6),
                      "deploy_list_recap" if self.recap_counts else "deploy_list", info, {self.alerts[a.id]},
                      svc=a.service)
        self.lists[a.id] = lst
        detour = r.choice(("before", "before", "after")) if self.spend(self.opts.detour_rate) else ""
        reads = {lst, self.alerts[a.id]}
        if detour == "before":
            others = [d for d in c.deploys if d is not c.cause]
            late = [d for d in others if d.minute > a.minute]
            self.open_deploy(late[-1] if r.random() < 0.6 else r.choice(others), "other_deploy", reads)
        self.causes[a.id] = self.open_deploy(c.cause, "cause_deploy", reads)
        if detour == "after":
            self.open_deploy(next(d for d in c.deploys if d.id == c.cause.previous), "other_deploy", set())

    def final_reads(self) -> set[int]:
        return set(self.causes.values()) | (set(self.alerts.values()) if self.recap_alerts else set()) | \
            (set(self.lists.values()) if self.recap_counts else set())


def incident_family(ag: Agent, opts: Options) -> Done:
    r, w = ag.r, ag.world
    k = 3 if r.random() < opts.three_alert_rate else 2
    svcs = r.sample([s.name for s in w.services], k)
    ids, alert_ids = w.ids(r, "dep", 7 * k), w.ids(r, "ALR", k)
    used: set[int] = set()
    chains = [_chain(r, w, s, a, ids[7 * j:7 * j + 7], used) for j, (s, a) in enumerate(zip(svcs, alert_ids,
                                                                                            strict=True))]
    first = r.random() < 0.5
    chosen = (min if first else max)(chains, key=lambda c: c.cause.minute).cause
    inc = _Incident(ag, opts, recap_alerts=r.random() < 0.25, recap_counts=r.random() < 0.3,
                    budget=MAX_RESPONSES - 3 * k)
    order_word = r.choice(ORDER_WORDS[first])
    listed = ", ".join(alert_ids[:-1]) + " and " + alert_ids[-1]
    question = join(say(r, INCIDENT_QUESTIONS, alerts=listed, order=order_word),
                    r.choice(RECAP_ALERTS) if inc.recap_alerts else "",
                    r.choice(RECAP_COUNTS) if inc.recap_counts else "")
    ag.rec.user(question)
    if r.random() < 0.3:  # every alert first, then each chain
        for c in chains:
            inc.fetch_alert(c)
        for c in chains:
            inc.walk(c)
    else:
        for c in chains:
            inc.fetch_alert(c)
            inc.walk(c)
    parts = []
    for c in chains:
        bits = [c.alert.service] + ([f"fired {clock(c.alert.minute)}"] if inc.recap_alerts else []) + \
            ([f"{len(c.deploys)} deploys today"] if inc.recap_counts else [])
        parts.append(f"{c.alert.id} ({', '.join(bits)}): {c.cause.id}, version {c.cause.version} at "
                     f"{clock(c.cause.minute)}")
    statement = say(r, INCIDENT_FINALS, chains="; ".join(parts), chosen=f"{chosen.id} ({chosen.version})",
                    order=order_word)
    ag.finish(statement, chosen.version, inc.final_reads())
    return Done(question, chosen.version, "incident", 3 * k)


# --- family: regional ------------------------------------------------------------------------------------------

def _extremes(values: dict[int, int], shape: str) -> set[int]:
    """The cursors a regional task keeps: the current highest / lowest / both / top two among `values`."""
    if not values:
        return set()
    ranked = sorted(values, key=values.__getitem__)
    return {"max": {ranked[-1]}, "min": {ranked[0]}, "maxmin": {ranked[0], ranked[-1]},
            "top2": set(ranked[-2:])}[shape]


def _region_query(r: random.Random, svc: str, region: str, metric: Metric, window: str, value: int,
                  wrong: bool) -> tuple[dict, str, Metric, str, int]:
    """(arguments, response, metric, window, value) of one region's metric call; `wrong`: another window / metric."""
    m, win = metric, window
    if wrong and r.random() < 0.5:
        win = r.choice([x for x in WINDOWS if x != window])
    elif wrong:
        m = METRICS[r.choice([k for k in METRICS if k != metric.key])]
    if wrong:
        value = r.randint(m.low, m.high)
    args = {"service": svc, "region": region, "metric": m.key, "window": win}
    return args, render_metric(r, svc, region, m.key, win, value), m, win, value


def regional_family(ag: Agent, opts: Options) -> Done:
    r, w = ag.r, ag.world
    svc = r.choice([s for s in w.services if len(s.regions) >= REGIONAL_MIN])
    metric, window = METRICS[r.choice(list(METRICS))], r.choice(WINDOWS)
    shape = r.choice(("max", "min", "max", "min", "maxmin", "top2"))
    regions = list(svc.regions)
    values = dict(zip(regions, r.sample(range(metric.low, metric.high + 1), len(regions)), strict=True))
    mword, wword = r.choice(METRIC_WORDS[metric.key]), r.choice(WINDOW_WORDS[window])
    question = join(say(r, REGIONAL_QUESTIONS["min" if shape == "min" else "max"], svc=svc.name, metric=mword,
                        window=wword), r.choice(REGIONAL_EXTRA[shape]) if shape in REGIONAL_EXTRA else "")
    ag.rec.user(question)
    info = _info(r, "get_service", svc=svc.name, n=len(regions), regions=", ".join(regions), team=svc.team)
    rec = ag.call("get_service", {"service": svc.name}, render_service(svc), "service_record", info, svc=svc.name)
    got: dict[int, int] = {}  # cursor → value, the right queries only
    where: dict[int, str] = {}
    compare: set[int] = set()  # the extremes before the latest region: the step after it compares against them
    budget = MAX_RESPONSES - 1 - len(regions)
    for g in regions:
        detour = budget > 0 and r.random() < opts.detour_rate / 2
        budget -= detour
        reads = {rec} | compare
        for wrong in (True, False) if detour else (False,):
            args, body, m, win, value = _region_query(r, svc.name, g, metric, window, values[g], wrong)
            info = _info(r, "get_metrics", what=g, metric=m.key, value=m.show(value), window=win)
            c = ag.call("get_metrics", args, body, "wrong_query" if wrong else "region_beaten", info, reads,
                        svc=svc.name, metric=m.key, region=g, window=win)
            reads = set()
        compare = _extremes(got, shape)
        got[c], where[c] = values[g], g
    kept = _extremes(got, shape)
    for c in kept:
        ag.rec.set_cue(c, "region_kept")
    hi, lo = max(kept, key=got.__getitem__), min(kept, key=got.__getitem__)
    a, b = (lo, hi) if shape == "min" else (hi, lo)
    slots = {"svc": svc.name, "metric": mword, "window": wword, "a": where[a], "va": metric.show(got[a]),
             "b": where[b], "vb": metric.show(got[b])}
    ag.finish(say(r, REGIONAL_FINALS[shape], **slots), where[a], kept | compare)
    return Done(question, where[a], "regional", 1 + len(regions))


FAMILY_SCRIPTS: dict[str, Callable[[Agent, Options], Done]] = {
    "filter": filter_family, "incident": incident_family, "regional": regional_family}

_SERVICE_RE = re.compile(r"\b[a-z]+-(?:" + "|".join(SUFFIXES) + r")\b")
_ID_RE = re.compile(r"\b(?:dep|ALR)-\d{4}\b")


def _names_shown(messages: list[dict], world: World) -> tuple[list[str], list[str]]:
    """(entity names, record ids) the trace shows, for split checks: every service / upstream / person of the world
    and every deploy / alert id that appears in any message."""
    text = "\n".join(m.get("content", "") for m in messages)
    known = {s.name for s in world.services} | set(world.upstreams)
    names = {n for n in _SERVICE_RE.findall(text) if n in known} | {p for p in world.people if p in text}
    return sorted(names), sorted(set(_ID_RE.findall(text)))


def generate(n_tasks: int, seed: int, options: Options, progress: Callable[[int], None] | None = None) -> list[Trace]:
    """`n_tasks` correct ops traces; task i: split `split_of(i)`, rng `rng(seed, "ops", i)`, a family drawn from
    `options.families`."""
    options.validate()
    worlds = build_worlds(seed, options.services_per_team)
    families = options.family_list()
    out = []
    for i in range(n_tasks):
        split, task_seed = split_of(i), mix(seed, ENV, i)
        r = random.Random(task_seed)
        ag = Agent(r, worlds[split])
        done = FAMILY_SCRIPTS[r.choice(families)](ag, options)
        entities, docs = _names_shown(ag.rec.messages, worlds[split])
        out.append(ag.rec.trace(task_id=f"s{seed}-{ENV}-t{i:05d}", split=split, task_seed=task_seed,
                                question=done.question, answer=done.answer, kind=done.kind, hops=done.hops,
                                entities=entities, docs=docs, env=ENV))
        if progress:
            progress(i + 1)
    return out
