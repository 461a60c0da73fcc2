"""The `support` environment: a customer-support agent working tickets against order records and a knowledge base.

The agent reads tickets, customer records and orders, searches the knowledge base and opens articles
(`support_world` holds the world, the case files and the tools' response formats). Four task families with
different dependency shapes:

- `resolve` (chain + detours + selective recap): "Resolve ticket T-4821: draft the reply." ticket → order and
  customer record (either order; when the ticket gives no order id, the record's orders are walked until the one
  holding the item the message names) → earlier tickets listed on the record → KB search (issue from the ticket,
  category of the affected item from the order; sometimes right after the order) → articles until the one whose
  scope covers (issue, category) → its related article, if any. The reply restates the order status, the clause,
  the tier only for gold members, earlier tickets only when they concern the same order, and a form code only when
  the related article is a form. The task shares only the ticket id with the responses; the ticket itself expires
  once the search is written.
- `returns` (fan-out + criterion): "Today is D. Mara Voss wants to return a furniture item. Which order can still be
  returned?" record → return-policy search → the article for that category → every order on the record (or the
  orders before the articles, or before the search). Only the order that has a furniture item, is delivered and
  sits inside the (gold-dependent) window is read at the end; orders that could qualify wait for the step that
  reads the policy; the record is read while an order is unfetched and until the policy is applied, then only when
  its gold line applies.
- `followup` (a late question re-reads an old response): a `resolve` session, the reply, then the user asks about
  another item of the same order. The order is needed again (the new item's category is only there), the first
  article only when the user asks whether "the same clause" covers it; part one's other responses stay expired.
- `triage` (chains, the later response decides the earlier): "Which of Mara Voss's open tickets is about a furniture
  item / an order that has not arrived?" record → (ticket → its order) per open ticket. A ticket is kept exactly
  when its order (read after it) meets the criterion: for categories it is the item the ticket names that counts,
  not the order's other items.

After every response the agent's note is `grammar.note` (a restatement of the response that leaves out what decides
its fate, a neutral acknowledgement or a random relevance claim, by a per-trace `NoteStyle`), optionally followed by
a phrasing of its next call. Right and wrong articles get the same notes; the same calls produce kept and expired
responses (`get_order`: the resolve order vs. a non-qualifying return; `open_article`: the policy vs. a detour;
`get_ticket`: a same-order earlier ticket vs. another one).

Cues (`Trace.cues`, one per response; when the script reads it again):

| cue | response | read again |
|---|---|---|
| `ticket` | the ticket being resolved | until the KB search is written |
| `account` | customer record | while a listed item is unfetched; at a reply for gold; returns: see above |
| `matches` | a name lookup listing namesakes | never |
| `order` | the resolved ticket's order | at every reply |
| `results` | KB search results | until the applicable article is open |
| `wrong_article` | an article that does not cover (issue, category) | never |
| `policy` | the applicable article | at the reply / final; in a follow-up only for a "same clause" question |
| `form` / `related_info` | the policy's related article | form: at the reply; info: never |
| `prior_same` / `prior_other` | an earlier ticket on the record | same order: at every reply; other order: never |
| `order_match` / `order_other` | returns / triage orders | match: at the final; other: candidates wait |
| `ticket_match` / `ticket_other` | triage open tickets | match: at the final; other: right after its order |
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvsteward.synth.rng import mix, rng
from kvsteward.synth.traces.envs.base import Recorder
from kvsteward.synth.traces.envs.support_world import (
    CATEGORIES,
    ISSUE_LABEL,
    ISSUE_WORDS,
    Article,
    Customer,
    Order,
    Ticket,
    World,
    build_worlds,
    day,
    make_order,
    make_ticket,
    order_status,
    random_today,
    render_article,
    render_customer,
    render_matches,
    render_order,
    render_results,
    render_ticket,
    titles_issues,
)
from kvsteward.synth.traces.generate import split_of
from kvsteward.synth.traces.grammar import NoteStyle, join, note, say
from kvsteward.synth.traces.trace import Trace

__all__ = ["CUES", "FAMILIES", "Options", "SYSTEM_PROMPT", "generate"]

ENV = "support"
FAMILIES = ("resolve", "returns", "followup", "triage")
CUES = ("ticket", "account", "matches", "order", "results", "wrong_article", "policy", "form", "related_info",
        "prior_same", "prior_other", "order_match", "order_other", "ticket_match", "ticket_other")

SYSTEM_PROMPT = (
    "You are a customer-support agent; use the tools, never guess. Tools: get_ticket, lookup_customer (id or "
    "name), get_order, search_kb, open_article. Call one with a <tool_call> block: {\"name\": ..., "
    "\"arguments\": {...}}; results start with [cursor N].\n"
    "A ticket reply quotes the order status and the applicable clause, names the tier of gold members and "
    "mentions earlier tickets on the same order. End with 'Final answer: ...'."
)


@dataclass
class Options:
    detour_rate: float = 0.35  # chance of opening a wrong candidate article first (a second one at half the rate)
    top_k: int = 5  # search results listed
    world_size: int = 2000  # customers per split
    ambiguity_rate: float = 0.5  # chance a named customer has a namesake (the lookup lists both)
    action_rate: float = 0.7  # chance the agent's note is followed by a sentence naming its next call
    families: str = ",".join(FAMILIES)  # comma-separated task families, drawn uniformly

    def family_list(self) -> list[str]:
        return [f.strip() for f in self.families.split(",") if f.strip()]

    def validate(self) -> None:
        for name in ("detour_rate", "ambiguity_rate", "action_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 3 <= self.top_k <= 10:
            raise ValueError(f"top_k must be in 3..10, got {self.top_k}")
        if not 50 <= self.world_size <= 3000:  # 3 splits x 3000 names out of 11,200 first-last pairs
            raise ValueError(f"world_size must be in 50..3000, got {self.world_size}")
        fams = self.family_list()
        bad = [f for f in fams if f not in FAMILIES]
        if not fams or bad:
            raise ValueError(f"families: unknown {bad or self.families!r}; choose from {', '.join(FAMILIES)}")


class Retry(Exception):
    """The drawn case does not fit the family's constraints: draw another (same task rng, so still deterministic)."""


