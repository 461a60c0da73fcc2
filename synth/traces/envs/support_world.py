"""The `support` environment's world: customers, products and a knowledge base per split, and per-task case files.

One `World` per split holds the split's registry: customers (id, name, city, tier; some pairs share a name),
products (a split-only brand + a noun of one category) and knowledge-base articles (id, title, what they cover, a
policy clause with a code and a window in days, sometimes a gold line or a related article). Orders and tickets are
drawn per task from the split's id pools (`World.order_ids` / `ticket_ids`, no id twice in a trace), so a case file
is consistent within its trace and every id, name and code of one split is absent from the others (the pools and
name registries are split by construction).

The `render_*` functions are the tools' response formats: a few compact lines each, with the order of the optional
lines varied by the caller's rng, as a real back office would print them.
"""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass, field

from kvsteward.synth.rng import mix, rng
from kvsteward.synth.traces.envs.base import disjoint_names
from kvsteward.synth.traces.world import SPLITS

CATEGORIES: dict[str, tuple[str, ...]] = {
    "electronics": ("headphones", "speaker", "tablet", "charger", "router", "camera", "monitor", "smartwatch"),
    "apparel": ("rain jacket", "sneakers", "wool scarf", "hoodie", "hiking boots", "denim shirt", "parka"),
    "furniture": ("desk", "armchair", "bookshelf", "bed frame", "bar stool", "wardrobe", "side table"),
    "grocery": ("coffee beans", "olive oil", "tea sampler", "granola", "spice set", "honey jar"),
    "kitchen": ("blender", "kettle", "skillet", "knife set", "toaster", "stand mixer", "rice cooker"),
    "toys": ("jigsaw puzzle", "stunt kite", "building set", "plush bear", "puppet theatre", "marble run"),
    "garden": ("garden hose", "planter", "pruning shears", "lawn chair", "bird feeder", "watering can"),
    "sports": ("yoga mat", "dumbbell pair", "camping tent", "bike helmet", "climbing rope", "tennis racket"),
}
TIERS = ("standard", "plus", "gold")

ISSUES = ("damaged", "late", "wrong", "refund", "warranty")
ISSUE_LABEL = {"damaged": "damaged item", "late": "late delivery", "wrong": "wrong item", "refund": "refund request",
               "warranty": "warranty claim"}
ISSUE_WORDS = {"damaged": ("damaged", "broken", "damage"), "late": ("late", "delayed", "delay"),
               "wrong": ("wrong item", "mix-up", "wrong"), "refund": ("return", "refund", "returns"),
               "warranty": ("warranty", "faulty", "repair")}
