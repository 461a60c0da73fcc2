"""Randomized definitions of a long coding session, and the probes (with hidden tests) that read them.

Everything here is derived from one integer seed, so a session can be regenerated exactly, and nothing in it can
be memorised: class, field, exception and status names, the fee constants, the error code, the rounding mode and
the quantum are all drawn per seed. The facts are written only into the three definition messages; the probe
questions describe *what* to recall, never the values.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from decimal import (
    ROUND_05UP,
    ROUND_CEILING,
    ROUND_DOWN,
    ROUND_FLOOR,
    ROUND_HALF_DOWN,
    ROUND_HALF_EVEN,
    ROUND_HALF_UP,
    ROUND_UP,
    Decimal,
)

# Word pools: checked against CPython 3.11's stdlib so that the filler rarely mentions them (the filler is filtered
# for every secret anyway; rare words just mean fewer rejected chunks).
_WORDS = ("Kestrel Marlow Quillon Brindle Tamsin Corvid Halyard Pellam Sorrel Vantor Wexley Juniper Calloway Drummond "
          "Fennick Hollis Larkin Mornay Nettle Orrin Pastern Rookwood Selwyn Thimble Wren Bramble Cobalt Dunmore "
          "Falkirk Gannet Heron Jarrah Kittiwake Linnet Merlin Nimbus Osprey Plover Quince Rowan Saffron Upland "
          "Vesper Willet Yarrow Zephyr").split()
_ITEM_NOUNS = ("Voucher", "Remittance", "Transfer", "Invoice", "Payout", "Charge", "Disbursement", "Claim")
_ACCOUNT_NOUNS = ("Account", "Wallet", "Ledger", "Purse", "Float", "Reserve")
_ERROR_KINDS = ("Hold", "Settlement", "Funds", "Clearing", "Shortfall", "Cover")
_STATUS_ROLES = {
    "initial": ("DRAFTED", "STAGED", "PARKED", "MINTED", "EARMARKED", "TENDERED"),
    "settled": ("RECONCILED", "REMITTED", "STAMPED", "VETTED", "ACCRUED"),
    "failed": ("BOUNCED", "EMBARGOED", "QUARANTINED", "FORFEITED", "SEQUESTERED"),
    "review": ("SHELVED", "DORMANT", "WAIVED", "CLAWED_BACK", "ESCROWED"),
}
_ID_FIELDS = ("ref", "external_ref", "voucher_no", "batch_ref", "reference")
_AMOUNT_FIELDS = ("amount", "gross_amount", "principal", "face_value", "net_amount")
_FEE_FIELDS = ("fee", "fee_charged", "applied_fee", "service_fee")
_HOLDER_FIELDS = ("account_no", "holder_ref", "owner_id", "account_ref")
_BALANCE_FIELDS = ("balance", "available", "funds", "cleared_balance")
_ROUNDING = {name: mode for name, mode in [
    ("ROUND_HALF_UP", ROUND_HALF_UP), ("ROUND_HALF_EVEN", ROUND_HALF_EVEN), ("ROUND_HALF_DOWN", ROUND_HALF_DOWN),
    ("ROUND_UP", ROUND_UP), ("ROUND_DOWN", ROUND_DOWN), ("ROUND_CEILING", ROUND_CEILING),
    ("ROUND_FLOOR", ROUND_FLOOR), ("ROUND_05UP", ROUND_05UP)]}
_QUANTA = ("0.02", "0.05", "0.10", "0.20", "0.25", "0.50")
_PROJECTS = ("tidewater", "larkspur", "ironbark", "saltmarsh", "copperline", "northgate", "bellwether", "foxglove")

FACT_KINDS = ("fee_rate", "min_fee", "fee_cap", "error_code", "quantum", "rounding")
DEFAULT_FACTS = ("fee_rate", "error_code", "quantum")


@dataclass(frozen=True)
class Spec:
    """The randomized facts of one session."""

    project: str
    item: str
    account: str
    status_enum: str
    error: str
    statuses: dict[str, str]  # role -> member name (initial, settled, failed, review)
    status_order: tuple[str, ...]  # member names in declaration order
    item_fields: dict[str, str]  # id, amount, fee -> field name
    account_fields: dict[str, str]  # id, balance -> field name
    fee_rate: str
    min_fee: str
    fee_cap: str
    error_code: str
    quantum: str
    rounding: str

    def fee_for(self, amount: Decimal) -> Decimal:
        """Reference implementation of the fee rule stated in definition step 3."""
        q = Decimal(self.quantum)
        raw = amount * Decimal(self.fee_rate)
        fee = (raw / q).to_integral_value(rounding=_ROUNDING[self.rounding]) * q
        return min(max(fee, Decimal(self.min_fee)), Decimal(self.fee_cap))

    def secrets(self) -> list[str]:
        """Strings that identify this session's facts: they may appear only in the definition messages."""
        return [self.item, self.account, self.status_enum, self.error, self.error_code, self.fee_rate,
                self.min_fee, self.fee_cap, self.quantum, self.rounding, *self.status_order]