# --- phrasings --------------------------------------------------------------------------------------------------

ACTIONS = {
    "get_ticket": ("Opening ticket {x}.", "Let me pull up {x}.", "Checking ticket {x}.", "Fetching {x}.",
                   "Looking at ticket {x}.", "Now {x}."),
    "get_order": ("Fetching order {x}.", "Let me look at {x}.", "Checking order {x}.", "Pulling up order {x}.",
                  "Next, order {x}.", "Order {x} now."),
    "lookup_customer": ("Looking up {x}.", "Checking the account: {x}.", "Fetching the customer record for {x}.",
                        "Let me find {x}.", "Customer lookup: {x}.", "Searching the customers for {x}."),
    "search_kb": ('Searching the KB for "{x}".', 'KB search: "{x}".', 'Let me search "{x}".',
                  'Querying the knowledge base: "{x}".', 'Looking for the policy: "{x}".', 'Trying "{x}".'),
    "open_article": ("Opening {x}.", "Reading {x}.", "Let me read {x}.", "Checking {x}.", "Next: {x}.",
                     "Let me see {x}."),
}
INFO = {
    "ticket": ("{tid} is a {issue} about the {item}, order {oid}.", "Ticket {tid}: {issue}, order {oid}.",
               "The customer reports a {issue} on order {oid}.", "{tid} concerns the {item} ({issue}).",
               "Order {oid}, {issue}; customer {cid}.", "{tid} was filed by {cid} about order {oid}."),
    "order": ("{oid}: {n}.", "Order {oid} is {status}.", "{oid} holds the {item}.",
              "{status}; {n}.", "{oid} lists {items}.", "Order {oid}, customer {cid}."),
    "account": ("{name}, account {cid}.", "Account {cid} belongs to {name}.", "{name} from {city}.",
                "{cid}: {n} orders on file.", "Found the account of {name}.", "{name} ({cid}), {city}."),
    "matches": ("{n} customers are called {name}.", "Several accounts match {name}.", "{name} matches {n} accounts.",
                "More than one {name} on file.", "The name {name} is shared by {n} customers."),
    "results": ("{n} articles; {first} is first.", "The top hit is {first}.", "Results: {ids}.",
                "{n} hits for that query.", "The list starts with {first} ({title})."),
    "policy": ("{kid} covers {issue} for {scope}; clause {clause}.", "{kid}: clause {clause}, {window} days.",
               "{kid} is about {issue} ({scope}).", "Clause {clause} in {kid}, scope {scope}.",
               "{kid} gives a {window}-day window.", "{kid} applies to {scope} orders."),
    "form": ("{kid} gives form code {code}.", "Form {code} is in {kid}.", "{kid}: {title}, code {code}.",
             "{kid} is the form page.", "The form code is {code}."),
    "info": ("{kid} is general help: {title}.", "{kid}: {title}.", "{kid} is a help page.",
             "{kid} has general advice.", "A general article, {kid}."),
}
TASKS = {
    "resolve": ("Resolve ticket {tid}: draft the reply.", "Please handle ticket {tid} and write the customer a reply.",
                "Ticket {tid} needs an answer. Draft it.", "Work ticket {tid}: what do we tell the customer?",
                "Draft the reply for ticket {tid}, following the policy.",
                "Can you resolve {tid}? I need a reply I can send."),
    "returns": ("Today is {today}. {who} wants to return a {cat} item. Which order can still be returned?",
                "It is {today}. {who} asks which order with {cat} in it is still inside the return window.",
                "Date: {today}. Which order of {who} can still be sent back for its {cat} item?",
                "{who} would like to return something from the {cat} range (today is {today}). Which order "
                "qualifies?",
                "As of {today}, which order of {who} can still be returned? They mean the {cat} item."),
    "triage_cat": ("{who} has several open tickets. Which one is about a {cat} item?",
                   "Of {who}'s open tickets, which concerns {cat}?",
                   "Find the open ticket of {who} that is about their {cat} purchase.",
                   "{who} wrote in more than once. Which open ticket covers a {cat} item?",
                   "Which of the open tickets from {who} is for something in {cat}?"),
    "triage_undelivered": ("{who} has several open tickets. Which one is about an order that has not been "
                           "delivered yet?",
                           "Of {who}'s open tickets, which concerns an order still on its way?",
                           "Which open ticket of {who} is about an undelivered order?",
                           "{who} wrote in more than once. Which open ticket is about an order that hasn't arrived?",
                           "Find the open ticket of {who} whose order is not delivered yet."),
}
SYMPTOMS = {
    "damaged": ("the {item} from that order arrived damaged as well", "the {item} in that order is broken too",
                "the {item} from that parcel came dented"),
    "late": ("the {item} from that order has not arrived either", "they are also still waiting for the {item}",
             "the {item} is late too"),
    "wrong": ("the {item} in that order turned out to be the wrong product",
              "they got something else instead of the {item} too",
              "the {item} in the parcel is not what they paid for"),
    "refund": ("they would also like to return the {item} from that order", "they want a refund for the {item} too",
               "they no longer need the {item} from that order"),
    "warranty": ("the {item} from that order has stopped working", "the {item} in that order developed a fault",
                 "the {item} they got in that order has a fault now"),
}
# Only the "compare" questions contain the word "same" (the content reader keys on it; symptoms never do).
QUESTIONS = {
    "compare": ("Is that covered by the same clause?", "Does the same clause apply?", "Same policy as before?",
                "Can we handle it under the same clause you quoted?", "Is it the same clause?"),
    "plain": ("What applies there?", "Which clause covers that?", "What should we tell them?",
              "What's the policy for that one?", "How do we handle it?"),
}
FOLLOWUP_INTRO = ("Thanks. The customer writes back: {s}. {q}", "One more thing: {s}. {q}", "Update from the "
                  "customer: {s}. {q}", "They replied that {s}. {q}", "Follow-up on this ticket: {s}. {q}")


