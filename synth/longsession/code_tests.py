"""Hidden unit tests for the code probes of a long session.

A test snippet is plain Python that defines `check_<name>(m)` functions; `m` is the generated solution imported as a
module. `kvsteward.eval.scoring.code_checks` runs each check in a sandboxed subprocess and counts the passes (one
check = one "hidden check" in the paper's sense). Expected values come from `Spec.fee_for`, the reference
implementation of the rule stated in the definitions.
"""

from __future__ import annotations

import random
from decimal import Decimal

from kvsteward.synth.longsession.defs import Spec

_HEADER = '''from decimal import Decimal


def _status_is(status, name):
    """Accept the enum member itself, its name or its value."""
    return getattr(status, "name", None) == name or str(getattr(status, "value", status)).lower() == name.lower()
'''


def _cents(x: Decimal) -> Decimal:
    return x.quantize(Decimal("0.01"))


def fee_cases(spec: Spec) -> dict[str, tuple[str, str]]:
    """Named (amount, expected fee) cases: both clamps, two interior amounts and, if one exists, a rounding tie."""
    rng = random.Random(f"longsession-tests:{spec.item}:{spec.fee_rate}")
    rate, lo, hi = Decimal(spec.fee_rate), Decimal(spec.min_fee), Decimal(spec.fee_cap)
    cases = {"below_min": _cents(lo / rate / 3), "above_cap": _cents(hi / rate * 2)}
    lo_amount, hi_amount = int(lo / rate * 150), int(hi / rate * 80)  # interior, in cents
    cases["interior_a"] = Decimal(rng.randint(lo_amount, hi_amount)) / 100
    cases["interior_b"] = Decimal(rng.randint(lo_amount, hi_amount)) / 100
    q = Decimal(spec.quantum)
    for _ in range(5000):  # a raw fee exactly halfway between two multiples of the quantum, if the rate allows one
        amount = Decimal(rng.randint(lo_amount, hi_amount)) / 100
        if (amount * rate / q) % 1 == Decimal("0.5"):
            cases["tie"] = amount
            break
    return {name: (str(a), str(spec.fee_for(a))) for name, a in cases.items()}


def _fee_checks(spec: Spec, names: list[str] | None = None) -> str:
    out = []
    for name, (amount, fee) in fee_cases(spec).items():
        if names is None or name in names:
            out.append(f'def check_fee_{name}(m):\n    assert Decimal(str(m.fee_for(Decimal("{amount}")))) == '
                       f'Decimal("{fee}")\n')
    return "\n\n".join(out)


def _settle_cases(spec: Spec) -> tuple[str, str, str, str]:
    """(amount, fee, a balance that covers it, a balance that does not)."""
    amount = Decimal(fee_cases(spec)["interior_a"][0])
    fee = spec.fee_for(amount)
    return str(amount), str(fee), str(amount + fee + Decimal("10.00")), str(amount + fee - Decimal("0.01"))


def _settle_checks(spec: Spec, names: list[str] | None = None) -> str:
    fi, fa, st = spec.item_fields, spec.account_fields, spec.statuses
    amount, fee, rich, poor = _settle_cases(spec)
    make = (f"def _make(m, balance):\n"
            f'    item = m.{spec.item}(**{{"{fi["id"]}": "t-1", "{fi["amount"]}": Decimal("{amount}")}})\n'
            f'    account = m.{spec.account}(**{{"{fa["id"]}": "acct-1", "{fa["balance"]}": Decimal(balance)}})\n'
            f"    return item, account\n")
    checks = {
        "new_item_initial": (f'    item, _ = _make(m, "{rich}")\n'
                             f'    assert _status_is(item.status, "{st["initial"]}")\n'),
        "debits_total": (f'    item, account = _make(m, "{rich}")\n    m.settle(item, account)\n'
                         f'    assert account.{fa["balance"]} == Decimal("{rich}") - Decimal("{amount}") - '
                         f'Decimal("{fee}")\n'),
        "marks_settled": (f'    item, account = _make(m, "{rich}")\n    out = m.settle(item, account)\n'
                          f'    assert out is item\n    assert _status_is(item.status, "{st["settled"]}")\n'
                          f'    assert item.{fi["fee"]} == Decimal("{fee}")\n'),
        "shortfall_raises": (f'    item, account = _make(m, "{poor}")\n    try:\n        m.settle(item, account)\n'
                             f"    except Exception as e:\n"
                             f'        assert type(e).__name__ == "{spec.error}"\n'
                             f'        assert getattr(e, "code", None) == "{spec.error_code}"\n'
                             f"    else:\n        raise AssertionError('no exception on a shortfall')\n"),
        "shortfall_state": (f'    item, account = _make(m, "{poor}")\n    try:\n        m.settle(item, account)\n'
                            f"    except Exception:\n        pass\n"
                            f'    assert _status_is(item.status, "{st["failed"]}")\n'
                            f'    assert account.{fa["balance"]} == Decimal("{poor}")\n'),
    }
    body = [f"def check_settle_{n}(m):\n{src}" for n, src in checks.items() if names is None or n in names]
    return make + "\n\n" + "\n\n".join(body)


