"""The shared prefix cache: a trie keyed by the session config and the message-level op sequence (AKV §4.2).

A path from the root is a sequence of ops `("append", kind, tokens)` / `("drop", messages)` / `("reposition",)`
(see `kvsteward.serve.ops`); a node may hold the engine state reached by exactly that path. A request walks its own
op sequence, takes the deepest node holding a state, forks it (an independent copy) and applies only the rest, so
two requests share state exactly up to the first token or op that differs, and a drop in one request never changes
another's state (the cache only ever hands out copies).

Memory is bounded by the bytes the held states allocate: states that a held continuation has superseded through a
drop go first (their dropped KV serves only requests that do not drop), then least-recently-used ones; a state being
forked right now (pinned) never goes, and emptied nodes stay while they lead to other states so those remain findable.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kvsteward.serve.ops import Op


@dataclass(eq=False)
class _Node:
    key: Op | None = None
    parent: _Node | None = None
    children: dict = field(default_factory=dict)
    state: object | None = None  # a Session owned by the cache (never mutated after insertion)
    nbytes: int = 0
    last_used: float = 0.0
    pins: int = 0
    depth: int = 0  # ops from the root


def compact_copy(session):
    """A fork whose slot table holds exactly the resident slots (no spare capacity): what the cache stores."""
    copy = session.fork()
    t = copy.table
    n = t.n
    t.k = [k[:, :n].clone() for k in t.k]
    t.v = [v[:, :n].clone() for v in t.v]
    if t.ref_k is not None:
        t.ref_k = [r[:, :n].clone() for r in t.ref_k]
    t.meta = {name: m[:n].clone() for name, m in t.meta.items()}
    t.capacity = n
    return copy


class PrefixCache:
    def __init__(self, max_bytes: int, metrics=None):
        self.max_bytes = max_bytes
        self.metrics = metrics
        self._roots: dict[object, _Node] = {}
        self._lock = threading.Lock()
        self.bytes = 0
        self.states = 0
        self.resident_tokens = 0
        self.evictions = 0

    # -- lookup ---------------------------------------------------------------------------------------------------
    def lookup_fork(self, root_key, ops: list[Op]):
        """(fork of the deepest cached state on the path of `ops`, its depth) or (None, 0)."""
        with self._lock:
            node = self._roots.get(root_key)
            best, depth = None, 0
            for op in ops:
                if node is None:
                    break
                node = node.children.get(op)
                if node is not None and node.state is not None:
                    best = node
            if best is None:
                return None, 0
            best.pins += 1  # pinned: eviction skips it while the fork below runs outside the lock
            best.last_used = time.monotonic()
            state, depth = best.state, best.depth
        try:
            return state.fork(), depth
        finally:
            with self._lock:
                best.pins -= 1

    # -- insertion and eviction -----------------------------------------------------------------------------------
    def insert(self, root_key, ops: list[Op], session) -> bool:
        """Store a compact copy of `session` as the state reached by `ops`; False if it alone exceeds the budget."""
        with self._lock:
            node = self._path(root_key, ops, create=True)
            node.last_used = time.monotonic()
            if node.state is not None:  # same key = same state: keep the one held
                return True
        copy = compact_copy(session)
        nbytes = copy.table.allocated_bytes()
        if nbytes > self.max_bytes:
            return False
        with self._lock:
            node = self._path(root_key, ops, create=True)  # may have been pruned meanwhile
            if node.state is not None:
                return True
            node.state, node.nbytes, node.last_used = copy, nbytes, time.monotonic()
            self.bytes += nbytes
            self.states += 1
            self.resident_tokens += copy.resident
            self._evict_to_budget(keep=node)
            self._publish()
        return True

    def _path(self, root_key, ops: list[Op], create: bool) -> _Node | None:
        node = self._roots.get(root_key)
        if node is None:
            if not create:
                return None
            node = self._roots[root_key] = _Node()
        for op in ops:
            child = node.children.get(op)
            if child is None:
                if not create:
                    return None
                child = node.children[op] = _Node(key=op, parent=node, depth=node.depth + 1)
            node = child
        return node

    def _held(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.state is not None:
                yield node
            stack.extend(node.children.values())

    @staticmethod
    def _superseded_by_drop(node: _Node) -> bool:
        """True when a deeper held state continues from `node` through a drop: its KV still holds tokens that the
        live continuation no longer attends (AKV: dropped KV is freed before finished requests' KV)."""
        stack = [(child, child.key[0] == "drop") for child in node.children.values()]
        while stack:
            n, via_drop = stack.pop()
            if via_drop and n.state is not None:
                return True
            stack.extend((c, via_drop or c.key[0] == "drop") for c in n.children.values())
        return False

    def _evict_to_budget(self, keep: _Node) -> None:
        if self.bytes <= self.max_bytes:
            return
        # states a drop has superseded go first, then least recently used
        order = sorted(self._held(), key=lambda n: (not self._superseded_by_drop(n), n.last_used))
        for node in order:
            if self.bytes <= self.max_bytes:
                break
            if node is keep or node.pins:
                continue
            self._drop_state(node)
            self.evictions += 1
            if self.metrics is not None:
                self.metrics.evictions.inc()

    def _drop_state(self, node: _Node) -> None:
        self.bytes -= node.nbytes
        self.states -= 1
        self.resident_tokens -= node.state.resident
        node.state, node.nbytes = None, 0
        # prune empty leaves upward; inner empty nodes stay so the states below them remain findable
        while node.parent is not None and node.state is None and not node.children:
            parent = node.parent
            del parent.children[node.key]
            node = parent
        if node.parent is None and not node.children and node.state is None:
            for k, root in list(self._roots.items()):
                if root is node:
                    del self._roots[k]

    def clear(self) -> None:
        with self._lock:
            for node in list(self._held()):
                if not node.pins:
                    self._drop_state(node)
            self._publish()

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.cache_states.set(self.states)
            self.metrics.cache_bytes.set(self.bytes)
            self.metrics.cache_resident.set(self.resident_tokens)

    def node_count(self) -> int:
        with self._lock:
            count, stack = 0, list(self._roots.values())
            while stack:
                node = stack.pop()
                count += 1
                stack.extend(node.children.values())
            return count
