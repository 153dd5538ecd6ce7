"""``spec.concrete``: each rule's plain-int compiled form returns what its source returns."""
import inspect

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from spec import concrete, fairness_rules, rules

COMPILED = concrete.compiled()


def _strategy(annotation: str):
    if "list" in annotation:
        return st.lists(st.integers(-40, 300), max_size=6)
    if annotation == "Bool":
        return st.booleans()
    return st.integers(-40, 5000)


@pytest.mark.parametrize("rule", list(COMPILED), ids=lambda f: f.__name__)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_compiled_rule_agrees_with_its_source_on_ints(rule, data):
    params = inspect.signature(rule).parameters
    args = [data.draw(_strategy(str(p.annotation)), label=name) for name, p in params.items()]
    try:
        want = rule(*args)
    except (ZeroDivisionError, ValueError, TypeError):
        assume(False)  # outside the rule's domain (a zero block size): both forms may refuse it
    got = COMPILED[rule](*args)
    assert got == want and bool(got) is bool(want), (rule.__name__, args, got, want)


def test_every_rule_of_the_spec_is_compiled():
    for module in (rules, fairness_rules):
        for name, f in vars(module).items():
            if inspect.isfunction(f) and f.__module__ == module.__name__:
                assert f in COMPILED, name
    assert all("And(" not in concrete.describe(f) and "Or(" not in concrete.describe(f) for f in COMPILED)


def test_a_replaced_rule_reaches_the_caller_unchanged(monkeypatch):
    """The planted-bug tests replace a rule at run time: ``fast`` must hand the replacement back,
    not the compiled form of the original."""
    assert concrete.fast(rules.decode_ready) is COMPILED[rules.decode_ready]
    wrong = lambda held, n, computed, b: False  # noqa: E731
    monkeypatch.setattr(rules, "decode_ready", wrong)
    assert concrete.fast(rules.decode_ready) is wrong


def test_a_compiled_rule_calls_the_compiled_forms_of_the_rules_it_uses():
    f = COMPILED[rules.growth_blocks]
    assert f.__globals__["blocks_needed"] is COMPILED[rules.blocks_needed]
    assert COMPILED[rules.blocks_needed].__globals__["blocks_for"] is COMPILED[rules.blocks_for]
    # 33 tokens + the lookahead slot need 3 blocks of 16: 1 more than 2 held; none past what is held
    assert f(2, 33, 16) == 1 and f(4, 33, 16) == 0


def test_a_rule_whose_callee_was_replaced_runs_in_its_source_form(monkeypatch):
    """``growth_blocks`` calls ``blocks_needed``, which calls ``blocks_for``: a bug planted in
    either must reach a caller of ``fast(rules.growth_blocks)``."""
    assert concrete.fast(rules.growth_blocks) is COMPILED[rules.growth_blocks]
    monkeypatch.setattr(rules, "blocks_for", lambda n, b: 0)
    f = concrete.fast(rules.growth_blocks)
    assert f is rules.growth_blocks and f(0, 100, 16) == 0  # the replacement is seen
    assert concrete.fast(rules.decode_ready) is COMPILED[rules.decode_ready]  # calls no rule


S = fairness_rules.COUNTER_SCALE
P = fairness_rules.PRESSURE_TOKENS * S  # one resident request's worth of pressure at weight 1

#: Issue 38's rules at their edges, each way: ``(rule, args where it holds, args where it does not)``
#: (a Bool rule) or ``(rule, args, value)`` (an Int rule), checked on the source and on its compiled form.
FAIR_WHILE_RUNNING = [
    # light: demand within half the weighted share of all demand (3 users of weight 1, 12 requests)
    (fairness_rules.light_user, (2, 1, 12, 3), (3, 1, 12, 3)),
    # weight 2 of total weight 4: half its share of 12 is 3
    (fairness_rules.light_user, (3, 2, 12, 4), (4, 2, 12, 4)),
    # victims from the highest-pressure user only from one resident request's worth up
    (fairness_rules.victim_user_first, (P + 5, 5), (P + 4, 5)),
    # the taker's pressure after may equal the victim's after, not exceed it
    (fairness_rules.may_take, (7, 7), (8, 7)),
    # resident Q iterations: may give room; one fewer: not yet
    (fairness_rules.quantum_elapsed, (10, 138, 128), (10, 137, 128)),
    # the holder takes no request admitted as a holder
    (fairness_rules.not_a_holder, (False,), (True,)),
    # protected: the holder within Q of its admission, never a non-holder
    (fairness_rules.protected, (True, 10, 137, 128), (True, 10, 138, 128)),
    (fairness_rules.protected, (True, 10, 10, 128), (False, 10, 10, 128)),
    # requests behind a blocked head pass it once it has been blocked W iterations
    (fairness_rules.hold_elapsed, (8, 8), (7, 8)),
]

PRESSURE_VALUES = [  # (resident, weight, counter) -> resident * S / weight + counter, counter units
    ((0, 1, 5), 5),
    ((2, 1, 0), 2 * P),
    ((3, 2, 7), 3 * P // 2 + 7),
    ((1, 3, 0), -(-P // 3)),  # rounds up
]


@pytest.mark.parametrize("rule, holds, fails", FAIR_WHILE_RUNNING, ids=lambda x: getattr(x, "__name__", ""))
def test_fair_while_running_rules_at_their_edges(rule, holds, fails):
    for form in (rule, COMPILED[rule]):
        assert form(*holds) and not form(*fails), (rule.__name__, holds, fails)


@pytest.mark.parametrize("args, want", PRESSURE_VALUES)
def test_pressure_units_counts_resident_requests_per_weight_plus_the_counter(args, want):
    assert fairness_rules.pressure_units(*args) == COMPILED[fairness_rules.pressure_units](*args) == want