# --- the agent --------------------------------------------------------------------------------------------------

@dataclass
class Agent:
    """Writes one trace: each call's text is the note on the previous response plus (maybe) a phrasing of the call;
    `reads` are given by the family script (the previous response always, plus what the step uses)."""

    world: World
    opts: Options
    r: random.Random
    rec: Recorder = field(default_factory=lambda: Recorder(SYSTEM_PROMPT))
    style: NoteStyle = field(default_factory=NoteStyle)
    info: str = ""  # the informative note on the last response
    last: int | None = None  # the last response (unread until the next step)
    docs: set[str] = field(default_factory=set)
    entities: set[str] = field(default_factory=set)
    hits: list[Article] = field(default_factory=list)  # the last search's results
    opened: dict[str, int] = field(default_factory=dict)  # article id -> its cursor

    def text(self, action: str = "") -> str:
        head = note(self.r, self.info, self.style) if self.last is not None else ""
        return join(head, action if self.r.random() < self.opts.action_rate or not head else "")

    def call(self, name: str, arg: str, body: str, cue: str, info: str, reads: set[int] | None = None) -> int:
        key = {"get_ticket": "ticket_id", "get_order": "order_id", "lookup_customer": "query",
               "search_kb": "query", "open_article": "article_id"}[name]
        step_reads = set(reads or ())
        if self.last is not None:
            step_reads.add(self.last)
        c = self.rec.call(self.text(say(self.r, ACTIONS[name], x=arg)), step_reads, name, {key: arg}, body, cue)
        self.last, self.info = c, info
        return c

    def reply(self, text: str, reads: set[int]) -> int:
        """An assistant message without a call (a reply or the final answer), reading `reads` and the last response."""
        head = note(self.r, self.info, self.style) if self.last is not None else ""
        step = self.rec.assistant(join(head, text), reads | ({self.last} if self.last is not None else set()))
        self.last, self.info = None, ""
        return step

    # --- tools, rendered and noted ------------------------------------------------------------------------------
    def get_ticket(self, t: Ticket, cue: str, reads: set[int] | None = None) -> int:
        self.docs.update((t.tid, t.cid, t.oid))
        self.entities.add(t.item)
        info = say(self.r, INFO["ticket"], tid=t.tid, issue=ISSUE_LABEL[t.issue], item=t.item, oid=t.oid, cid=t.cid)
        return self.call("get_ticket", t.tid, render_ticket(self.r, t), cue, info, reads)

    def get_order(self, o: Order, cue: str, reads: set[int] | None = None) -> int:
        self.docs.update((o.oid, o.cid))
        self.entities.update(i.product.name for i in o.items)
        names = [i.product.name for i in o.items]
        n = "one product" if len(o.items) == 1 else f"{len(o.items)} products"
        info = say(self.r, INFO["order"], oid=o.oid, n=n, status=order_status(o), item=names[0],
                   items=", ".join(names), cid=o.cid)
        return self.call("get_order", o.oid, render_order(self.r, o), cue, info, reads)

    def lookup(self, query: str, c: Customer, orders: list[str], tickets: list[tuple[str, str]],
               reads: set[int] | None = None) -> int:
        self.docs.update([c.cid, *orders, *(t for t, _ in tickets)])
        self.entities.add(c.name)
        info = say(self.r, INFO["account"], name=c.name, cid=c.cid, city=c.city, n=len(orders))
        return self.call("lookup_customer", query, render_customer(self.r, c, orders, tickets), "account", info, reads)

    def lookup_matches(self, name: str, matches: list[Customer]) -> int:
        self.docs.update(m.cid for m in matches)
        self.entities.add(name)
        info = say(self.r, INFO["matches"], n=len(matches), name=name)
        return self.call("lookup_customer", name, render_matches(name, matches), "matches", info)

    def search(self, query: str, hits: list[Article], reads: set[int]) -> int:
        self.docs.update(a.kid for a in hits)
        info = say(self.r, INFO["results"], n=len(hits), first=hits[0].kid, ids=", ".join(a.kid for a in hits[:3]),
                   title=hits[0].title)
        return self.call("search_kb", query, render_results(query, hits), "results", info, reads)

    def open_article(self, a: Article, cue: str, reads: set[int]) -> int:
        self.docs.update(x for x in (a.kid, a.related) if x)
        if a.form_code:
            self.docs.add(a.form_code)
            info = say(self.r, INFO["form"], kid=a.kid, code=a.form_code, title=a.title)
        elif not a.issue:
            info = say(self.r, INFO["info"], kid=a.kid, title=a.title)
        else:
            self.docs.add(a.clause)
            info = say(self.r, INFO["policy"], kid=a.kid, issue=ISSUE_LABEL[a.issue], scope=", ".join(a.scope),
                       clause=a.clause, window=a.window)
        c = self.call("open_article", a.kid, render_article(self.r, a), cue, info, reads)
        self.opened[a.kid] = c
        return c

    # --- shared script pieces -----------------------------------------------------------------------------------
    def search_for(self, issue: str, category: str, reads: set[int]) -> int:
        """The KB search for (issue, category); `reads`: the responses the query's words come from."""
        w, r = self.world, self.r
        query = f"{r.choice(ISSUE_WORDS[issue])} {category}"
        self.hits = w.search(query, self.opts.top_k, issue, category, mix(w.split, issue, category, r.random()))
        return self.search(query, self.hits, reads)

    def open_policy(self, issue: str, category: str, lst: int, check: set[int], skip: set[str],
                    after: set[int] = frozenset()) -> tuple[Article, int, int | None]:
        """Open candidates from the result list `lst` until the article covering (issue, category), then its related
        article. `check`: what judging an article uses besides it; `after`: what the step after the policy reads
        (an evaluation against it). Returns (policy, its cursor, the related article's cursor or None)."""
        w, r = self.world, self.r
        right = w.policy(issue, category)
        cands = [a for a in self.hits
                 if a is not right and a.kid not in skip and a.issue and issue in titles_issues(a.title)]
        r.shuffle(cands)
        n_wrong = 0
        if cands and r.random() < self.opts.detour_rate:
            n_wrong = 2 if len(cands) > 1 and r.random() < self.opts.detour_rate / 2 else 1
        for a in cands[:n_wrong]:
            self.open_article(a, "wrong_article", {lst} | check)
        pc = self.open_article(right, "policy", {lst} | check)
        rel = None
        if right.related:
            ra = w.articles[right.related]
            rel = self.open_article(ra, "form" if ra.form_code else "related_info", {pc} | set(after))
        return right, pc, rel

    def find_policy(self, issue: str, category: str, reads: set[int], check: set[int],
                    skip: set[str]) -> tuple[Article, int, int | None]:
        """Search, then open candidates until the policy (see `open_policy`)."""
        lst = self.search_for(issue, category, reads)
        return self.open_policy(issue, category, lst, check, skip)

    def customer_query(self, c: Customer) -> str:
        """How the task names `c`: the name, with the city when a namesake exists."""
        return f"{c.name} from {c.city}" if len(self.world.namesakes[c.name]) > 1 else c.name

    def find_customer(self, c: Customer, orders: list[str], tickets: list[tuple[str, str]]) -> int:
        same = self.world.namesakes[c.name]
        if len(same) > 1:
            self.lookup_matches(c.name, same)
            return self.lookup(c.cid, c, orders, tickets)
        return self.lookup(c.name, c, orders, tickets)


