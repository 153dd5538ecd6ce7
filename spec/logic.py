"""A tiny logic namespace that works on Python ints/bools and on z3 terms alike.

Rules and invariants in ``spec/`` are written with ``+ - * <= ==`` and these helpers only, so
the same function runs on plain integers inside the scheduler and on ``z3.Int`` terms inside
the proofs. Python's ``and``, ``or``, ``if`` and ``//`` raise on z3 terms; these do not.
z3 is imported lazily, so the runtime scheduler does not need it installed.
"""
from __future__ import annotations

from typing import Any


def _is_z3(*xs: Any) -> bool:
    for x in xs:  # a plain loop with an int/bool fast path: the scheduler calls this per request per tick
        t = type(x)
        if t is not int and t is not bool and t.__module__.startswith("z3"):
            return True
    return False


def _z3():
    import z3  # only needed when a z3 term is passed

    return z3


def And(*xs: Any) -> Any:
    """Conjunction of booleans or z3 formulas."""
    for x in xs:
        if x is not True and x is not False:
            break
    else:  # plain booleans (the scheduler's case, per request per tick)
        return False not in xs
    return _z3().And(*xs) if _is_z3(*xs) else all(xs)


def Or(*xs: Any) -> Any:
    """Disjunction of booleans or z3 formulas."""
    for x in xs:
        if x is not True and x is not False:
            break
    else:  # plain booleans (the scheduler's case, per request per tick)
        return True in xs
    return _z3().Or(*xs) if _is_z3(*xs) else any(xs)


def Not(x: Any) -> Any:
    """Negation."""
    return _z3().Not(x) if _is_z3(x) else not x


def Implies(a: Any, b: Any) -> Any:
    """``a`` implies ``b``."""
    return _z3().Implies(a, b) if _is_z3(a, b) else (not a) or bool(b)


def If(c: Any, a: Any, b: Any) -> Any:
    """``a`` if ``c`` else ``b`` (both branches are evaluated)."""
    if c is True or c is False:  # a decided condition picks a branch in both worlds (fast path)
        return a if c else b
    if type(a) is int and type(b) is int and a == b:
        return a  # no term needed (z3 would guess its sort: Int, even among bit-vectors)
    return _z3().If(c, a, b) if _is_z3(c, a, b) else (a if c else b)


def Min(a: Any, b: Any) -> Any:
    """The smaller of two integers."""
    if type(a) is int and type(b) is int:  # the scheduler's case, per request per tick
        return a if a <= b else b
    return If(a <= b, a, b)


def Max(a: Any, b: Any) -> Any:
    """The larger of two integers."""
    if type(a) is int and type(b) is int:
        return a if a >= b else b
    return If(a >= b, a, b)


def cdiv(a: Any, b: Any) -> Any:
    """Ceiling division ``ceil(a / b)`` for ``b > 0`` (z3 ``Int`` or bit-vector terms, or ints)."""
    if type(a) is int and type(b) is int:
        return -(-a // b)
    if _is_z3(a, b):
        z3 = _z3()
        q = a + b - 1
        if z3.is_bv(q):  # bit-vector `/` truncates toward zero; ints floor: keep the int meaning
            if type(b) is int and b > 0 and b & (b - 1) == 0:
                return q >> (b.bit_length() - 1)  # arithmetic shift: floor
            return z3.If(q >= 0, q / b, (q - b + 1) / b)
        return q / b  # z3 integer division floors for b > 0
    return -(-a // b)


def Sum(xs: Any) -> Any:
    """Sum of a sequence of integers or z3 terms (0 when empty)."""
    total: Any = 0
    for x in xs:
        total = total + x
    return total


def lift(value: int, like: Any) -> Any:
    """The integer ``value`` as a term of ``like``'s sort (a plain int when ``like`` is one).

    Keeps a model in one sort: ``If(c, 1, 0)`` would be a z3 ``Int`` even among bit-vectors.
    """
    if not _is_z3(like):
        return value
    z3 = _z3()
    return z3.BitVecVal(value, like.size()) if z3.is_bv(like) else z3.IntVal(value)