def _money(rng: random.Random, quantum: Decimal, lo: Decimal, hi: Decimal) -> str:
    k = rng.randint(int(lo / quantum), int(hi / quantum))
    return str((quantum * k).quantize(Decimal("0.01")))


def make_spec(seed: int) -> Spec:
    """Draw every name and value of a session from `seed` (same seed, same spec)."""
    rng = random.Random(f"longsession-defs:{seed}")
    w_item, w_account, w_error = rng.sample(_WORDS, 3)
    item = w_item + rng.choice(_ITEM_NOUNS)
    statuses = {role: rng.choice(pool) for role, pool in _STATUS_ROLES.items()}
    order = list(statuses.values())
    rest = order[1:]  # `initial` stays first: the dataclass default then reads naturally
    rng.shuffle(rest)
    quantum = rng.choice(_QUANTA)
    q = Decimal(quantum)
    rate = rng.choice([r for r in range(105, 896) if r % 10])
    return Spec(
        project=rng.choice(_PROJECTS),
        item=item,
        account=w_account + rng.choice(_ACCOUNT_NOUNS),
        status_enum=f"{item}Status",
        error=f"{w_error}{rng.choice(_ERROR_KINDS)}Error",
        statuses=statuses,
        status_order=(order[0], *rest),
        item_fields={"id": rng.choice(_ID_FIELDS), "amount": rng.choice(_AMOUNT_FIELDS),
                     "fee": rng.choice(_FEE_FIELDS)},
        account_fields={"id": rng.choice(_HOLDER_FIELDS), "balance": rng.choice(_BALANCE_FIELDS)},
        fee_rate=f"0.0{rate}",
        min_fee=_money(rng, q, Decimal("0.50"), Decimal("3.00")),
        fee_cap=_money(rng, q, Decimal("15"), Decimal("95")),
        error_code=f"E{rng.randint(1000, 9999)}",
        quantum=quantum,
        rounding=rng.choice(sorted(_ROUNDING)),
    )


# ---------------------------------------------------------------------------------------------- definitions


@dataclass
class Definition:
    """One definition step: a user message carrying facts, the assistant's acknowledgement, and where facts sit."""

    user: str
    ack: str
    regions: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> char range in `user`


def _region(text: str, snippet: str) -> tuple[int, int]:
    start = text.index(snippet)
    return start, start + len(snippet)


def _models_step(s: Spec) -> Definition:
    st, fi, fa = s.statuses, s.item_fields, s.account_fields
    members = "\n".join(f'    {name} = "{name.lower()}"' for name in s.status_order)
    enum_src = f"class {s.status_enum}(str, Enum):\n{members}\n"
    item_src = (f"@dataclass\nclass {s.item}:\n    {fi['id']}: str\n    {fi['amount']}: Decimal\n"
                f'    {fi["fee"]}: Decimal = Decimal("0")\n'
                f"    status: {s.status_enum} = {s.status_enum}.{st['initial']}\n")
    account_src = f"@dataclass\nclass {s.account}:\n    {fa['id']}: str\n    {fa['balance']}: Decimal\n"
    user = (f"We're starting the settlement module for the {s.project} service. First, the data models; please use "
            f"exactly these names:\n\n```python\nfrom dataclasses import dataclass\nfrom decimal import Decimal\n"
            f"from enum import Enum\n\n\n{enum_src}\n\n{item_src}\n\n{account_src}```\n\n"
            f"A new {s.item} always starts as {st['initial']}. {st['review']} is reserved for manual review; "
            f"settle() never sets it.")
    regions = {"status_enum": _region(user, enum_src), "item": _region(user, item_src),
               "account": _region(user, account_src)}
    return Definition(user, "Got it. I'll use these models exactly as written.", regions)