CLAUSE_PREFIX = {"damaged": "DM", "late": "LT", "wrong": "WI", "refund": "RF", "warranty": "WR"}
# Article titles: phrasings per issue; a title in two lists is ambiguous, so an agent that goes by the result list
# may open an article about another issue for the same category.
TITLES = {
    "damaged": ("Damaged on arrival", "Broken or damaged goods", "Returns and replacements", "Transit damage"),
    "late": ("Late deliveries", "Delayed parcels", "Delivery problems", "Where is my order"),
    "wrong": ("Wrong item received", "Order mix-ups", "Delivery problems", "Returns and replacements"),
    "refund": ("Returns and refunds", "Refund requests", "Returns and replacements", "Sending items back"),
    "warranty": ("Warranty claims", "Faulty products", "Repairs and warranty", "Broken or damaged goods"),
}
TITLE_TAILS = ("", "", " (policy)", ": guide", ": rules")
CLAUSE_TEXT = {
    "damaged": ("report within {w} days of delivery and we ship a free replacement",
                "claims filed within {w} days of delivery get a replacement or a full refund"),
    "late": ("a parcel more than {w} days past its ETA gets the shipping fee refunded",
             "if delivery slips by over {w} days we refund shipping and expedite the parcel"),
    "wrong": ("send the wrong item back within {w} days with a prepaid label; we ship the right one",
              "wrong items reported within {w} days are swapped at no cost"),
    "refund": ("unused items can be returned within {w} days of delivery for a full refund",
               "returns are accepted for {w} days after delivery; the refund goes to the original payment"),
    "warranty": ("defects are covered for {w} days after delivery; we repair or replace the item",
                 "manufacturing faults within {w} days of delivery are repaired free of charge"),
}
WINDOWS = (14, 21, 30, 45, 60, 90)
ITEM_MESSAGES = {
    "damaged": ("The {item} arrived with a cracked corner.", "My {item} was broken when I opened the box.",
                "The {item} came dented and scratched.", "The box was crushed and the {item} inside is damaged."),
    "late": ("My {item} still hasn't arrived.", "The {item} was due days ago and is not here.",
             "Tracking for the {item} has not moved in a week.", "Where is my {item}? It is very late."),
    "wrong": ("I ordered the {item} but got something else.", "The box for the {item} had another product in it.",
              "Instead of the {item} I received the wrong thing.", "This is not the {item} I paid for."),
    "refund": ("I'd like my money back for the {item}.", "The {item} doesn't suit me; can I return it?",
               "Please refund the {item}, I no longer need it.", "Can I send the {item} back for a refund?"),
    "warranty": ("The {item} stopped working after a few weeks.", "My {item} has a fault after light use.",
                 "The {item} broke under normal use.", "Something inside the {item} rattles and it fails."),
}
RESOLUTIONS = ("replacement shipped", "refund issued", "shipping fee refunded", "repair arranged", "no action needed")
CITIES = ("Leeds", "Porto", "Lyon", "Graz", "Turku", "Ghent", "Bergen", "Cork", "Brno", "Malmo", "Basel", "Split",
          "Tartu", "Bilbao", "Utrecht", "Krakow")
INFO_TITLES = ("Shipping times", "Changing your address", "Gift cards", "Product care tips", "Paying in instalments",
               "Membership tiers", "Store opening hours", "Cancelling an order")
FORM_TITLES = ("Prepaid return label", "Repair request form", "Replacement request form", "Claim evidence upload")

_FIRST = ("Mara", "Tomas", "Ines", "Jonah", "Priya", "Aksel", "Lena", "Marek", "Sofia", "Dario", "Nadia", "Emil",
          "Rosa", "Yusuf", "Clara", "Viktor", "Hanna", "Oren", "Lucia", "Felix", "Amira", "Jasper", "Greta", "Milo",
          "Elif", "Ruben", "Noor", "Anton", "Ilse", "Teodor", "Maja", "Kofi", "Linnea", "Pavel", "Zara", "Henrik",
          "Alba", "Soren", "Irina", "Bruno", "Leila", "Casper", "Dana", "Matteo", "Freya", "Tariq", "Vera", "Otto",
          "Selma", "Nico", "Ada", "Joris", "Mina", "Lukas", "Esme", "Rafael", "Kaia", "Stellan", "Ivy", "Bastian",
          "Agnes", "Bram", "Celine", "Dmitri", "Edda", "Fabian", "Gita", "Hugo", "Isla", "Jarek", "Katja", "Leon",
          "Magda", "Nils", "Olga", "Per", "Quinn", "Rhea", "Sami", "Thea", "Ugo", "Valo", "Wanda", "Xenia", "Yara",
          "Zeno", "Arlo", "Bea", "Cyrus", "Dalia", "Enzo", "Fleur", "Gideon", "Hedda", "Ilan", "Juno", "Kasimir",
          "Livia", "Mads", "Nell")