# --- families ---------------------------------------------------------------------------------------------------

@dataclass
class Task:
    question: str
    answer: str
    kind: str


def _pick_customer(agent: Agent, r: random.Random, want_namesake: bool | None = None) -> Customer:
    w = agent.world
    if want_namesake is None:
        want_namesake = r.random() < agent.opts.ambiguity_rate
    pool = [c for c in w.customers if (len(w.namesakes[c.name]) > 1) == want_namesake and
            len({x.city for x in w.namesakes[c.name]}) == len(w.namesakes[c.name])]
    return r.choice(pool or w.customers)


def _resolve_case(agent: Agent, r: random.Random, n_prior: int, need_two_items: bool = False):
    """A ticket, its order and customer, and `n_prior` earlier (closed) tickets on the same or other orders."""
    w = agent.world
    c = _pick_customer(agent, r, want_namesake=False)
    today = random_today(r)
    issue = r.choice(("damaged", "late", "wrong", "refund", "warranty"))
    status = "in transit" if issue == "late" else "delivered"
    cat = r.choice(list(CATEGORIES))
    item = r.choice(w.products[cat])
    used_o, used_t = set(), set()
    order = make_order(r, w, c, today, used_o, status, must=item)
    if need_two_items and len(order.items) < 2:
        raise Retry
    ticket = make_ticket(r, w, c, order, issue, item, used_t)
    priors, orders = [], [order]
    for _ in range(n_prior):
        if r.random() < 0.35:
            po = order
        else:
            po = make_order(r, w, c, today, used_o, "delivered")
            orders.append(po)
        pit = r.choice(po.items).product
        priors.append(make_ticket(r, w, c, po, r.choice(("damaged", "wrong", "refund", "warranty")), pit, used_t,
                                  "closed"))
    no_id = r.random() < 0.35  # the ticket does not name the order: the agent walks the account's orders
    if r.random() < 0.5 or (no_id and len(orders) < 2):
        orders.append(make_order(r, w, c, today, used_o, r.choice(("delivered", "cancelled", "processing"))))
    if no_id:
        if any(item in (i.product for i in o.items) for o in orders if o is not order):
            raise Retry  # the item must single out its order
        ticket = replace(ticket, order_given=False)
    r.shuffle(orders)
    tickets = [(ticket.tid, "open")] + [(p.tid, "closed") for p in priors]
    r.shuffle(tickets)
    return c, order, ticket, priors, orders, tickets, item


