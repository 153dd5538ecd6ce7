"""The formal specification of Batch: the request lifecycle as data, the scheduling rules and
the invariants as pure integer functions.

``scheduler.py`` imports its states, transition table and rule functions from here, so the
spec and the code cannot drift; the z3 proofs (``spec/verify.py``) evaluate the very same
functions on ``z3.Int`` terms.
"""
from spec.lifecycle import EVENTS, FINAL_STATES, RESIDENT_STATES, STATES, TRANSITIONS, WAITING_STATES, new_machine
from spec import logic, rules

__all__ = ["EVENTS", "FINAL_STATES", "RESIDENT_STATES", "STATES", "TRANSITIONS", "WAITING_STATES", "new_machine",
           "logic", "rules"]
