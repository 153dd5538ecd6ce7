"""The lifecycle table's properties, checked over the whole table (``lifecycle_table``).

A plugin of ``spec.verify`` (listed in its ``PLUGINS``). ``spec/lifecycle.py``'s ``TRANSITIONS``
is the table the scheduler's ``transitions.Machine`` is built from, so a wrong row is a wrong
scheduler: the machine would then let the code fire, for example, ``done -> decoding`` without
an error. The check reads ``lc.TRANSITIONS`` when it runs, so a test can plant a row
(``monkeypatch.setattr(lc, "TRANSITIONS", ...)``) and see it fail; ``tests/test_stateful.py``
checks that every state change the real scheduler makes is a row of the table.

It is exhaustive, not sampled: the table is finite (six states, six events), so every state,
every event and every path is visited (reachability by a graph search).
"""
from __future__ import annotations

from collections.abc import Iterable

from spec import lifecycle as lc
from spec.verify import Options, Outcome, StateCounterexample, register

#: The events that grant blocks (waiting -> resident) and the one that takes them back while the
#: request still lives (resident -> waiting): the KV ledger (``kv_within_cap``, ``ledger_consistent``)
#: counts on no other event moving a request between the two.
GRANTS = frozenset({"admit", "resume"})
RECLAIMS = frozenset({"preempt"})


def _reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def table_violations(table: Iterable[tuple[str, tuple[str, ...], str]]) -> list[str]:
    """The properties ``table`` breaks (empty: it has them all).

    Args:
        table: rows ``(event, sources, destination)``, as ``spec.lifecycle.TRANSITIONS``.

    Returns:
        One line per broken property: every state is known; each event has one row; final states
        (``done``, ``aborted``) have no way out; from ``queued`` every state is reachable and
        from every live state both ``done`` and ``aborted`` are (no request can be stuck);
        ``abort`` leaves every live state for ``aborted``; ``finish`` ends only resident requests
        (EOS and ``max_tokens`` are seen in a forward) in ``done``; a move from waiting to
        resident is a grant (``admit``, ``resume``) and from resident to waiting is ``preempt``,
        and nothing enters ``queued`` again.
    """
    rows = list(table)
    states = set(lc.STATES)
    bad: list[str] = []
    events = [e for e, _, _ in rows]
    bad += [f"event {e!r} has {events.count(e)} rows" for e in sorted(set(events)) if events.count(e) != 1]
    edges: dict[str, set[str]] = {}
    for event, sources, dest in rows:
        for s in (*sources, dest):
            if s not in states:
                bad.append(f"{event}: unknown state {s!r}")
        for s in sources:
            edges.setdefault(s, set()).add(dest)
            if s in lc.FINAL_STATES:
                bad.append(f"{event}: leaves the final state {s!r} (for {dest!r})")
            if s in lc.WAITING_STATES and dest in lc.RESIDENT_STATES and event not in GRANTS:
                bad.append(f"{event}: {s} -> {dest} makes a request resident without a grant")
            if s in lc.RESIDENT_STATES and dest in lc.WAITING_STATES and event not in RECLAIMS:
                bad.append(f"{event}: {s} -> {dest} makes a resident request wait without preempting it")
            if dest == lc.QUEUED:
                bad.append(f"{event}: {s} -> queued (a request enters the queue only by submit)")
    live = [s for s in lc.STATES if s not in lc.FINAL_STATES]
    missing = states - _reachable(edges, lc.QUEUED)
    if missing:
        bad.append(f"unreachable from queued: {sorted(missing)}")
    for s in live:
        ends = _reachable(edges, s) & lc.FINAL_STATES
        if ends != lc.FINAL_STATES:
            bad.append(f"from {s}: reaches only {sorted(ends)} of the final states")
    by_event = {e: (set(src), d) for e, src, d in rows}
    abort = by_event.get("abort")
    if abort is None or abort != (set(live), lc.ABORTED):
        bad.append(f"abort: must take every live state {live} to aborted, has {abort}")
    finish = by_event.get("finish")
    if finish is None or finish != (set(lc.RESIDENT_STATES), lc.DONE):
        bad.append(f"finish: must take exactly the resident states to done, has {finish}")
    return bad


@register("lifecycle_table",
          "the request lifecycle table (spec/lifecycle.py TRANSITIONS) has final states with no way out, "
          "every state reachable from queued and both final states reachable from every live state, abort "
          "from every live state, finish only from a resident state, and moves between waiting and resident "
          "only by a grant (admit, resume) or preempt")
def check_lifecycle_table(opts: Options) -> Outcome:
    """Exhaustive over the finite table (``table_violations``); ``opts`` is unused."""
    bound = f"exhaustive: {len(lc.STATES)} states, {len(lc.TRANSITIONS)} rows, every path"
    bad = table_violations(lc.TRANSITIONS)
    if not bad:
        return Outcome("proved", bound, "no property broken")
    rows = {e: f"{list(src)} -> {d}" for e, src, d in lc.TRANSITIONS}
    return Outcome("counterexample", bound, counterexample=StateCounterexample("the table", bad, rows))