def _resolve_part(agent: Agent, c: Customer, order: Order, ticket: Ticket, priors: list[Ticket],
                  orders: list[Order], tickets: list[tuple[str, str]]) -> dict:
    """The resolve script up to (not including) the reply; returns the cursors the reply reads."""
    r = agent.r
    order_ids = [o.oid for o in orders]
    t = agent.get_ticket(ticket, "ticket")
    cat = next(i.product.category for i in order.items if i.product.name == ticket.item)
    search_early = r.random() < 0.5  # the KB search right after the order, before the account and its tickets
    found: dict[str, int] = {}
    if not ticket.order_given:  # the account first, then its orders in list order until the one with the item
        found["account"] = agent.lookup(c.cid, c, order_ids, tickets, {t})
        for o in orders:
            if o is not order:
                agent.get_order(o, "order_other", {found["account"]})
                continue
            found["order"] = agent.get_order(order, "order", {found["account"]})
            if search_early:
                found["results"] = agent.search_for(ticket.issue, cat, {t, found["order"]})
            break
    for what in r.sample(("order", "account"), 2) if ticket.order_given else ():
        if what == "order":
            found["order"] = agent.get_order(order, "order", {t})
            if search_early:
                found["results"] = agent.search_for(ticket.issue, cat, {t, found["order"]})
        else:  # the customer id comes from the order when it is open, else from the ticket
            found["account"] = agent.lookup(c.cid, c, order_ids, tickets, {found.get("order", t)})
    o, a = found["order"], found["account"]
    same = []
    for p in priors:
        pc = agent.get_ticket(p, "prior_same" if p.oid == order.oid else "prior_other", {a, o})
        if p.oid == order.oid:
            same.append(pc)
    if not search_early:
        found["results"] = agent.search_for(ticket.issue, cat, {t, o})
    right, pc, rel = agent.open_policy(ticket.issue, cat, found["results"], {o}, set())
    form = rel if rel is not None and agent.world.articles[right.related].form_code else None
    reads = {pc, o} | set(same) | ({a} if c.tier == "gold" else set()) | ({form} if form is not None else set())
    return {"policy": right, "policy_cursor": pc, "reads": reads, "order": o, "account": a, "same": same,
            "form": form}