def _constants_step(s: Spec) -> Definition:
    lines = {"fee_rate": f'FEE_RATE = Decimal("{s.fee_rate}")', "min_fee": f'MIN_FEE = Decimal("{s.min_fee}")',
             "fee_cap": f'FEE_CAP = Decimal("{s.fee_cap}")'}
    code_line = f'code = "{s.error_code}"'
    error_src = (f"class {s.error}(Exception):\n    \"\"\"Raised when an account cannot cover an amount plus its fee."
                 f"\"\"\"\n\n    {code_line}\n")
    user = ("Next, the fee constants and the error type. They come from the finance team, so keep the values exact:"
            f"\n\n```python\n{lines['fee_rate']}\n{lines['min_fee']}\n{lines['fee_cap']}\n\n\n{error_src}```")
    regions = {k: _region(user, v) for k, v in lines.items()}
    regions["error"] = _region(user, error_src)
    regions["error_code"] = _region(user, code_line)
    return Definition(user, "Understood. I'll keep those constants and the error type exactly as given.", regions)


def _rule_step(s: Spec) -> Definition:
    fi, fa, st = s.item_fields, s.account_fields, s.statuses
    quantum_line, rounding_line = f'FEE_QUANTUM = Decimal("{s.quantum}")', f"FEE_ROUNDING = {s.rounding}"
    fee_rule = ("- `fee_for(amount)`: multiply the amount by FEE_RATE, round the result to a whole multiple of "
                "FEE_QUANTUM using FEE_ROUNDING, i.e. `(raw / FEE_QUANTUM).to_integral_value(rounding=FEE_ROUNDING)"
                " * FEE_QUANTUM`, then clamp it to the range [MIN_FEE, FEE_CAP].")
    settle_rule = (f"- `settle(item, account)`: the total is `item.{fi['amount']} + fee_for(item.{fi['amount']})`. "
                   f"If `account.{fa['balance']}` is below the total, set `item.status` to "
                   f"`{s.status_enum}.{st['failed']}` and raise `{s.error}`. Otherwise subtract the total from "
                   f"`account.{fa['balance']}`, store the fee in `item.{fi['fee']}`, set `item.status` to "
                   f"`{s.status_enum}.{st['settled']}`, and return the item.")
    user = (f"Last piece of the spec: the fee rule and settlement.\n\n```python\nfrom decimal import {s.rounding}\n\n"
            f"{quantum_line}\n{rounding_line}\n```\n\n{fee_rule}\n{settle_rule}")
    regions = {"quantum": _region(user, quantum_line), "rounding": _region(user, rounding_line),
               "fee_rule": _region(user, fee_rule), "settle_rule": _region(user, settle_rule)}
    return Definition(user, "Clear. I'll compute fees and settle items exactly by that rule.", regions)


def definitions(spec: Spec) -> list[Definition]:
    """The three definition steps, in session order."""
    return [_models_step(spec), _constants_step(spec), _rule_step(spec)]


# ---------------------------------------------------------------------------------------------- probes


@dataclass
class ProbeDraft:
    """A probe before token layout: see `kvsteward.synth.longsession.schema.Probe` for the field meanings."""

    id: str
    kind: str
    question: str
    needs: list[str]
    answer_prefix: str = ""
    gold: str | None = None
    required: list[str] = field(default_factory=list)
    tests: str | None = None


