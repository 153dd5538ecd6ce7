"""The spec as data and functions: the lifecycle machine against its table, the generated state
diagram, and each invariant and logic helper on Python ints and on z3 terms alike."""
from __future__ import annotations

import pytest
import z3
from transitions import MachineError

from batch.core import step
from spec import diagram, invariants as inv, lifecycle as lc, logic


def _edges(machine) -> set[tuple[str, str, str]]:
    return {(name, src, t.dest) for name, ev in machine.events.items()
            for src, ts in ev.transitions.items() for t in ts}


def test_machine_events_sources_and_destinations_are_the_table():
    table = {(e, s, d) for e, srcs, d in lc.TRANSITIONS for s in srcs}
    assert _edges(step.MACHINE) == table == _edges(lc.new_machine())
    assert list(step.MACHINE.events) == list(lc.EVENTS)
    assert list(step.MACHINE.states) == list(lc.STATES)
    assert not step.MACHINE.auto_transitions and step.MACHINE.models == []
    assert step.NEXT == {(e, s): d for e, s, d in table}  # what step.fire moves a record along


@pytest.mark.parametrize("event", lc.EVENTS)
def test_an_event_fires_only_from_its_sources(event):
    class Rec:
        state = lc.QUEUED

    sources = dict((e, s) for e, s, _ in lc.TRANSITIONS)[event]
    for state in lc.STATES:
        r = Rec()
        r.state = state
        if state in sources:
            step.MACHINE.events[event].trigger(r)
            assert r.state == dict((e, d) for e, _, d in lc.TRANSITIONS)[event]
        else:
            with pytest.raises(MachineError):
                step.MACHINE.events[event].trigger(r)


def test_committed_state_diagram_is_generated_from_the_table():
    assert diagram.committed() == diagram.block(), "docs/spec.md is stale: run python -m spec.diagram --write"
    src = diagram.mermaid()
    for e, srcs, d in lc.TRANSITIONS:
        for s in srcs:
            assert f"{s} --> {d}: {e}" in src


def test_a_stale_diagram_is_detected(tmp_path):
    doc = tmp_path / "spec.md"
    doc.write_text(f"intro\n{diagram.BEGIN}\n```mermaid\nold\n```\n{diagram.END}\nrest\n")
    assert diagram.committed(doc) != diagram.block()
    assert diagram.write(doc) and diagram.committed(doc) == diagram.block() and not diagram.write(doc)
    assert doc.read_text().startswith("intro\n") and doc.read_text().endswith("rest\n")


# ---------------------------------------------------------------- each invariant, one case each way


CASES = [  # (predicate, args that satisfy it, args that violate it)
    (inv.kv_within_cap, (256, 256), (257, 256)),
    (inv.kv_used_is_sum_held, (5, [2, 3]), (5, [2, 2])),
    (inv.ledger_consistent, (3, [2, 3], 8), (4, [2, 3], 8)),
    (inv.resident_covered, (2, 17, 16), (1, 17, 16)),
    (inv.waiting_holds_nothing, (0, 0), (1, 0)),
    (inv.final_holds_nothing, (0,), (2,)),
    (inv.exactly_one_state, ([0, 1, 0],), ([1, 1, 0],)),
    (inv.computed_within_known, (4, 4), (5, 4)),
    (inv.resident_has_work, (3, 4), (4, 4)),
    (inv.generated_within_max, (10, 10), (11, 10)),
    (inv.live_below_limits, (9, 10, 100, 4096), (10, 10, 100, 4096)),
    (inv.none_after_eos, (3, 3, True), (4, 3, True)),
    (inv.chunk_within_limit, (64, 64), (65, 64)),
    (inv.batch_within_budget, ([30, 30], 64), ([30, 40], 64)),
    (inv.batch_kv_within_cap, ([100, 156], 256), ([100, 157], 256)),
    (inv.one_forward_per_tick, (1,), (2,)),
    (inv.one_token_per_tick, (1, True), (1, False)),
    (inv.fcfs_order, ([inv.STATE_CODE["decoding"], inv.STATE_CODE["queued"]],),
     ([inv.STATE_CODE["queued"], inv.STATE_CODE["decoding"]],)),
    (inv.arrival_ordered, ([1, 4, 7],), ([1, 7, 4],)),
]


def _z3_value(pred, args):
    """Evaluate ``pred`` with every int argument replaced by a z3 variable fixed to it."""
    s = z3.Solver()
    k = [0]

    def sym(x):
        if isinstance(x, list):
            return [sym(y) for y in x]
        if isinstance(x, bool) or not isinstance(x, int):
            return x
        k[0] += 1
        v = z3.Int(f"x{k[0]}")
        s.add(v == x)
        return v
    term = pred(*(sym(a) for a in args))
    s.add(term if isinstance(term, z3.BoolRef) else z3.BoolVal(term))
    return s.check() == z3.sat


@pytest.mark.parametrize("pred, good, bad", CASES, ids=[c[0].__name__ for c in CASES])
def test_invariant_on_ints_and_on_z3_terms(pred, good, bad):
    assert pred(*good) and not pred(*bad)
    assert _z3_value(pred, good) and not _z3_value(pred, bad)


@pytest.mark.parametrize("b", [1, 2, 3, 4, 16])
def test_cdiv_agrees_on_ints_ints_terms_and_bitvectors(b):
    x, y = z3.Int("x"), z3.BitVec("y", 12)
    for a in range(-20, 70):
        want = -(-a // b)
        assert logic.cdiv(a, b) == want
        assert z3.simplify(z3.substitute(logic.cdiv(x, b), (x, z3.IntVal(a)))).as_long() == want
        assert z3.simplify(z3.substitute(logic.cdiv(y, b), (y, z3.BitVecVal(a, 12)))).as_signed_long() == want


def test_logic_helpers_keep_one_sort():
    bv = z3.BitVec("v", 8)
    assert logic.If(z3.Bool("c"), logic.lift(1, bv), logic.lift(0, bv)).sort() == bv.sort()
    assert logic.If(z3.Bool("c"), 0, 0) == 0 and logic.lift(3, 5) == 3
    assert logic.And() is True and logic.Or() is False and logic.Implies(False, False) is True
