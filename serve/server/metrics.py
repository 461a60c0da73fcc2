"""Prometheus metrics of the server (one registry per app, so several apps in one process never collide)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "kvsteward_"
        self.requests = Counter(p + "requests_total", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram(p + "request_latency_seconds", "Request latency (streams: until the last byte)",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.tokens_requested = Counter(p + "prefix_tokens_requested_total",
                                        "Prompt tokens of stateless requests (before the generation prompt)",
                                        registry=r)
        self.tokens_reused = Counter(p + "prefix_tokens_reused_total",
                                     "Prompt tokens served from a cached (tokens, ops) prefix state", registry=r)
        self.hit_rate = Gauge(p + "prefix_cache_hit_rate", "prefix_tokens_reused_total / prefix_tokens_requested_total",
                              registry=r)
        self.cache_states = Gauge(p + "prefix_cache_states", "States held by the prefix cache", registry=r)
        self.cache_bytes = Gauge(p + "prefix_cache_bytes", "Bytes allocated by the prefix cache's states", registry=r)
        self.cache_resident = Gauge(p + "prefix_cache_resident_tokens", "Resident KV tokens held by the prefix cache",
                                    registry=r)
        self.evictions = Counter(p + "prefix_cache_evictions_total", "States evicted from the prefix cache",
                                 registry=r)
        self.compatible_hits = Counter(p + "prefix_cache_compatible_hits_total",
                                       "Prefix-cache lookups served by a repositioned state restored by re-rotation",
                                       registry=r)
        self.session_resident = Gauge(p + "session_resident_tokens", "Resident KV tokens of loaded persistent sessions",
                                      registry=r)
        self.sessions_active = Gauge(p + "sessions_active", "Persistent sessions loaded in memory", registry=r)
        self.sessions_known = Gauge(p + "sessions_known", "Persistent sessions on disk", registry=r)
        self.session_unloads = Counter(p + "session_unloads_total", "Idle sessions unloaded to their log (LRU)",
                                       registry=r)
        self.persisted_turns = Counter(p + "persisted_turns_total", "Session turns written and fsynced", registry=r)
        self.rebuild_seconds = Histogram(p + "session_rebuild_seconds", "Time to rebuild a session from its log",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.generated_tokens = Counter(p + "generated_tokens_total", "Tokens generated", registry=r)
        # the aux memory-manager thread (SideQuest)
        self.aux_decisions = Counter(p + "aux_decisions_total", "Aux-thread decisions made (one per aux run)",
                                     registry=r)
        self.aux_deleted = Counter(p + "aux_deleted_cursors_total",
                                   "Cursors (tool messages) dropped by applied aux decisions", registry=r)
        self.aux_seconds = Histogram(p + "aux_seconds", "Wall time of one aux run (fork to decision, waits included)",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.aux_preemptions = Counter(p + "aux_preemptions_total",
                                       "Aux steps that waited for main work (the aux thread yielded)", registry=r)
        self.aux_errors = Counter(p + "aux_errors_total", "Aux runs that failed (the session got no decision)",
                                  registry=r)
        # storage tiers of idle sessions
        self.tier_stores = Counter(p + "tier_stores_total", "Session states written into a tier (unload or demotion)",
                                   ["tier"], registry=r)
        self.tier_restores = Counter(p + "tier_restores_total", "Sessions restored from a tier", ["tier"], registry=r)
        self.tier_restore_seconds = Histogram(p + "tier_restore_seconds", "Time to restore a session from a tier",
                                              ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.tier_bytes = Gauge(p + "tier_bytes", "Bytes of session states held by a tier (this process's view)",
                                ["tier"], registry=r)
        self.tier_stale = Counter(p + "tier_stale_total",
                                  "Tier copies discarded because they did not match the persisted history",
                                  registry=r)
        # tiered rehydration of planned spans (pace-tiered sessions)
        self.rehydrated_tokens = Counter(p + "rehydrated_tokens_total",
                                         "Evicted planned tokens brought back from the spill tier at their reader step",
                                         registry=r)
        self.rehydrate_seconds = Histogram(p + "rehydrate_seconds", "Time to fetch and re-insert one rehydration",
                                           ["tier"], buckets=(0.0005, 0.001, 0.0025) + LATENCY_BUCKETS, registry=r)
        self.spill_bytes = Gauge(p + "spill_bytes", "Bytes of evicted planned KV held in the spill tier", registry=r)
        self.aux_plan = SimpleNamespace(  # the learned planner (`--aux-plan`)
            decisions=Counter(p + "aux_plan_decisions_total", "Aux `Planning mode` runs that ended (valid or not)",
                              registry=r),
            parse_failures=Counter(p + "aux_plan_parse_failures_total",
                                   "Aux plans that were invalid or truncated (ignored, never applied)", registry=r),
            spans=Counter(p + "aux_plan_planned_spans_total", "Blueprint spans installed on sessions from aux plans",
                          registry=r))

    def reuse(self, requested: int, reused: int) -> None:
        self.tokens_requested.inc(requested)
        self.tokens_reused.inc(reused)
        total = self.tokens_requested._value.get()
        self.hit_rate.set(self.tokens_reused._value.get() / total if total else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