def _module_checks(spec: Spec) -> str:
    consts = {"FEE_RATE": spec.fee_rate, "MIN_FEE": spec.min_fee, "FEE_CAP": spec.fee_cap,
              "FEE_QUANTUM": spec.quantum}
    const_asserts = "\n".join(f'    assert Decimal(str(m.{k})) == Decimal("{v}")' for k, v in consts.items())
    members = "\n".join(f'    assert m.{spec.status_enum}.{n}.value == "{n.lower()}"' for n in spec.status_order)
    return (f"def check_constants(m):\n{const_asserts}\n\n\n"
            f'def check_rounding(m):\n    import decimal\n    assert m.FEE_ROUNDING == decimal.{spec.rounding}\n\n\n'
            f"def check_status_enum(m):\n{members}\n    assert len(list(m.{spec.status_enum})) == "
            f"{len(spec.status_order)}\n\n\n"
            f'def check_error_code(m):\n    assert m.{spec.error}.code == "{spec.error_code}"\n')


def fee_tests(spec: Spec) -> str:
    return _HEADER + "\n\n" + _fee_checks(spec)


def settle_tests(spec: Spec) -> str:
    return _HEADER + "\n\n" + _settle_checks(spec)


def module_tests(spec: Spec) -> str:
    return "\n\n".join([_HEADER, _module_checks(spec), _fee_checks(spec, ["below_min", "interior_b"]),
                        _settle_checks(spec, ["debits_total", "shortfall_raises"])])


def reference_solution(spec: Spec) -> str:
    """A correct module for `spec` (used by the tests of the benchmark itself, never shown to a model)."""
    fi, fa, st = spec.item_fields, spec.account_fields, spec.statuses
    members = "\n".join(f'    {n} = "{n.lower()}"' for n in spec.status_order)
    return f'''from dataclasses import dataclass
from decimal import Decimal, {spec.rounding}
from enum import Enum

FEE_RATE = Decimal("{spec.fee_rate}")
MIN_FEE = Decimal("{spec.min_fee}")
FEE_CAP = Decimal("{spec.fee_cap}")
FEE_QUANTUM = Decimal("{spec.quantum}")
FEE_ROUNDING = {spec.rounding}


class {spec.status_enum}(str, Enum):
{members}


@dataclass
class {spec.item}:
    {fi["id"]}: str
    {fi["amount"]}: Decimal
    {fi["fee"]}: Decimal = Decimal("0")
    status: {spec.status_enum} = {spec.status_enum}.{st["initial"]}


@dataclass
class {spec.account}:
    {fa["id"]}: str
    {fa["balance"]}: Decimal


class {spec.error}(Exception):
    code = "{spec.error_code}"


def fee_for(amount):
    raw = amount * FEE_RATE
    fee = (raw / FEE_QUANTUM).to_integral_value(rounding=FEE_ROUNDING) * FEE_QUANTUM
    return min(max(fee, MIN_FEE), FEE_CAP)


def settle(item, account):
    fee = fee_for(item.{fi["amount"]})
    total = item.{fi["amount"]} + fee
    if account.{fa["balance"]} < total:
        item.status = {spec.status_enum}.{st["failed"]}
        raise {spec.error}("insufficient funds")
    account.{fa["balance"]} -= total
    item.{fi["fee"]} = fee
    item.status = {spec.status_enum}.{st["settled"]}
    return item
'''