def _reply_text(r: random.Random, c: Customer, order: Order, policy: Article, item: str, priors: list[Ticket],
                form: Article | None, lead: str = "") -> str:
    parts = [lead or r.choice(("Reply:", "Draft reply:", "Here is the reply:", "Reply to the customer:",
                               "Proposed reply:")),
             r.choice(("Hello, thank you for writing.", "Hi, thanks for contacting us.", "Dear customer,",
                       "Hello, and sorry for the trouble.", "Thanks for reaching out."))]
    if c.tier == "gold":
        parts.append(r.choice((f"As a {c.tier} member you are a priority for us.",
                               f"Thank you for being a {c.tier} member.", f"Your {c.tier} membership is noted.")))
    parts.append(f"Your order {order.oid} is {order_status(order)}.")
    for p in priors:
        parts.append(f"We also see your earlier ticket {p.tid} about this order ({p.resolution}).")
    days = policy.window_for(c.tier)
    parts.append(r.choice((f"For the {item}, clause {policy.clause} applies ({days}-day window).",
                           f"Clause {policy.clause} covers the {item}: {days} days.",
                           f"Under clause {policy.clause} ({days} days) we handle the {item}.")))
    if form is not None:
        parts.append(f"Please use form {form.form_code}.")
    return " ".join(parts)


def family_resolve(agent: Agent, r: random.Random) -> Task:
    n_prior = r.choice((1, 1, 2, 2, 3))
    c, order, ticket, priors, orders, tickets, item = _resolve_case(agent, r, n_prior)
    q = say(r, TASKS["resolve"], tid=ticket.tid)
    agent.rec.user(q)
    got = _resolve_part(agent, c, order, ticket, priors, orders, tickets)
    if len(agent.rec.cues) < 6:
        raise Retry
    p = got["policy"]
    form = agent.world.articles[p.related] if got["form"] is not None else None
    same = [x for x in priors if x.oid == order.oid]
    text = _reply_text(r, c, order, p, item.name, same, form) + f"\nFinal answer: {p.clause}"
    agent.reply(text, got["reads"])
    return Task(q, p.clause, "resolve")


def family_followup(agent: Agent, r: random.Random) -> Task:
    w = agent.world
    n_prior = r.choice((0, 0, 1))
    c, order, ticket, priors, orders, tickets, item = _resolve_case(agent, r, n_prior, need_two_items=True)
    cat1 = item.category
    p1 = w.policy(ticket.issue, cat1)
    others = [i.product for i in order.items if i.product.name != item.name]
    item2 = r.choice(others)
    issue2 = "late" if order.status == "in transit" else r.choice(("damaged", "wrong", "refund", "warranty"))
    p2 = w.policy(issue2, item2.category)
    if p2 is p1:
        raise Retry
    q = say(r, TASKS["resolve"], tid=ticket.tid)
    agent.rec.user(q)
    got = _resolve_part(agent, c, order, ticket, priors, orders, tickets)
    opened = set(agent.opened)  # never opened again, nor read again: part two opens its own related article
    if p2.kid in opened:
        raise Retry
    same = [x for x in priors if x.oid == order.oid]
    form1 = w.articles[p1.related] if got["form"] is not None else None
    agent.reply(_reply_text(r, c, order, p1, item.name, same, form1), got["reads"])
    kind = r.choice(("compare", "plain"))
    follow = say(r, FOLLOWUP_INTRO, s=say(r, SYMPTOMS[issue2], item=item2.name), q=say(r, QUESTIONS[kind]))
    agent.rec.user(follow)
    o = got["order"]
    right, pc, rel = agent.find_policy(issue2, item2.category, {o}, {o}, opened)
    form2 = w.articles[right.related] if rel is not None and w.articles[right.related].form_code else None
    reads = ({pc, o} | set(got["same"]) | ({got["account"]} if c.tier == "gold" else set())
             | ({rel} if form2 is not None else set()))
    lead = ""
    if kind == "compare":
        reads.add(got["policy_cursor"])
        if item2.category in p1.scope:  # same category, another issue
            why = f"is about a {ISSUE_LABEL[p1.issue]}, and this is a {ISSUE_LABEL[issue2]}"
        else:
            why = f"covers {', '.join(p1.scope)} only, and the {item2.name} is {item2.category}"
        lead = f"No: clause {p1.clause} {why}. Reply:"
    text = _reply_text(r, c, order, right, item2.name, same, form2, lead) + f"\nFinal answer: {right.clause}"
    agent.reply(text, reads)
    return Task(f"{q}\n{follow}", right.clause, "followup")