_FACT_PROBES = {
    # kind -> (question, answer prefix, needed regions, gold getter)
    "fee_rate": ("Quick check before we write the fee code: what value did we give FEE_RATE? Reply with just the "
                 "line of code.", 'FEE_RATE = Decimal("', ["fee_rate"], lambda s: s.fee_rate),
    "min_fee": ("What value did we give MIN_FEE? Reply with just the line of code.", 'MIN_FEE = Decimal("',
                ["min_fee"], lambda s: s.min_fee),
    "fee_cap": ("What value did we give FEE_CAP? Reply with just the line of code.", 'FEE_CAP = Decimal("',
                ["fee_cap"], lambda s: s.fee_cap),
    "error_code": ("Which error code does our settlement exception carry? Reply with just the assignment inside "
                   "the class.", 'code = "', ["error_code"], lambda s: s.error_code),
    "quantum": ("What quantum do fees get rounded to? Reply with just the line of code.", 'FEE_QUANTUM = Decimal("',
                ["quantum"], lambda s: s.quantum),
    "rounding": ("Which rounding mode does the fee rule use? Reply with just the line of code.", "FEE_ROUNDING =",
                 ["rounding"], lambda s: " " + s.rounding),
}

_ALL_REGIONS = ["status_enum", "item", "account", "fee_rate", "min_fee", "fee_cap", "error", "error_code", "quantum",
                "rounding", "fee_rule", "settle_rule"]


def probes_from_table(table: dict, spec, kinds: tuple[str, ...], what: str = "fact") -> list[ProbeDraft]:
    """Fact probes of `kinds` from a domain's table (kind -> question, answer prefix, needed regions, gold getter)."""
    unknown = [k for k in kinds if k not in table]
    if unknown:
        raise ValueError(f"unknown {what} probe kinds {unknown}; known: {list(table)}")
    out = []
    for kind in kinds:
        question, prefix, needs, gold = table[kind]
        out.append(ProbeDraft(f"fact:{kind}", "fact", question, needs, answer_prefix=prefix, gold=gold(spec)))
    return out


def fact_probes(spec: Spec, kinds: tuple[str, ...] = DEFAULT_FACTS) -> list[ProbeDraft]:
    return probes_from_table(_FACT_PROBES, spec, kinds)


def recall_probe(spec: Spec) -> ProbeDraft:
    question = ("Before we write the code, recap from memory everything we fixed at the start of this session: both "
                "data class names, the status enum and its members, the exception class and its error code, every "
                "fee constant with its value, and the fee rule's rounding mode and quantum.")
    required = [spec.item, spec.account, spec.error, spec.error_code, spec.fee_rate, spec.min_fee, spec.fee_cap,
                spec.quantum, spec.rounding, *spec.status_order]
    return ProbeDraft("recall", "recall", question, list(_ALL_REGIONS), required=required)


def code_probes(spec: Spec) -> list[ProbeDraft]:
    from kvsteward.synth.longsession.code_tests import fee_tests, module_tests, settle_tests

    self_contained = "Make it self-contained (define every name it uses) and reply with one ```python block."
    return [
        ProbeDraft("code:fee_for", "code",
                   f"Now write `fee_for(amount: Decimal) -> Decimal` following our fee rule. {self_contained}",
                   ["fee_rate", "min_fee", "fee_cap", "quantum", "rounding", "fee_rule"], tests=fee_tests(spec)),
        ProbeDraft("code:settle", "code",
                   f"Next, write `settle(item, account)` following our settlement rule, with the data classes, "
                   f"the status enum and the exception it needs. {self_contained}",
                   list(_ALL_REGIONS), tests=settle_tests(spec)),
        ProbeDraft("code:module", "code",
                   "Finally, write the complete settlement module: the status enum, both data classes, the fee "
                   "constants, the exception, `fee_for` and `settle`, all exactly as we defined them. Reply with one "
                   "```python block.", list(_ALL_REGIONS), tests=module_tests(spec)),
    ]


def probes(spec: Spec, facts: tuple[str, ...] = DEFAULT_FACTS) -> list[ProbeDraft]:
    """Probes in play order: fact probes (shortest answers) first, then recall, then the code probes."""
    return [*fact_probes(spec, facts), recall_probe(spec), *code_probes(spec)]