_LAST = ("Voss", "Halloran", "Kerimov", "Lindqvist", "Okafor", "Brandt", "Moreau", "Novak", "Castell", "Aalto",
         "Reyes", "Dunmore", "Petrov", "Sandoval", "Whitlock", "Hartmann", "Quillan", "Marsh", "Ferreira", "Vidal",
         "Holm", "Kowalski", "Achebe", "Lund", "Strand", "Bianchi", "Okonkwo", "Faber", "Rooney", "Szabo", "Keller",
         "Varga", "Nilsen", "Duarte", "Ebbesen", "Tanaka", "Corwin", "Mbeki", "Sorensen", "Galloway", "Jansen",
         "Ortega", "Pryce", "Wexler", "Aldana", "Beaumont", "Crane", "Delacroix", "Engstrom", "Fairfax", "Gruber",
         "Albrecht", "Bakker", "Carvalho", "Dahl", "Eklund", "Forsberg", "Gallo", "Hegarty", "Iqbal", "Jaeger",
         "Karlsson", "Lombardi", "Moretti", "Nowak", "Olsen", "Pires", "Quint", "Rossi", "Schultz", "Toivonen",
         "Urban", "Visser", "Winther", "Yates", "Zamora", "Ahlberg", "Brennan", "Coutinho", "Dekker", "Esposito",
         "Fontaine", "Gunnarsson", "Hoekstra", "Ibarra", "Juhl", "Kovacs", "Lindahl", "Maddox", "Navarro", "Oakes",
         "Haldane", "Ivers", "Jovanovic", "Kallio", "Larkin", "Mendel", "Nyberg", "Osei", "Pellegrini", "Rask",
         "Sutter", "Thorne", "Ulloa", "Vance", "Wilder", "Yilmaz", "Zeller", "Abbott", "Barlow", "Cordero", "Dwyer")
_ONSETS = ("K", "V", "Br", "Tr", "L", "M", "N", "Qu", "Z", "D", "Gr", "S", "F", "H", "P", "R", "Th", "Cl", "St")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ou", "y")
_MIDS = ("r", "l", "v", "nd", "st", "rv", "lt", "m", "n", "x", "k", "th")
_ENDS = ("o", "a", "el", "en", "ix", "on", "ar", "is", "um", "et")


@dataclass(frozen=True)
class Customer:
    cid: str
    name: str
    city: str
    tier: str


@dataclass(frozen=True)
class Product:
    name: str
    category: str


@dataclass(frozen=True)
class Article:
    """A knowledge-base article. Policy articles have an issue, a scope (categories) and a clause; info and form
    articles have neither (a form article has a form code instead)."""

    kid: str
    title: str
    issue: str = ""
    scope: tuple[str, ...] = ()
    clause: str = ""
    window: int = 0
    text: str = ""
    tier_rule: tuple[tuple[str, ...], int] | None = None  # (tiers, window) that replaces `window` for those tiers
    related: str = ""  # id of a form or info article the clause points to
    form_code: str = ""

    def window_for(self, tier: str) -> int:
        return self.tier_rule[1] if self.tier_rule and tier in self.tier_rule[0] else self.window

    def tier_applies(self, tier: str) -> bool:
        return bool(self.tier_rule) and tier in self.tier_rule[0]


@dataclass(frozen=True)
class Item:
    product: Product
    qty: int


@dataclass(frozen=True)
class Order:
    oid: str
    cid: str
    placed: dt.date
    items: tuple[Item, ...]
    status: str  # delivered | in transit | processing | cancelled | returned
    when: dt.date | None = None  # delivery date (delivered, returned) or ETA (in transit)

    def categories(self) -> set[str]:
        return {i.product.category for i in self.items}


@dataclass(frozen=True)
class Ticket:
    tid: str
    cid: str
    oid: str
    issue: str
    item: str  # the product name the message is about
    message: str
    state: str = "open"  # open | closed
    resolution: str = ""
    order_given: bool = True  # False: the customer did not say which order (the agent finds it by the item)