def _returns_case(agent: Agent, r: random.Random):
    w = agent.world
    c = _pick_customer(agent, r)
    cat = r.choice(list(CATEGORIES))
    policy = w.policy("refund", cat)
    window = policy.window_for(c.tier)
    today = random_today(r)
    used: set[str] = set()
    target_item = r.choice(w.products[cat])
    target = make_order(r, w, c, today, used, "delivered", must=target_item,
                        when=today - dt.timedelta(days=r.randint(0, window)))
    orders = [target]
    for _ in range(r.randint(2, 4)):
        kind = r.choice(("late_window", "late_window", "undelivered", "other_cat", "other_cat"))
        if kind == "late_window":
            orders.append(make_order(r, w, c, today, used, "delivered", must=r.choice(w.products[cat]),
                                     when=today - dt.timedelta(days=r.randint(window + 1, window + 80))))
        elif kind == "undelivered":
            orders.append(make_order(r, w, c, today, used, r.choice(("in transit", "processing", "cancelled",
                                                                     "returned")), must=r.choice(w.products[cat])))
        else:
            orders.append(make_order(r, w, c, today, used, r.choice(("delivered", "delivered", "in transit")),
                                     avoid={cat}))
    r.shuffle(orders)
    return c, cat, policy, today, orders, target


def family_returns(agent: Agent, r: random.Random) -> Task:
    c, cat, policy, today, orders, target = _returns_case(agent, r)
    who = agent.customer_query(c)
    q = say(r, TASKS["returns"], today=day(today), who=who, cat=cat)
    agent.rec.user(q)
    a = agent.find_customer(c, [o.oid for o in orders], [])
    # policy first, or the search then the orders then the articles, or the orders first: the orders that could
    # qualify (a `cat` item, delivered) wait for the window, the others are settled as soon as they are read
    plan = r.choice(("policy_first", "policy_first", "search_first", "orders_first"))
    cursors: dict[int, int] = {}
    candidates = [o for o in orders if o.status == "delivered" and cat in o.categories()]

    def fetch(pc: int | None) -> None:
        for o in orders:
            cursors[id(o)] = agent.get_order(o, "order_match" if o is target else "order_other",
                                             {a} | ({pc} if pc is not None else set()))

    if plan == "orders_first":
        fetch(None)
    lst = agent.search_for("refund", cat, set())
    if plan == "search_first":
        fetch(None)
    evaluate = {a} | ({cursors[id(o)] for o in candidates} if plan != "policy_first" else set())
    right, pc, rel = agent.open_policy("refund", cat, lst, set(), set(), after=evaluate)
    if plan == "policy_first":
        fetch(pc)
    form = rel if rel is not None and agent.world.articles[right.related].form_code else None
    tier_used = right.tier_applies(c.tier)
    reads = {cursors[id(target)], pc} | ({a} if tier_used else set()) | ({form} if form is not None else set())
    if rel is None and plan != "policy_first":
        reads |= evaluate  # the final step is the one right after the policy: it evaluates the candidates
    item = next(i.product.name for i in target.items if i.product.category == cat)
    days = right.window_for(c.tier)
    why = f"as a {c.tier} member {c.name} gets {days} days" if tier_used else f"the window is {days} days"
    text = join(r.choice(("Checked every order.", "All orders checked.", "Everything is checked.",
                          "Done with the orders.", "Every order is reviewed.")),
                f"{target.oid} has the {item}, {order_status(target)}; under clause {right.clause} {why}, so it "
                f"can still be returned.",
                f"Use form {agent.world.articles[right.related].form_code}." if form is not None else "",
                r.choice(("The other orders do not qualify.", "None of the others qualifies.", "Only this one fits.",
                          "No other order qualifies.", "The rest are out.")))
    agent.reply(text + f"\nFinal answer: {target.oid}", reads)
    return Task(q, target.oid, "returns")


