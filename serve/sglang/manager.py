"""The learned memory manager inside SGLang: the aux fork as a LoRA request, decoded exactly as `steward serve` does.

`steward serve` (kvsteward.serve.manager) runs the manager as a fork of the main session at a boundary: the trigger
(`Memory management mode`, the open cursors) and the forced opener `{"del_cursors":` are appended with the adapter on,
over the main's K/V as the base model wrote it, and the list is decoded greedily under the grammar of
`kvsteward.serve.manager.decode` (only open, unused cursor ids; `close_bias` on the closing candidates; the unread
responses never offered with `keep_unread`). On SGLang the same decision is one `/generate` request:

- **the fork** carries the main's op history (plus the trigger message, `SglangHistory.fork_fields`: compact), so the
  kvsteward tree gives it the main's cached state. It names the adapter (`lora_path`): sglang's LoRA serving computes
  its own tokens with the adapter. sglang appends a LoRA request's adapter id to its `extra_key` (a separate namespace
  per adapter); the kvsteward tree strips it for a request that carries a history, so the fork matches the *base*
  model's state of the main (shared, not copied), and it never inserts the fork's tokens (computed with the adapter)
  into the tree (`OpRadixCache`, `_Walk.fork`). The trigger is never matched against the tree either: it is
  computed with the adapter, as in the engine, even where the main cached the same tokens (`<|im_start|>`).
- **the decode** is `DeletionListProcessor`, an sglang custom logit processor (the server runs with
  `--enable-custom-logit-processor`): at every step it takes the row's logits of the deletion-list candidates
  (`manager.decode._candidates`), adds `close_bias` to the closing ones, and keeps only the most probable candidate
  whose text continues a valid list (`manager.decode.valid_tail`, the same automaton) — the engine's
  `_constrained_steps`, token for token; with greedy sampling that is the token sglang emits. Once the list is
  closed it forces EOS (one forward the engine does not run; its token is not part of the decision).

- **the confidence rule** (`min_confidence`, an adapter calibrated with `steward eval calibrate --confidences`) is
  the engine's walk over the list's branches (`manager.decode.branch_walk`, the same order, prune and forward
  budget): each branch state is one `/generate` request of one token, the fork plus the branch's tail, asking for
  the candidates' log-probabilities (`token_ids_logprob`); the walk renormalizes them over the valid candidates as
  it does the engine's logits. A branch request shares the main's prefix like the greedy fork, and recomputes the
  trigger and its tail with the adapter (the tree never holds adapter tokens): a decision costs one prefill of
  trigger + tail per branch token, where the engine extends a copied state by one token.

- **a per-response adapter** (`scores` trigger): one request, the fork with the scores trigger, asking for the two
  answers' log-probabilities at every trigger position (`token_ids_logprob` from `logprob_start_len`); each open
  response's P(no) is read at its slot as the engine reads its logits (`manager.scores`), no decode.

- **a fitted rule** (a manager folder whose validation winner is a rule: `for_choice`) decides from the messages
  with no request at all, exactly as the engine's worker does (`manager.rule.RuleManager`); **the stack** (the
  structure trees over a per-response adapter's P(no)) is the per-response request, then the head
  (`manager.stack.StackManager.decide_with`).

Not on SGLang: the planner (`--aux-plan`).
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from kvsteward.serve.manager.decode import (
    LIST_OPEN,
    MAX_BRANCH_FORWARDS,
    PREFIX,
    PRUNE,
    AuxDecision,
    _candidates,
    _close,
    branch_walk,
    valid_tail,
)
from kvsteward.serve.manager.rule import ManagerError, RuleManager, load_choice
from kvsteward.serve.manager.stack import StackManager

AUX_FIELD = "kvsteward_aux"
ForkInput = tuple[list[list[int]], dict | None]  # a fork's messages (token ids, the trigger last) and ops


@lru_cache(maxsize=64)
def _aux_spec(text: str) -> dict:
    spec = json.loads(text)
    spec["open"] = frozenset(spec["open"])
    spec["text_of"] = dict(zip(spec["cand"], spec["texts"], strict=True))
    spec["closing"] = frozenset(t for t, x in zip(spec["cand"], spec["texts"], strict=True) if "]" in x)
    return spec


class DeletionListProcessor:
    """sglang custom logit processor: the deletion list's constrained greedy step (`_constrained_steps`).

    Serialized by reference (`processor_str`: a pickle of the class, which sglang's `CustomLogitProcessor.from_str`
    loads with dill), so the server imports this module: kvsteward must be installed in the server's environment (it
    is: its entry point is the plugin). Per request, `custom_params["kvsteward_aux"]` is a JSON string: the candidate
    ids and texts, the deletable ids, the close bias and the EOS id (a string: it must survive msgpack IPC)."""

    def __call__(self, logits, custom_param_list=None):
        import torch

        for row, params in enumerate(custom_param_list or []):
            text = (params or {}).get(AUX_FIELD)
            if text is None:
                continue
            spec = _aux_spec(text)
            out = list(getattr(params.get("__req__"), "output_ids", ()) or ())
            tail = "".join(spec["text_of"].get(t, "") for t in out)
            choice = None
            if not valid_tail(tail, spec["open"])[1]:
                cand = torch.tensor(spec["cand"], dtype=torch.long, device=logits.device)
                scores = logits[row, cand].float()
                if spec["close_bias"]:
                    bias = torch.tensor([spec["close_bias"] if t in spec["closing"] else 0.0 for t in spec["cand"]],
                                        device=logits.device)
                    scores = scores + bias
                for k in torch.argsort(scores, descending=True).tolist():
                    if valid_tail(tail + spec["texts"][k], spec["open"])[0]:
                        choice = spec["cand"][k]
                        break
            if choice is None:  # the list is closed (or, impossibly, no continuation): end the request
                choice = spec["eos"]
            keep = logits[row, choice].clone()
            logits[row].fill_(float("-inf"))
            logits[row, choice] = keep if torch.isfinite(keep) else 0.0
        return logits


def processor_str() -> str:
    """`custom_logit_processor` for a `/generate` request: what sglang's `CustomLogitProcessor.to_str()` writes
    (`{"callable": hex}`; sglang loads it with dill, which reads a plain pickle of a class by reference)."""
    return json.dumps({"callable": pickle.dumps(DeletionListProcessor).hex()})


@dataclass
class SglangManager:
    """The manager's decision on SGLang, with `steward serve`'s rule: `adapter_meta(adapter)` gives `trigger_style`,
    `aux_context`, `close_bias`; `lora` is the adapter's name on the server (`--lora-paths NAME=DIR`), None for the
    base model as its own manager (`--aux-base`)."""

    tokenizer: Any
    lora: str | None = None
    trigger_style: str = "ids"
    aux_context: str = "full"
    close_bias: float = 0.0
    keep_unread: bool = True
    max_tokens: int = 64
    min_confidence: float | None = None
    # a fitted rule decides, no request (`manager.rule`: `for_choice`); or the stack (`manager.stack.StackManager`):
    # the per-response request gives P(no), the head decides
    rule: RuleManager | StackManager | None = None
    refusals: int = 0  # lost pre-op states rebuilt before a fork was served (`_post`)
    _eos: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        from kvsteward.models import check_min_confidence

        if self.min_confidence is not None:
            check_min_confidence(self.min_confidence)
        eos = self.tokenizer.eos_token_id
        self._eos = int(eos[0] if isinstance(eos, list) else eos)

    @classmethod
    def for_adapter(cls, tokenizer, adapter: str | None, lora: str | None, **kw) -> SglangManager:
        from kvsteward.models import adapter_meta

        meta = adapter_meta(adapter) if adapter else {"trigger": "ids", "aux_context": "full", "close_bias": 0.0,
                                                      "min_confidence": None}
        args = {"trigger_style": meta["trigger"], "aux_context": meta["aux_context"],
                "close_bias": meta["close_bias"], "min_confidence": meta["min_confidence"]}
        return cls(tokenizer, lora=lora, **{**args, **kw})

    @classmethod
    def for_choice(cls, tokenizer, manager_dir: str, lora: str | None, **kw) -> SglangManager:
        """The manager a `steward eval choose` folder names (`manager.rule.load_choice`): its adapter, served as
        `for_adapter` serves it under the name `lora`, or its fitted rule."""
        choice = load_choice(manager_dir)
        if choice.arm == "stack":  # the adapter's per-response request, then the head (`manager.stack`)
            mgr = cls.for_adapter(tokenizer, choice.adapter_dir, lora, **kw)
            if mgr.trigger_style != "scores" or lora is None:
                raise ManagerError(f"{manager_dir}: the stack reads a per-response adapter served under a LoRA name "
                                   f"(adapter trigger {mgr.trigger_style!r}, lora {lora!r})")
            mgr.rule = choice.rule
            return mgr
        if choice.is_rule:
            return cls(tokenizer, rule=choice.rule, **kw)
        return cls.for_adapter(tokenizer, choice.adapter_dir, lora, **kw)

    def deletable(self, messages: list[dict], open_cursors: list[int]) -> list[int]:
        from kvsteward.synth.traces.hindsight import unread_cursors

        unread = set(unread_cursors(messages)) if self.keep_unread else set()
        return [c for c in open_cursors if c not in unread]

    def trigger_ids(self, messages: list[dict], open_cursors: list[int]) -> list[int]:
        """The fork's last message: the trigger (as `manager.thread.aux_steps` writes it) and the forced opener."""
        from kvsteward.synth.chat import generation_prompt, message_texts
        from kvsteward.synth.traces.hindsight import delete_trigger

        tok = self.tokenizer
        history = messages + [{"role": "user", "content": delete_trigger(open_cursors, messages,
                                                                         self.trigger_style)}]
        trigger_text = message_texts(tok, history)[-1] + generation_prompt(tok, history)
        return tok.encode(trigger_text, add_special_tokens=False) + tok.encode(PREFIX, add_special_tokens=False)

    def fork_body(self, history, messages: list[dict], message_ids: list[list[int]], cache: dict | None,
                  open_cursors: list[int]) -> dict | None:
        """The fork's `/generate` body at a boundary: the main's messages up to the boundary's tool response (their
        dicts, for the trigger, and the token ids the main sent) with the main's ops, then the trigger. None when no
        cursor is deletable (the decision is "delete nothing" without a request, as in the engine).
        `history`: the main's `SglangHistory` (the fork continues its base), or None for the full form."""
        built = self._fork_request(history, messages, message_ids, cache, open_cursors)
        return None if built is None else built[0]

    def _fork_request(self, history, messages: list[dict], message_ids: list[list[int]], cache: dict | None,
                      open_cursors: list[int]) -> tuple[dict, ForkInput] | None:
        """`fork_body` and the fork's input (for `_post`)."""
        deletable = self.deletable(messages, open_cursors)
        if not deletable:
            return None
        body, fork_input = self._fork_fields(history, messages, message_ids, cache, open_cursors)
        cand, texts = _candidates(self.tokenizer)
        spec = {"cand": cand, "texts": texts, "open": deletable, "close_bias": float(self.close_bias),
                "eos": self._eos}
        params = body.setdefault("sampling_params", {})
        params.setdefault("custom_params", {})[AUX_FIELD] = json.dumps(spec, separators=(",", ":"))
        params.update({"max_new_tokens": self.max_tokens + 1, "temperature": 0.0})
        body["custom_logit_processor"] = processor_str()
        return body, fork_input

    def branch_body(self, history, messages: list[dict], message_ids: list[list[int]], cache: dict | None,
                    open_cursors: list[int], tail: list[int]) -> dict:
        """The confidence walk's request for one branch state: the fork, the tokens `tail` of the branch after the
        opener, one token to generate, and the log-probabilities of every deletion-list candidate there."""
        return self._branch_request(history, messages, message_ids, cache, open_cursors, tail)[0]

    def _branch_request(self, history, messages: list[dict], message_ids: list[list[int]], cache: dict | None,
                        open_cursors: list[int], tail: list[int]) -> tuple[dict, ForkInput]:
        """`branch_body` and the fork's input (for `_post`)."""
        body, fork_input = self._fork_fields(history, messages, message_ids, cache, open_cursors, tail)
        body.setdefault("sampling_params", {}).update({"max_new_tokens": 1, "temperature": 0.0})
        body.update({"return_logprob": True, "token_ids_logprob": _candidates(self.tokenizer)[0]})
        return body, fork_input

    def scores_body(self, history, messages: list[dict], message_ids: list[list[int]], cache: dict | None,
                    open_cursors: list[int]) -> tuple[dict, list[int]] | None:
        """A per-response (`scores`) adapter's request at a boundary: the fork with the scores trigger (as
        `manager.scores.trigger_ids` writes it: no generation prompt), one token to generate, and the log-probabilities
        of the two answers at every trigger position (`token_ids_logprob`, from the trigger's first token on: the
        trigger is always computed, never matched in the tree). Returns (body, the input position whose
        distribution is each open cursor's slot: slot + 1, ascending cursor order); None when nothing is
        deletable (no request, as in the engine)."""
        built = self._scores_request(history, messages, message_ids, cache, open_cursors)
        return None if built is None else built[:2]

    def _scores_request(self, history, messages: list[dict], message_ids: list[list[int]], cache: dict | None,
                        open_cursors: list[int]) -> tuple[dict, list[int], ForkInput] | None:
        """`scores_body` and the fork's input (for `_post`)."""
        from kvsteward.serve.manager.scores import trigger_ids
        from kvsteward.synth.traces.hindsight import ANSWERS
        from kvsteward.synth.traces.tokens import answer_ids

        if not self.deletable(messages, open_cursors):
            return None
        trigger, slots = trigger_ids(self.tokenizer, messages, open_cursors)
        body, fork_input = self._fork_fields(history, messages, message_ids, cache, open_cursors, trigger=trigger)
        start = len(body["input_ids"]) - len(trigger)
        body.setdefault("sampling_params", {}).update({"max_new_tokens": 1, "temperature": 0.0})
        body.update({"return_logprob": True, "logprob_start_len": start,
                     "token_ids_logprob": list(answer_ids(self.tokenizer, ANSWERS))})
        return body, [start + k + 1 for k in slots], fork_input

    def scores_decision(self, url: str, history, messages: list[dict], message_ids: list[list[int]],
                        cache: dict | None, open_cursors: list[int], timeout: float = 600) -> AuxDecision:
        """The per-response decision on the server at `url`: each open response's P(no) (the two answers'
        log-probabilities at its slot, softmaxed against each other, as `manager.scores.needless` does with the
        engine's logits), the deletable ones at or above the threshold (`manager.scores.deletions`)."""
        from kvsteward.serve.manager.scores import deletions
        from kvsteward.synth.traces.hindsight import ANSWERS
        from kvsteward.synth.traces.tokens import answer_ids

        built = self._scores_request(history, messages, message_ids, cache, open_cursors)
        if built is None:
            return AuxDecision([], PREFIX + LIST_OPEN + "]}", 0)
        body, positions, fork_input = built
        out = self._post(url, body, history, fork_input, timeout)
        rows = out["meta_info"]["input_token_ids_logprobs"]
        start = body["logprob_start_len"]
        yes, no = answer_ids(self.tokenizer, ANSWERS)
        p_no = {}
        for cursor, pos in zip(sorted(open_cursors), positions, strict=True):
            lp = {int(tid): float(v) for v, tid, *_ in rows[pos - start]}
            p_no[cursor] = float(torch.softmax(torch.tensor([lp[yes], lp[no]]), dim=0)[1])
        deletable = self.deletable(messages, open_cursors)
        gone = deletions(p_no, deletable, self.min_confidence)
        return AuxDecision(gone, json.dumps({"del_cursors": gone}), 0, confidence={c: p_no[c] for c in deletable})

    def _fork_fields(self, history, messages: list[dict], message_ids: list[list[int]], cache: dict | None,
                     open_cursors: list[int], tail: list[int] = (), trigger: list[int] | None = None
                     ) -> tuple[dict, ForkInput]:
        """The fork's fields (the main's messages and ops, the trigger, the opener, `tail`; or `trigger` as given)
        naming the adapter, and its input: (messages as token ids, the trigger last; ops)."""
        trigger = self.trigger_ids(messages, open_cursors) + list(tail) if trigger is None else trigger
        if self.aux_context == "first":  # the adapter's training context: the first message only, no op touches it
            msgs, ops = [message_ids[0], trigger], None
        else:
            msgs, ops = [*message_ids, trigger], cache
        if history is not None and self.aux_context != "first":
            body = history.fork_fields(msgs, ops)
        else:
            from kvsteward.serve.sglang.ops import request_fields

            body = request_fields(msgs, ops)
        if self.lora is not None:
            body["lora_path"] = self.lora
        return body, (msgs, ops)

    def _post(self, url: str, body: dict, history, fork_input: ForkInput, timeout: float) -> dict:
        """One fork request; `fork_input` is its (messages, ops) from `_fork_fields`. With a history that refuses a
        lost pre-op state (`SglangHistory(miss="refuse")`) a refusal is not a decision: the main's state is rebuilt
        by the base model and the fork sent again (`ops.generate_exact`; counted in `refusals`)."""
        import requests

        from kvsteward.serve.sglang.ops import generate_exact

        def send(b: dict, n: int) -> dict:
            params = b.setdefault("sampling_params", {})
            params.setdefault("max_new_tokens", n)
            params.setdefault("temperature", 0.0)
            r = requests.post(f"{url}/generate", json=b, timeout=timeout)
            r.raise_for_status()
            return r.json()

        if history is None or getattr(history, "miss", None) != "refuse" or self.aux_context == "first":
            return send(body, 1)
        msgs, ops = fork_input
        out, refusals = generate_exact(send, history, body, msgs, ops, body["sampling_params"]["max_new_tokens"])
        self.refusals += refusals
        return out

    def decision(self, output_ids: list[int]) -> AuxDecision:
        """The decision in a fork's output tokens (the constrained list, then EOS): as `_constrained_steps` returns
        it (ids sorted; `truncated` when the token budget ran out before the list closed)."""
        text_of = dict(zip(*_candidates(self.tokenizer), strict=True))
        tail, used = "", 0
        for t in output_ids[: self.max_tokens]:
            if t not in text_of:  # EOS: the list closed
                break
            tail += text_of[t]
            used += 1
        try:
            ids = json.loads(PREFIX + tail)["del_cursors"]
        except json.JSONDecodeError:
            text = PREFIX + _close(tail)
            return AuxDecision(sorted(json.loads(text)["del_cursors"]), text, used, truncated=True)
        return AuxDecision(sorted(ids), PREFIX + tail, used)

    def decide(self, url: str, history, messages: list[dict], message_ids: list[list[int]], cache: dict | None,
               open_cursors: list[int], timeout: float = 600) -> AuxDecision:
        """Run the fork on the server at `url` and return the decision."""
        if self.rule is not None and self.rule.needs_model:  # the stack: the adapter's P(no), then the head
            read = self.scores_decision(url, history, messages, message_ids, cache, open_cursors, timeout)
            return self.rule.decide_with(messages, open_cursors, read.confidence or {})
        if self.rule is not None:  # the engine's worker decides the same way (`AuxConfig.rule`)
            return self.rule.decide(messages, open_cursors)
        if self.trigger_style == "scores":
            return self.scores_decision(url, history, messages, message_ids, cache, open_cursors, timeout)
        if self.min_confidence is not None:
            return self.confident_decision(url, history, messages, message_ids, cache, open_cursors, timeout)
        built = self._fork_request(history, messages, message_ids, cache, open_cursors)
        if built is None:
            return AuxDecision([], PREFIX + LIST_OPEN + "]}", 0)
        body, fork_input = built
        return self.decision(self._post(url, body, history, fork_input, timeout)["output_ids"])

    def confident_decision(self, url: str, history, messages: list[dict], message_ids: list[list[int]],
                           cache: dict | None, open_cursors: list[int], timeout: float = 600,
                           prune: float = PRUNE, max_forwards: int = MAX_BRANCH_FORWARDS) -> AuxDecision:
        """The confidence rule on the server at `url`: `branch_walk` driven by one request per branch state (a
        state's handle is its tail of tokens after the opener)."""
        deletable = self.deletable(messages, open_cursors)
        if not deletable:
            return AuxDecision([], PREFIX + LIST_OPEN + "]}", 0)
        cand = _candidates(self.tokenizer)[0]

        def logits(tail: list[int]) -> torch.Tensor:
            body, fork_input = self._branch_request(history, messages, message_ids, cache, open_cursors, tail)
            (row,) = self._post(url, body, history, fork_input, timeout)["meta_info"]["output_token_ids_logprobs"]
            logprob = {int(tid): float(lp) for lp, tid, *_ in row}
            return torch.tensor([logprob[t] for t in cand], dtype=torch.float32)

        walk = branch_walk(self.tokenizer, deletable, self.min_confidence, self.max_tokens, self.close_bias, prune,
                           max_forwards)
        try:
            request = next(walk)
            while True:
                parent, token, _ = request
                tail = [] if token is None else [*parent, token]
                request = walk.send((tail, logits(tail)))
        except StopIteration as stop:
            return stop.value
