"""A session: one growing agent context whose KV lives in a SlotTable, changed only through recorded operations.

Operations (each appended to `history`, which is the state's identity — AKV Figure 5):
- `append(tokens)`: chunked prefill (chunk H); keys stored after RoPE at their physical position; the policy evicts
  to the budget B after every chunk, and after every decode token in `generate`.
- `drop(logical_indices)`: those tokens leave all future attention; everyone else keeps order, values, positions;
  the next position is not reduced.
- `reposition()`: survivors take positions 0..r-1 in logical order (K' = R(p') R(p)^-1 K, V unchanged); next at r.
- `refresh()`: the resident tokens are encoded afresh, in logical order at positions 0..r-1 (chunk H, no eviction):
  every K and V becomes what a new session holding only those tokens would compute; what evicted or dropped tokens
  had contributed to them is gone. Metadata (logical index, step, scores) is kept; next at r. With `refresh` set in
  the config (the `pace-refresh` arm), the session refreshes itself when a step that reads a planned span opens,
  unless every resident row is still fresh at 0..r-1 with the next position r (an untouched table since the last
  refresh: the refresh would compute the same K/V to rounding).
  With `refresh_tail` as well (`pace-refresh-tail`), it re-encodes only the rows past the fresh prefix: the leading
  resident rows that no eviction, drop or rehydration before them has touched since they were encoded are already what
  a new session computes (causal attention: a row's K/V depend only on the rows before it), so they stay.
- bounded positions (limit L): before a chunk would reach L, resident slots are renumbered the same way (`renumber`).
- tiered rehydration (a spill store, `serve/engine/spill.py`): evicted tokens of planned spans with a reader still
ahead are
  kept in a storage tier; when a step that reads a span opens, the policy first evicts to B − m (so resident never
  exceeds B), then the span's m evicted tokens come back (`rehydrate`) with the K/V and position they had when they
  left, and — bounded positions, or positions no longer in logical order after a reposition — the residents are
  renumbered.

Every operation validates its input first and either applies completely or raises leaving the session unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import weakref
from dataclasses import dataclass, field

import torch

from kvsteward.serve.engine.attention import ForwardContext, steward_attention_enabled
from kvsteward.serve.engine.blueprint import PlannedSpan
from kvsteward.serve.engine.policies import POLICIES, Policy, SlotView, select_keep
from kvsteward.serve.engine.slots import SlotTable
from kvsteward.serve.engine.spill import SpillStore, pack_rows

RESIDENT, DROPPED, EVICTED = 0, 1, 2


class CacheOpError(ValueError):
    """A cache operation refused because of bad input; the session is left exactly as it was."""


@dataclass
class SessionConfig:
    policy: Policy
    budget: int | None = None  # B: resident slots kept after each chunk (None = no eviction)
    chunk: int = 512  # H: prefill chunk
    limit: int | None = None  # L: bounded positions (None = unbounded)
    blueprint: list[PlannedSpan] = field(default_factory=list)
    use_adapter: bool = False  # run with the engine's LoRA adapter on (the aux thread); main threads run the base
    spill: SpillStore | None = None  # tiered rehydration of planned spans (None: evicted means gone)
    refresh: bool = False  # refresh the resident K/V when a step that reads a planned span opens (pace-refresh;
    # with no blueprint nothing is planned and it never refreshes, as pace without one is h2o with bounded positions)
    refresh_tail: bool = False  # those refreshes keep the fresh prefix and re-encode the rest (pace-refresh-tail)
    # those refreshes first drop every resident token outside the plan, its reader steps' messages and the first
    # message (the system prompt), so that the planned text sits right before the reader step (pace-refresh)
    refresh_plan_only: bool = False
    # each (layer, KV head) keeps its own top-B slots by its own attention scores (kvpress's per-head selection):
    # up to B slots per head, resident while any head keeps them; positions and re-rotation stay per slot
    per_head: bool = False
    # with per_head: the KV heads of a layer share one selection on their averaged scores (kvpress's per-layer
    # presses, e.g. TOVA): up to B slots per layer
    per_layer: bool = False

    def validate(self) -> None:
        if self.chunk < 1:
            raise CacheOpError(f"chunk must be >= 1, got {self.chunk}")
        if self.policy.evicts and self.budget is None:
            raise CacheOpError(f"policy {self.policy.name!r} evicts: it needs a budget")
        if self.budget is not None and self.budget < 1:
            raise CacheOpError(f"budget must be >= 1, got {self.budget}")
        if self.spill is not None and not self.policy.evicts:
            raise CacheOpError("a spill store needs an evicting policy: nothing is ever evicted to rehydrate")
        if self.per_layer and not self.per_head:
            raise CacheOpError("per-layer selection runs on the per-head table: give per_head=True as well")
        if self.per_head:
            if self.policy.score_mode == "none":
                raise CacheOpError(f"per-head selection needs a policy that scores by attention (h2o, snapkv, tova, "
                                   f"foresight); {self.policy.name!r} scores every head alike")
            if self.spill is not None or self.refresh:
                raise CacheOpError("per-head selection does not combine with spill tiers or refresh (they move "
                                   "whole slots; a head's hidden slots would come back to it)")
        if self.limit is not None:
            if not self.policy.evicts or self.budget is None:
                raise CacheOpError("bounded positions need an evicting policy with a budget (resident must stay < L)")
            if self.limit <= self.budget + self.chunk:
                raise CacheOpError(f"limit L={self.limit} must exceed budget + chunk = {self.budget} + "
                                   f"{self.chunk} = {self.budget + self.chunk}: renumbered residents plus one chunk "
                                   "must fit below L")


class _EngineCache:
    """The minimal cache protocol transformers' attention layers call: stage K/V, return resident + staged."""

    is_compileable = False

    def __init__(self, table: SlotTable):
        self.table = table

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        return self.table.write_kv(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.table.n


class Session:
    def __init__(self, engine, config: SessionConfig):
        config.validate()
        window = getattr(engine, "sliding_window", None)
        if window is not None and config.policy.evicts and config.budget + config.chunk > window:
            raise CacheOpError(_window_refusal(engine, f"budget + chunk = {config.budget} + {config.chunk}"))
        self.engine = engine
        self.config = config
        self.table = SlotTable(engine.n_layers, engine.n_kv_heads, engine.head_dim, engine.dtype, engine.device,
                               per_head=config.per_head)
        self.tokens: list[int] = []  # every logical token, in order
        self.status = bytearray()  # per logical token: RESIDENT / DROPPED / EVICTED
        self.history: list[dict] = []
        self.next_pos = 0
        self.n_messages = 0
        self.current_step = -1
        self.tool_steps: list[int] = []
        self.last_logits: torch.Tensor | None = None
        self.peak_resident = 0
        self.renumbers = 0
        self.refreshes = 0
        self.refresh_tokens = 0  # tokens re-encoded by refreshes (what they cost: a prefill of this many)
        # Leading resident rows whose K/V equal (to rounding) a new session's of those tokens at positions 0..k-1:
        # grown by appends to an untouched table, cut at the first row an eviction / drop / rehydration touches.
        self.fresh_rows = 0
        self.spilled: dict[int, str] = {}  # evicted planned logical index -> blob key in config.spill
        self._track_spill()

    def _track_spill(self) -> None:
        # The blobs this session points at lose its references when it is garbage-collected (forks share blobs).
        if self.config.spill is not None:
            weakref.finalize(self, _release_all, self.config.spill, self.spilled)

    # -- properties ---------------------------------------------------------------------------------------------
    @property
    def n_logical(self) -> int:
        return len(self.tokens)

    @property
    def resident(self) -> int:
        return self.table.n

    def resident_logical(self) -> torch.Tensor:
        return self.table.field("logical").clone()

    def resident_positions(self) -> torch.Tensor:
        return self.table.field("position").clone()

    def history_key(self) -> str:
        """Identity of the state: hash of the op history (not of the surviving tokens)."""
        return hashlib.sha256(json.dumps(self.history, separators=(",", ":")).encode()).hexdigest()

    # -- operations ---------------------------------------------------------------------------------------------
    def append(self, tokens: list[int], kind: str = "user", continue_message: bool = False,
               logits: str = "last") -> torch.Tensor | None:
        """Append tokens as a new message (step) or as a continuation of the current one.

        Returns the logits of the last token (`logits="last"`, shape [vocab]), of every appended token
        (`"all"`, shape [len(tokens), vocab]), or None.
        """
        tokens = self._check_tokens(tokens)
        self._check_window(len(tokens))
        if continue_message and self.current_step < 0:
            raise CacheOpError("continue_message=True but no message has been appended yet")
        if not continue_message:
            if self.config.spill is not None:
                self._rehydrate_for(self.n_messages)  # before the step opens: a failed fetch changes nothing
            if self.config.refresh and self.table.n and self._reads_plan(self.n_messages):
                if self.config.refresh_plan_only:
                    self.drop(self._unplanned(self.n_messages))
                if self.fresh_rows < self.table.n or self.next_pos != self.table.n:  # else already what it computes
                    self._refresh({"op": "refresh", "reader": self.n_messages}, tail=self.config.refresh_tail)
            self.current_step = self.n_messages
            self.n_messages += 1
            if kind == "tool":
                self.tool_steps.append(self.current_step)
        out = []
        for start in range(0, len(tokens), self.config.chunk):
            chunk = tokens[start : start + self.config.chunk]
            keep = len(chunk) if logits == "all" else 1
            out.append(self._forward(chunk, kind, keep))
        if logits == "all":
            return torch.cat(out, dim=0)
        return None if logits is None else self.last_logits

    def generate(self, max_new_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
        """Greedy decode continuing the current message; every generated token is appended to the session."""
        if self.last_logits is None:
            raise CacheOpError("generate needs a non-empty session (append a prompt first)")
        self._check_window(max_new_tokens)
        generated: list[int] = []
        kind = self.history[-1].get("kind", "assistant") if self.history else "assistant"
        for _ in range(max_new_tokens):
            tok = int(torch.argmax(self.last_logits))
            generated.append(tok)
            self._forward([tok], kind, 1)
            if tok in stop_ids:
                break
        return generated

    def drop(self, logical_indices: list[int]) -> None:
        """Remove tokens from all future attention; positions of the rest and the next position are unchanged."""
        idx = self._check_drop(logical_indices)
        if not idx:
            return
        target = torch.tensor(idx, dtype=torch.long)
        gone = torch.isin(self.table.field("logical"), target)
        self._cut_fresh(~gone)
        self.table.keep(torch.nonzero(~gone).view(-1))
        for i in idx:
            self.status[i] = DROPPED
        self._unspill([i for i in idx if i in self.spilled])  # a drop is final, even for a spilled token
        self.history.append({"op": "drop", "indices": idx})

    def reposition(self) -> None:
        """Give survivors positions 0..r-1 in logical order by exact re-rotation; the next append is at r."""
        if self.table.n == 0:
            raise CacheOpError("reposition on an empty cache: nothing is resident")
        self._renumber()
        self.history.append({"op": "reposition"})

    def refresh(self, tail: bool = False) -> None:
        """Encode the resident tokens afresh at positions 0..r-1 (in logical order, chunk H) and replace their K/V;
        the logits become the fresh forward's last. Costs a prefill of r tokens; needs twice the resident KV while
        it runs (the old table stays intact until the new one is complete, so a failure changes nothing).
        `tail=True`: keep the fresh prefix (`fresh_rows`, already what a new session computes) and re-encode the rest,
        at least the last row; the result equals the full refresh to rounding (chunk boundaries differ), not bit
        for bit."""
        if self.table.n == 0:
            raise CacheOpError("refresh on an empty cache: nothing is resident")
        self._refresh({"op": "refresh"}, tail=tail)

    def set_budget(self, budget: int | None) -> None:
        """B from the next eviction on; None evicts nothing more (kvpress's protocol: compress the context once, then
        append the question and decode with nothing evicted). Evicted tokens never come back. Checked as a new
        session's config is (bounded positions keep needing a budget below L - H)."""
        if budget is None:
            if self.config.limit is not None:
                raise CacheOpError("bounded positions need a budget (resident must stay < L)")
        else:
            dataclasses.replace(self.config, budget=budget).validate()
        self.config.budget = budget

    # -- internals ----------------------------------------------------------------------------------------------
    def _check_window(self, n_new: int) -> None:
        """Refuse, before any work, an append / decode whose forwards would see more resident tokens than the model's
        sliding window: the engine's attention reads every resident token, which is the model's own attention only
        while they fit in the window."""
        window = getattr(self.engine, "sliding_window", None)
        if window is None:
            return
        if self.config.policy.evicts:
            peak = max(self.table.n, self.config.budget) + min(n_new, self.config.chunk)
        else:
            peak = self.table.n + n_new
        if peak > window:
            raise CacheOpError(_window_refusal(self.engine, f"{peak} resident tokens in one forward"))

    def _refresh(self, record: dict, tail: bool = False) -> None:
        """Re-encode the resident rows at 0..r-1; `tail`: only rows from the fresh prefix's end on (at least the last,
        whose logits become the session's). The old table stays intact until the new one is complete."""
        old = self.table
        r = old.n
        tokens = old.field("token").tolist()
        fresh = Session(self.engine, SessionConfig(policy=POLICIES["full"], chunk=self.config.chunk,
                                                   use_adapter=self.config.use_adapter))
        k = min(self.fresh_rows, r - 1) if tail else 0
        if k and not bool((old.field("position")[:k] == torch.arange(k)).all()):
            k = 0  # (never expected: a fresh prefix sits at 0..k-1) re-encode everything rather than guess
        if k:
            prefix = old.clone()
            prefix.keep(torch.arange(k))
            fresh.table, fresh.next_pos, fresh.tokens, fresh.status = prefix, k, tokens[:k], bytearray(k)
            record = {**record, "from": k}
        fresh.append(tokens[k:], logits="last")
        t = fresh.table
        for name in ("logical", "step", "is_tool", "cumulative", "window"):
            t.meta[name][:r] = old.meta[name][:r]
        self.table = t  # shared forks of the old table keep reading its rows
        self.next_pos = r
        self.last_logits = fresh.last_logits
        self.refreshes += 1
        self.refresh_tokens += r - k
        self.fresh_rows = r
        self.history.append(record)

    def _cut_fresh(self, kept: torch.Tensor) -> None:
        """Rows are about to leave (`kept` False): rows after the first to go were encoded with it in view."""
        gone = torch.nonzero(~kept).view(-1)
        if gone.numel():
            self.fresh_rows = min(self.fresh_rows, int(gone[0]))

    def _unplanned(self, step: int) -> list[int]:
        """The resident tokens a plan-only refresh at `step`'s opening drops: all but the spans planned for `step` or
        later, the messages of reader steps (the questions that read the plan, and their answers) and the first
        message. Empty when that would leave nothing (a refresh needs something to encode)."""
        logical, steps = self.table.field("logical"), self.table.field("step")
        readers = torch.tensor(sorted({r for span in self.config.blueprint for r in span.readers}), dtype=steps.dtype)
        cut = (steps != 0) & ~torch.isin(steps, readers) & ~self._planned_mask(logical, step)
        return [] if bool(cut.all()) else logical[cut].tolist()

    def _reads_plan(self, step: int) -> bool:
        return any(step in span.readers for span in self.config.blueprint)

    def _check_tokens(self, tokens) -> list[int]:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.view(-1).tolist()
        tokens = list(tokens)
        if not tokens:
            raise CacheOpError("append needs at least one token")
        vocab = self.engine.vocab_size
        for t in tokens:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise CacheOpError(f"token id {t!r} is not an integer in [0, {vocab})")
        return tokens

    def _check_drop(self, logical_indices) -> list[int]:
        idx = [logical_indices] if isinstance(logical_indices, int) else list(logical_indices)
        seen = set()
        for i in idx:
            if not isinstance(i, int) or isinstance(i, bool):
                raise CacheOpError(f"drop index {i!r} is not an integer")
            if not 0 <= i < self.n_logical:
                raise CacheOpError(f"drop index {i} is unknown: the session has {self.n_logical} tokens")
            if self.status[i] == DROPPED or i in seen:
                raise CacheOpError(f"drop index {i} is already dropped")
            seen.add(i)
        return sorted(idx)

    def _renumber(self) -> None:
        r = self.table.n
        move_resident(self.table, self.engine.rope, torch.arange(r, dtype=torch.long, device=self.table.device))
        self.next_pos = r
        self.renumbers += 1

    def _forward(self, chunk: list[int], kind: str, keep_logits: int) -> torch.Tensor:
        """One model forward over a chunk; the history gets renumber → append → evict in the order they happen."""
        c = len(chunk)
        limit = self.config.limit
        if limit is not None and self.next_pos + c > limit:
            self._renumber()
            self.history.append({"op": "renumber"})
        self.history.append({"op": "append", "step": self.current_step, "kind": kind, "tokens": chunk})
        t = self.table
        t.reserve(c)
        positions = torch.arange(self.next_pos, self.next_pos + c, dtype=torch.long, device=t.device)
        extends_fresh = self.fresh_rows == t.n and self.next_pos == t.n  # an untouched table at 0..n-1 stays so
        policy = self.config.policy
        ctx = ForwardContext(n_old=t.n, score_mode=policy.score_mode, window=policy.window,
                             n_layers=self.engine.n_layers, prefix=t.prefix, head_visible=t.head_visible())
        model = self.engine.model
        with torch.inference_mode(), steward_attention_enabled(model), self.engine.adapter(self.config.use_adapter):
            out = model(input_ids=torch.tensor([chunk], device=t.device), position_ids=positions[None],
                        past_key_values=_EngineCache(t), use_cache=True, steward=ctx, logits_to_keep=keep_logits)
        logits = out.logits[0].float()
        n_old = t.n
        new_cum = torch.zeros(c)
        new_win = torch.zeros(c)
        if ctx.scores is not None:
            if policy.score_mode == "cumulative":
                t.meta["cumulative"][:n_old] += ctx.scores[:n_old]
                new_cum = ctx.scores[n_old:]
            else:
                t.meta["window"][:n_old] = ctx.scores[:n_old]
                new_win = ctx.scores[n_old:]
        head = {}
        if ctx.head_scores is not None:  # [layers, Hkv, n] -> per slot, one column per (layer, KV head)
            cols = ctx.head_scores.reshape(-1, n_old + c).T
            if policy.score_mode == "cumulative":
                t.meta["head_score"][:n_old] += cols[:n_old]
            else:
                t.meta["head_score"][:n_old] = cols[:n_old]
            head = {"head_score": cols[n_old:]}
        logical = torch.arange(self.n_logical, self.n_logical + c, dtype=torch.long)
        t.commit(c, logical=logical, token=torch.tensor(chunk), position=positions, step=self.current_step,
                 is_tool=kind == "tool", cumulative=new_cum, window=new_win, ref_pos=positions, **head)
        self.tokens.extend(chunk)
        self.status.extend(bytes(c))
        self.next_pos += c
        if extends_fresh:
            self.fresh_rows = t.n
        self.last_logits = logits[-1]
        self.peak_resident = max(self.peak_resident, t.n)
        self._evict()
        return logits

    def _view(self) -> SlotView:
        t = self.table
        return SlotView(logical=t.field("logical"), position=t.field("position"), step=t.field("step"),
                        is_tool=t.field("is_tool"), cumulative=t.field("cumulative"), window=t.field("window"),
                        current_step=self.current_step, n_logical=self.n_logical,
                        blueprint=self.config.blueprint, tool_steps=self.tool_steps)

    def _evict(self, budget: int | None = None) -> None:
        policy, budget = self.config.policy, self.config.budget if budget is None else budget
        if not policy.evicts or budget is None:
            return
        view = self._view()
        if self.config.per_head:
            self._evict_heads(view, budget)
            return
        keep = select_keep(policy.score(view), view, policy, budget)
        if keep.numel() == self.table.n:
            return
        kept = torch.zeros(self.table.n, dtype=torch.bool)
        kept[keep] = True
        evicted = view.logical[~kept].tolist()
        for i in evicted:
            self.status[i] = EVICTED
        if self.config.spill is not None:
            self._spill(torch.nonzero(~kept).view(-1), view)
        self._cut_fresh(kept)
        self.table.keep(keep)
        self.history.append({"op": "evict", "indices": evicted})

    def _evict_heads(self, view: SlotView, budget: int) -> None:
        """The shared selection step per (layer, KV head), each on its own scores over the slots it still sees (a
        hidden slot never comes back to a head); a slot no head keeps leaves the table. History: `hide` (the
        (logical, head) pairs newly hidden) before `evict` (the slots that left)."""
        policy, t = self.config.policy, self.table
        alive, scores = t.field("head_alive"), t.field("head_score")
        kept = torch.zeros_like(alive)
        group = self.engine.n_kv_heads if self.config.per_layer else 1  # the columns that share one selection
        for g in range(0, alive.shape[1], group):
            cols = slice(g, g + group)
            score = scores[:, cols].mean(dim=1)
            hv = dataclasses.replace(view, cumulative=score, window=score)
            s = policy.score(hv).masked_fill(~alive[:, cols].any(dim=1), float("-inf"))
            kept[select_keep(s, hv, policy, budget), cols] = True
        kept &= alive  # (a layer's heads hide alike, so a column it keeps is alive in every head of the layer)
        let_go = alive & ~kept
        hidden = torch.nonzero(let_go)
        if hidden.numel() == 0:
            return
        any_kept = kept.any(dim=1)
        self._cut_fresh(~let_go.any(dim=1))  # a row some head stops seeing is left by that head
        pairs = [[int(view.logical[i]), int(h)] for i, h in hidden.tolist() if any_kept[i]]
        if pairs:
            self.history.append({"op": "hide", "pairs": pairs})
        t.meta["head_alive"][: t.n] = kept
        if bool(any_kept.all()):
            return
        evicted = view.logical[~any_kept].tolist()
        for i in evicted:
            self.status[i] = EVICTED
        t.keep(torch.nonzero(any_kept).view(-1))
        self.history.append({"op": "evict", "indices": evicted})

    def fork(self, shared: bool = False) -> Session:
        """An independent session with the same state and history; later ops on either side never affect the other.

        `shared=True` copies no K/V: the fork reads this session's resident rows in place (`SlotTable.share`) and
        this session writes fresh buffers instead of rows the fork reads (copy-on-write). What a short-lived reader
        (the aux thread) wants. Its attention sums over two key segments, so its logits equal a copy's to float
        rounding, not bit for bit."""
        if shared and self.config.per_head:
            raise CacheOpError("per-head selection does not run on a shared fork (take a copy: fork(shared=False))")
        other = Session.__new__(Session)
        other.__dict__.update(self.__dict__)
        other.config = dataclasses.replace(self.config)
        other.table = self.table.share() if shared else self.table.clone()
        other.tokens = list(self.tokens)
        other.status = bytearray(self.status)
        other.history = list(self.history)
        other.tool_steps = list(self.tool_steps)
        other.spilled = dict(self.spilled)
        if self.config.spill is not None:
            self.config.spill.retain(other.spilled.values())
            other._track_spill()
        return other

    # -- tiered rehydration ---------------------------------------------------------------------------------------
    def _spill(self, rows: torch.Tensor, view: SlotView) -> None:
        """Keep the evicted slots `rows` that a planned span still needs (a reader at or after this step)."""
        planned = self._planned_mask(view.logical[rows], self.current_step)
        rows = rows[planned]
        if rows.numel():
            key = self.config.spill.put(pack_rows(self.table, rows), refs=rows.numel())
            for i in view.logical[rows].tolist():
                self.spilled[i] = key

    def _planned_mask(self, logical: torch.Tensor, step: int) -> torch.Tensor:
        mask = torch.zeros(logical.shape, dtype=torch.bool)
        for span in self.config.blueprint:
            if span.next_reader(step) is not None:
                mask |= (logical >= span.start) & (logical < span.end)
        return mask

    def _rehydrate_for(self, step: int) -> None:
        """Bring back the spilled tokens of every span that `step` reads; forget those no reader will ask for."""
        if self.spilled:
            live = self._planned_mask(torch.tensor(list(self.spilled)), step).tolist()
            self._unspill([i for i, keep in zip(list(self.spilled), live, strict=True) if not keep])
        wanted = sorted({i for span in self.config.blueprint if step in span.readers  # (spans may overlap)
                         for i in range(span.start, min(span.end, self.n_logical)) if i in self.spilled})
        policy, budget = self.config.policy, self.config.budget
        wanted = wanted[: max(0, budget - policy.sinks - policy.recent)]  # what fits beside the protected slots
        if not wanted:
            return
        t0 = time.perf_counter()
        picked = self.config.spill.rows_of(self.spilled, wanted)  # may raise SpillError: nothing has changed yet
        saved, self.current_step = self.current_step, step  # make room first (resident never exceeds B): the
        try:  # scores of the step about to open decide, so spans it reads outrank the rest
            self._evict(budget - len(wanted))
        finally:
            self.current_step = saved
        self.fresh_rows = min(self.fresh_rows, int((self.table.field("logical") < wanted[0]).sum()))
        for rows in picked:
            self.table.insert(rows)
        for i in wanted:
            self.status[i] = RESIDENT
        self._unspill(wanted)
        self.history.append({"op": "rehydrate", "indices": wanted})
        self.config.spill.note_rehydrated(len(wanted), time.perf_counter() - t0)
        self.peak_resident = max(self.peak_resident, self.table.n)
        pos = self.table.field("position")
        if self.config.limit is not None or bool((pos[1:] <= pos[:-1]).any()):
            self._renumber()
            self.history.append({"op": "renumber"})

    def _unspill(self, logical: list[int]) -> None:
        if logical:
            self.config.spill.release([self.spilled.pop(i) for i in logical])


def _window_refusal(engine, what: str) -> str:
    layer, window = engine.sliding_window_layer, engine.sliding_window
    return (f"{what} would exceed the sliding window of {window} tokens of layer {layer}: the engine's attention reads "
            f"every resident token, which is this model's own attention only while they fit in the window (use an "
            f"evicting policy with budget + chunk <= {window})")


def _release_all(store: SpillStore, spilled: dict[int, str]) -> None:
    store.release(list(spilled.values()))
    spilled.clear()


def move_resident(t: SlotTable, rope, new_pos: torch.Tensor) -> None:
    """Give the resident slots the positions `new_pos`: K = R(new − p_ref) K_ref from the fp32 reference keys (taken
    now if this is the first move), angles in float64 once per distinct layer spec (`ModelRope`); a layer without RoPE
    keeps its keys; V unchanged."""
    from kvsteward.kernels.rope import as_model_rope

    rope = as_model_rope(rope, t.n_layers)
    t.own_rows()  # the keys are rewritten in place
    t.ensure_reference()
    r = t.n
    delta = new_pos - t.field("ref_pos")
    rotations = rope.rotations(delta)
    for layer in range(t.n_layers):
        t.k[layer][:, :r] = rope.rerotate_layer(layer, t.ref_k[layer][:, :r], delta, t.dtype, rotations)
    t.meta["position"][:r] = new_pos