def _triage_case(agent: Agent, r: random.Random, criterion: str, cat: str):
    w = agent.world
    c = _pick_customer(agent, r)
    today = random_today(r)
    used_o, used_t = set(), set()
    n = r.choice((3, 3, 4))
    pairs = []
    for k in range(n):
        match = k == 0
        if criterion == "category":
            item = r.choice(w.products[cat]) if match else r.choice(
                w.products[r.choice([x for x in CATEGORIES if x != cat])])
            status = r.choice(("delivered", "delivered", "in transit"))
            issue = "late" if status == "in transit" else r.choice(("damaged", "wrong", "refund", "warranty"))
            # a non-matching ticket's order may hold a `cat` item too: only the item the ticket names counts
            extra = r.choice(w.products[cat]) if not match and r.random() < 0.4 else None
            o = make_order(r, w, c, today, used_o, status, must=item, extra=extra)
        else:
            status = r.choice(("in transit", "processing")) if match else "delivered"
            issue = ("late" if status != "delivered" else r.choice(("damaged", "wrong", "refund", "warranty")))
            if not match and r.random() < 0.35:
                issue = "late"  # complained about the delay; the parcel has arrived since
            o = make_order(r, w, c, today, used_o, status)
            item = r.choice(o.items).product
        pairs.append((make_ticket(r, w, c, o, issue, item, used_t), o, match))
    if criterion == "category" and sum(_item_cat(t, o) == cat for t, o, _ in pairs) != 1:
        raise Retry
    r.shuffle(pairs)
    closed = []
    if r.random() < 0.5:
        po = make_order(r, w, c, today, used_o, "delivered")
        closed.append(make_ticket(r, w, c, po, "damaged", r.choice(po.items).product, used_t, "closed"))
    return c, pairs, closed


def _item_cat(t: Ticket, o: Order) -> str:
    return next(i.product.category for i in o.items if i.product.name == t.item)


def family_triage(agent: Agent, r: random.Random) -> Task:
    criterion = r.choice(("category", "undelivered"))
    cat = r.choice(list(CATEGORIES))
    c, pairs, closed = _triage_case(agent, r, criterion, cat)
    who = agent.customer_query(c)
    q = say(r, TASKS["triage_cat" if criterion == "category" else "triage_undelivered"], who=who, cat=cat)
    agent.rec.user(q)
    tickets = [(t.tid, "open") for t, _, _ in pairs] + [(t.tid, "closed") for t in closed]
    r.shuffle(tickets)
    open_order = [tid for tid, s in tickets if s == "open"]
    by_id = {t.tid: (t, o, m) for t, o, m in pairs}
    orders = [by_id[tid][1].oid for tid in open_order] + [t.oid for t in closed]
    a = agent.find_customer(c, orders, tickets)
    keep: set[int] = set()
    prev: set[int] = set()
    answer = None
    for tid in open_order:
        t, o, match = by_id[tid]
        tc = agent.get_ticket(t, "ticket_match" if match else "ticket_other", {a} | prev)
        oc = agent.get_order(o, "order_match" if match else "order_other", {tc})
        prev = {tc}
        if match:
            keep, answer = {tc, oc}, (t, o)
    t, o = answer
    if criterion == "category":
        why = f"it is about the {t.item}, a {cat} item in order {o.oid}"
    else:
        why = f"its order {o.oid} is {order_status(o)}"
    text = join(r.choice(("All open tickets checked.", "That covers the open tickets.", "Every open ticket is read.",
                          "Done with the tickets.", "Those were all the open ones.")),
                f"{t.tid} ({ISSUE_LABEL[t.issue]}) is the one: {why}.",
                r.choice(("The others do not match.", "No other open ticket fits.", "The rest are about something "
                          "else.", "Only this one matches.", "None of the others qualifies.")))
    agent.reply(text + f"\nFinal answer: {t.tid}", keep | prev)
    return Task(q, t.tid, "triage")


FAMILY_FNS: dict[str, Callable[[Agent, random.Random], Task]] = {
    "resolve": family_resolve, "returns": family_returns, "followup": family_followup, "triage": family_triage}


# --- entry point ------------------------------------------------------------------------------------------------

def _one(world: World, opts: Options, seed: int, i: int) -> tuple[Agent, Task, int]:
    fams = opts.family_list()
    task_seed = mix(seed, ENV, i)
    r = rng(seed, ENV, i)
    family = fams[r.randrange(len(fams))]
    for _ in range(200):
        agent = Agent(world, opts, r, style=NoteStyle.draw(r))
        try:
            return agent, FAMILY_FNS[family](agent, r), task_seed
        except Retry:
            continue
    raise RuntimeError(f"task {i}: no {family} case fits after 200 draws")


def generate(n_tasks: int, seed: int, options: Options, progress: Callable[[int], None] | None = None) -> list[Trace]:
    """`n_tasks` correct traces; task i is in split `split_of(i)` and uses its own rng (seed, "support", i)."""
    options.validate()
    worlds = build_worlds(seed, options.world_size)
    traces = []
    for i in range(n_tasks):
        split = split_of(i)
        agent, task, task_seed = _one(worlds[split], options, seed, i)
        hops = sum(1 for cue in agent.rec.cues.values() if cue not in ("wrong_article", "matches"))
        traces.append(agent.rec.trace(
            task_id=f"s{seed}-{ENV}-t{i:05d}", split=split, env=ENV, task_seed=task_seed, question=task.question,
            answer=task.answer, kind=task.kind, hops=hops, docs=sorted(agent.docs), entities=sorted(agent.entities)))
        if progress:
            progress(i + 1)
    return traces

