"""Segment-batch attention (AKV): restore any op history in ONE model forward.

The history is cut into segments at op boundaries (each recorded `append` chunk is a segment). Every token is fed
once, at the position it had when it was appended; projections and FFNs run once over the whole batch. Inside
attention, each segment's queries get exactly the KV they originally saw: the slots resident at that time, each key
re-rotated from its original position p0 to the position it then had (K = R(p − p0) K0, float64 angles), plus
causal attention among the segment's own tokens. Keys and values of a token never depend on later segments, so
this equals the sequential replay of the ops — tested against it, measured against it (`steward bench restore`).

The restored session holds the final resident slots: keys rotated to their final positions, original values,
cumulative scores recomputed the same way (for `h2o` / `foresight`). Window-vote policies (snapkv, tova) are not
restorable this way: their score is the last chunk's vote, which the restore does not reproduce. Nor is a history
with a `refresh`: its K/V come from the resident tokens alone, not from one pass over the history.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvsteward.serve.engine.attention import ForwardContext, steward_attention_enabled
from kvsteward.serve.engine.session import RESIDENT, Session, SessionConfig, _EngineCache, move_resident


@dataclass
class Segment:
    start: int  # first logical token (= batch index) of the segment's queries
    end: int
    visible: torch.Tensor  # logical indices of the old slots visible to the segment (ascending)
    delta: torch.Tensor  # their position at that time minus their original position


@dataclass
class Plan:
    tokens: list[int]
    original_pos: torch.Tensor  # [N] position of each token when appended
    steps: list[int]
    kinds: list[str]
    segments: list[Segment]
    resident: list[int]  # final resident logical indices
    final_pos: list[int]
    next_pos: int
    status: bytearray
    renumbers: int
    n_messages: int
    tool_steps: list[int]


def plan_history(history: list[dict]) -> Plan:
    """Simulate the op history on metadata alone: who was resident where, for every segment."""
    tokens, orig, steps, kinds, segments = [], [], [], [], []
    resident: list[int] = []
    pos: dict[int, int] = {}
    next_pos, renumbers, status = 0, 0, bytearray()
    seen_steps: list[int] = []
    tool_steps: list[int] = []
    for op in history:
        kind = op["op"]
        if kind == "append":
            n0, ids = len(tokens), op["tokens"]
            vis = torch.tensor(resident, dtype=torch.long)
            delta = torch.tensor([pos[i] - orig[i] for i in resident], dtype=torch.long)
            segments.append(Segment(n0, n0 + len(ids), vis, delta))
            for k in range(len(ids)):
                pos[n0 + k] = next_pos + k
                orig.append(next_pos + k)
            resident += list(range(n0, n0 + len(ids)))
            tokens += ids
            steps += [op["step"]] * len(ids)
            kinds += [op["kind"]] * len(ids)
            status.extend(bytes(len(ids)))
            next_pos += len(ids)
            if not seen_steps or seen_steps[-1] != op["step"]:
                seen_steps.append(op["step"])
                if op["kind"] == "tool":
                    tool_steps.append(op["step"])
        elif kind in ("drop", "evict"):
            gone = set(op["indices"])
            resident = [i for i in resident if i not in gone]
            for i in gone:
                status[i] = 1 if kind == "drop" else 2
        elif kind == "rehydrate":  # back at the position it left with (pos[i] is untouched while evicted)
            resident = sorted(resident + list(op["indices"]))
            for i in op["indices"]:
                status[i] = 0
        elif kind in ("reposition", "renumber", "refresh"):  # (a refresh also re-encodes: `restore` refuses it)
            for r, i in enumerate(resident):
                pos[i] = r
            next_pos = len(resident)
            renumbers += 1
        else:
            raise ValueError(f"unknown op {kind!r} in history")
    return Plan(tokens, torch.tensor(orig, dtype=torch.long), steps, kinds, segments, resident,
                [pos[i] for i in resident], next_pos, status, renumbers, len(seen_steps), tool_steps)


def _segment_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, steward=None,
                       **kwargs):
    """Attention for a whole history batch: per segment, its original KV view (see module docstring)."""
    ctx: ForwardContext = steward
    plan: Plan = ctx.extra["plan"]
    rope = ctx.extra["rope"]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    hq, n, d = query.shape[1], query.shape[2], query.shape[3]
    out = torch.empty_like(query)
    col = torch.zeros(n, dtype=torch.float32) if ctx.score_mode == "cumulative" else None
    for seg, cos_sin in zip(plan.segments, ctx.extra["cos_sin"], strict=True):
        q = query[:, :, seg.start : seg.end]
        old_k = key[:, :, seg.visible]
        if seg.visible.numel():
            old_k = rope.rerotate_layer(module.layer_idx, old_k.float(), seg.delta, key.dtype, cos_sin)
        k = torch.cat([old_k, key[:, :, seg.start : seg.end]], dim=2)
        v = torch.cat([value[:, :, seg.visible], value[:, :, seg.start : seg.end]], dim=2)
        m = seg.end - seg.start
        mask = torch.cat([torch.ones(m, seg.visible.numel(), dtype=torch.bool),
                          torch.ones(m, m, dtype=torch.bool).tril_()], dim=1)
        if col is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        else:
            hkv = k.shape[1]
            g = hq // hkv
            s = torch.matmul(q[0].reshape(hkv, g * m, d).float(), k[0].float().transpose(1, 2)).mul_(scaling)
            p = torch.softmax(s.view(hkv, g, m, -1).masked_fill_(~mask, float("-inf")), dim=-1)
            o = torch.matmul(p.view(hkv, g * m, -1), v[0].float()).view(1, hq, m, d).to(query.dtype)
            cs = p.sum(dim=(0, 1, 2)) / (hq * ctx.n_layers)
            col.index_add_(0, seg.visible, cs[: seg.visible.numel()])
            col[seg.start : seg.end] += cs[seg.visible.numel():]
        out[:, :, seg.start : seg.end] = o
    if col is not None:
        ctx.add(col)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("steward_segments", _segment_attention)


def restore(engine, config: SessionConfig, history: list[dict]) -> Session:
    """Rebuild a session from its op history with one model forward (segment-batch attention)."""
    if config.policy.score_mode == "window":
        raise ValueError(f"policy {config.policy.name!r} keeps a window vote that a restore cannot reproduce")
    if config.spill is not None:
        raise ValueError("a session with a spill store keeps evicted planned KV in a tier that a one-forward restore "
                         "does not refill: rebuild it by replaying its ops")
    if any(op["op"] == "refresh" for op in history):
        raise ValueError("a refresh re-encodes the resident tokens from themselves alone, which one forward over the "
                         "history cannot reproduce: rebuild the session by replaying its ops")
    plan = plan_history(history)
    s = Session(engine, config)
    t = s.table
    n = len(plan.tokens)
    if n == 0:
        return s
    t.reserve(n)
    ctx = ForwardContext(n_old=0, score_mode=config.policy.score_mode, n_layers=engine.n_layers,
                         extra={"plan": plan, "rope": engine.rope,
                                "cos_sin": [engine.rope.rotations(seg.delta) if seg.visible.numel() else None
                                            for seg in plan.segments]})
    model = engine.model
    attention = steward_attention_enabled(model, "steward_segments")
    with torch.inference_mode(), attention, engine.adapter(config.use_adapter):
        out = model(input_ids=torch.tensor([plan.tokens]), position_ids=plan.original_pos[None],
                    past_key_values=_EngineCache(t), use_cache=True, steward=ctx, logits_to_keep=1)
    _install(s, plan, ctx, out.logits[0, -1].float())
    s.history = list(history)
    return s


def _install(s: Session, plan: Plan, ctx: ForwardContext, last_logits: torch.Tensor) -> None:
    """Keep the final resident slots of the staged batch, keys rotated to their final positions."""
    t = s.table
    n = len(plan.tokens)
    t.commit(n, logical=torch.arange(n), token=torch.tensor(plan.tokens), position=plan.original_pos,
             step=torch.tensor(plan.steps), is_tool=torch.tensor([k == "tool" for k in plan.kinds]),
             cumulative=ctx.scores if ctx.scores is not None else 0.0, ref_pos=plan.original_pos)
    keep = torch.tensor(plan.resident, dtype=torch.long)
    t.keep(keep)
    final = torch.tensor(plan.final_pos, dtype=torch.long)
    if plan.renumbers:
        move_resident(t, s.engine.rope, final)  # reference keys = the keys at their original positions
    else:
        t.meta["position"][: t.n] = final
    s.tokens = list(plan.tokens)
    s.status = plan.status
    s.next_pos = plan.next_pos
    s.renumbers = plan.renumbers
    s.n_messages = plan.n_messages
    s.current_step = plan.steps[-1]
    s.tool_steps = plan.tool_steps
    s.last_logits = last_logits
    s.peak_resident = max(s.peak_resident, t.n)
    assert all(st == RESIDENT for st in (s.status[i] for i in plan.resident))