@dataclass
class World:
    split: str
    customers: list[Customer]
    products: dict[str, list[Product]]
    articles: dict[str, Article]
    ticket_ids: list[str]
    order_ids: list[str]
    namesakes: dict[str, list[Customer]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for c in self.customers:
            self.namesakes.setdefault(c.name, []).append(c)

    def policy(self, issue: str, category: str) -> Article:
        """The one policy article covering (issue, category)."""
        return next(a for a in self.articles.values() if a.issue == issue and category in a.scope)

    def search(self, query: str, top_k: int, issue: str, category: str, salt: int) -> list[Article]:
        """Ranked articles for `query`: issue words weigh 2, a category word 1, plus a per-query jitter (the ranking
        of same-issue articles is arbitrary, as lexical search is). The applicable article is always listed."""
        words = set(query.lower().split())

        def score(a: Article) -> float:
            issue_hit = a.issue and words & set(" ".join(ISSUE_WORDS[a.issue]).split())
            cat_hit = words & set(a.scope)
            info_hit = words & set(a.title.lower().split())
            jitter = (mix(salt, query, a.kid) % 1000) / 1000 * 1.6
            return 2.0 * bool(issue_hit) + 1.0 * bool(cat_hit) + 0.5 * bool(info_hit) + jitter

        ranked = sorted(self.articles.values(), key=lambda a: (-score(a), a.kid))
        top = [a for a in ranked if not a.form_code][:top_k]
        right = self.policy(issue, category)
        if right not in top:
            top[-1] = right
        return top



def titles_issues(title: str) -> set[str]:
    """The issues a title could be about (ambiguous titles name two): what an agent reading the list goes by."""
    stem = next((title[: -len(t)] for t in TITLE_TAILS if t and title.endswith(t)), title)
    return {i for i, ts in TITLES.items() if stem in ts}


# --- building -----------------------------------------------------------------------------------------------------

def _brand(r: random.Random) -> str:
    return r.choice(_ONSETS) + r.choice(_VOWELS) + r.choice(_MIDS) + r.choice(_ENDS)


def _partition(seed: int, what: str, numbers: range, fmt: str) -> dict[str, list[str]]:
    """Disjoint id pools per split: the numbers shuffled once, cut in three."""
    pool = list(numbers)
    rng(seed, "support-ids", what).shuffle(pool)
    n = len(pool) // len(SPLITS)
    return {s: [fmt.format(x) for x in pool[k * n:(k + 1) * n]] for k, s in enumerate(SPLITS)}


def _scopes(r: random.Random) -> list[tuple[str, ...]]:
    """A partition of the categories into scopes of one to three, one policy article each."""
    cats = list(CATEGORIES)
    r.shuffle(cats)
    out, i = [], 0
    while i < len(cats):
        k = min(r.choice((1, 2, 2, 3)), len(cats) - i)
        out.append(tuple(sorted(cats[i:i + k])))
        i += k
    return out


def _articles(r: random.Random, kids: list[str], clauses: dict[str, list[str]], forms: list[str]) -> dict:
    kid = iter(kids)
    arts: list[Article] = []
    form_arts = [Article(next(kid), t, text="Fill it in online; the agent sends the link.", form_code=code)
                 for t, code in zip(FORM_TITLES, forms, strict=False)]
    info_arts = [Article(next(kid), t, text=f"General help: {t.lower()}.") for t in INFO_TITLES]
    for issue in ISSUES:
        codes = iter(clauses[issue])
        for scope in _scopes(r):
            w = r.choice(WINDOWS)
            tier_rule = None
            if r.random() < (0.6 if issue == "refund" else 0.3):
                tier_rule = (("gold",), w + r.choice((15, 30)))  # plus members get no longer windows
            related = ""
            x = r.random()
            if x < 0.3:
                related = r.choice(form_arts).kid
            elif x < 0.45:
                related = r.choice(info_arts).kid
            title = r.choice(TITLES[issue]) + r.choice(TITLE_TAILS)
            text = r.choice(CLAUSE_TEXT[issue]).format(w=w)
            arts.append(Article(next(kid), title, issue, scope, next(codes), w, text, tier_rule, related))
    return {a.kid: a for a in arts + form_arts + info_arts}


def build_worlds(seed: int, world_size: int) -> dict[str, World]:
    """One world per split; names, brands, ids and codes are split-disjoint by construction."""
    names = disjoint_names(mix(seed, "support-names"), world_size,
                           lambda r: f"{r.choice(_FIRST)} {r.choice(_LAST)}")
    brands = disjoint_names(mix(seed, "support-brands"), 40, _brand)
    cids = _partition(seed, "customer", range(10000, 99999), "C-{}")
    tids = _partition(seed, "ticket", range(1000, 9999), "T-{}")
    oids = _partition(seed, "order", range(1000, 9999), "O-{}")
    kids = _partition(seed, "kb", range(1000, 9999), "KB-{}")
    forms = _partition(seed, "form", range(100, 999), "FM-{}")
    clauses = {i: _partition(seed, f"clause-{i}", range(10, 99), CLAUSE_PREFIX[i] + "-{}") for i in ISSUES}
    worlds = {}
    for split in SPLITS:
        r = rng(seed, "support-world", split)
        customers = []
        pool = names[split]
        for k, cid in enumerate(cids[split][:world_size]):
            # about one customer in six shares a name with another: a name lookup then lists both
            name = pool[k - 1] if k and r.random() < 0.17 else pool[k]
            customers.append(Customer(cid, name, r.choice(CITIES), r.choices(TIERS, (6, 2, 2))[0]))
        products = {}
        bs = brands[split]
        for cat, nouns in CATEGORIES.items():
            picks = r.sample(bs, 10)
            products[cat] = [Product(f"{b} {r.choice(nouns)}", cat) for b in picks]
            products[cat] = list({p.name: p for p in products[cat]}.values())
        articles = _articles(r, kids[split], {i: clauses[i][split] for i in ISSUES}, forms[split])
        worlds[split] = World(split, customers, products, articles, tids[split], oids[split])
    return worlds


# --- case files -------------------------------------------------------------------------------------------------

def day(d: dt.date) -> str:
    return d.isoformat()


def random_today(r: random.Random) -> dt.date:
    return dt.date(2025, 1, 1) + dt.timedelta(days=r.randint(40, 330))


def make_order(r: random.Random, world: World, customer: Customer, today: dt.date, used: set[str],
               status: str, *, must: Product | None = None, when: dt.date | None = None,
               avoid: set[str] = frozenset(), extra: Product | None = None) -> Order:
    """An order of `customer` with `status`, containing `must` (and `extra`) if given; categories in `avoid` are
    left out of the other items. `when` fixes the delivery date (or ETA)."""
    oid = _fresh(r, world.order_ids, used)
    items = [Item(p, r.randint(1, 2)) for p in (must, extra) if p]
    taken = {p.category for p in (must, extra) if p}
    cats = [c for c in CATEGORIES if c not in avoid and c not in taken]
    for cat in r.sample(cats, r.choice((0, 1, 1, 2)) if must else r.choice((1, 1, 2))):
        items.append(Item(r.choice(world.products[cat]), r.randint(1, 3)))
    r.shuffle(items)
    if status == "in transit":
        when = when or today + dt.timedelta(days=r.randint(1, 9))
        placed = today - dt.timedelta(days=r.randint(3, 20))
    elif status in ("delivered", "returned"):
        when = when or today - dt.timedelta(days=r.randint(1, 120))
        placed = when - dt.timedelta(days=r.randint(2, 8))
    else:
        when, placed = None, today - dt.timedelta(days=r.randint(0, 12))
    return Order(oid, customer.cid, placed, tuple(items), status, when)


def _fresh(r: random.Random, pool: list[str], used: set[str]) -> str:
    while True:
        x = r.choice(pool)
        if x not in used:
            used.add(x)
            return x


def make_ticket(r: random.Random, world: World, customer: Customer, order: Order, issue: str, item: Product,
                used: set[str], state: str = "open") -> Ticket:
    tid = _fresh(r, world.ticket_ids, used)
    msg = r.choice(ITEM_MESSAGES[issue]).format(item=item.name)
    res = r.choice(RESOLUTIONS) if state == "closed" else ""
    return Ticket(tid, customer.cid, order.oid, issue, item.name, msg, state, res)


# --- responses --------------------------------------------------------------------------------------------------

def _lines(r: random.Random, head: str, fixed: list[str], movable: list[str]) -> str:
    movable = list(movable)
    r.shuffle(movable)
    return "\n".join([head] + fixed + movable)


def render_ticket(r: random.Random, t: Ticket) -> str:
    head = f"Ticket {t.tid} ({t.state}) · customer {t.cid}"
    movable = [f"order: {t.oid if t.order_given else 'not given'}", f"issue: {ISSUE_LABEL[t.issue]}"]
    if t.resolution:
        movable.append(f"resolution: {t.resolution}")
    return _lines(r, head, [], movable) + f'\nmessage: "{t.message}"'


def order_status(o: Order) -> str:
    if o.status == "delivered":
        return f"delivered {day(o.when)}"
    if o.status == "in transit":
        return f"in transit, ETA {day(o.when)}"
    if o.status == "returned":
        return f"returned {day(o.when)}"
    return o.status


def render_order(r: random.Random, o: Order) -> str:
    items = "; ".join(f"{i.product.name} ({i.product.category}) x{i.qty}" for i in o.items)
    lines = [f"status: {order_status(o)}", f"items: {items}"]
    if o.when is None:  # a dated status says when; an undated one shows the order date instead
        lines.append(f"placed {day(o.placed)}")
    return _lines(r, f"Order {o.oid} · customer {o.cid}", [], lines)


def render_customer(r: random.Random, c: Customer, orders: list[str], tickets: list[tuple[str, str]]) -> str:
    head = f"Customer {c.cid} · {c.name} · {c.city}"
    movable = [f"tier: {c.tier}"]
    if orders:
        movable.append("orders: " + ", ".join(orders))
    if tickets:
        movable.append("tickets: " + ", ".join(f"{t} ({s})" for t, s in tickets))
    return _lines(r, head, [], movable)


def render_matches(name: str, matches: list[Customer]) -> str:
    rows = [f"{c.cid} · {c.name} · {c.city}" for c in matches]
    return f'lookup_customer("{name}"): {len(matches)} matches\n' + "\n".join(rows)


def render_results(query: str, hits: list[Article]) -> str:
    rows = [f"{k}. {a.kid} · {a.title}" for k, a in enumerate(hits, start=1)]
    return f'search_kb("{query}"): top {len(hits)}\n' + "\n".join(rows)


def tier_line(a: Article) -> str:
    tiers, w = a.tier_rule
    who = "Gold members" if tiers == ("gold",) else "Plus and gold members"
    return f"{who}: {w} days."


def render_article(r: random.Random, a: Article) -> str:
    if a.form_code:
        return f"{a.kid} · {a.title}\nForm code: {a.form_code}. {a.text}"
    if not a.issue:
        return f"{a.kid} · {a.title}\n{a.text}"
    movable = [f"covers: {ISSUE_LABEL[a.issue]} · {', '.join(a.scope)}"]
    tail = []
    if a.tier_rule:
        tail.append(tier_line(a))
    if a.related:
        tail.append(f"Related: {a.related}.")
    clause = f"Clause {a.clause}: {a.text}."
    order = [movable[0], clause] if r.random() < 0.5 else [clause, movable[0]]
    return "\n".join([f"{a.kid} · {a.title}"] + order + tail)
