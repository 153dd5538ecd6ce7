"""``VTCPolicy.admission_order`` (heaps, lazy walk of the policy's heap) against a brute-force
reference written from its docstring: on random sequences of arrivals, admissions (also past
the first candidate), preemptions back to the queue, aborts, service and drain phases, with
tolerances 0..1000, weights and prices, the order, the counters and every lazy prefix match."""
import random

import pytest

from batch.policies.policy import DRAIN_SHARE, MAX_DRAIN_PASSES, VTCPolicy, remaining_iterations
from spec import fairness_rules as fr

S = fr.COUNTER_SCALE


class Req:
    def __init__(self, max_tokens):
        self.max_tokens = max_tokens
        self.generated = []


class Seq:
    def __init__(self, user, arrival_no, n_prompt, max_tokens):
        self.user_id, self.arrival_no, self.num_prompt_tokens = user, arrival_no, n_prompt
        self.num_prompt_tokens_served = 0
        self.req = Req(max_tokens)
        self.num_computed = 0

    @property
    def num_tokens(self):
        return self.num_prompt_tokens + len(self.req.generated)

    def __repr__(self):
        return f"S({self.user_id},{self.arrival_no},p{self.num_prompt_tokens}/{self.num_prompt_tokens_served},g{len(self.req.generated)})"


def cdiv(a, b):
    return -(-a // b)


class Ref:
    def __init__(self, T, weights, pp, op, chunk=64):
        self.T, self.w, self.pp, self.op, self.chunk = T * S, weights, pp, op, chunk
        self.c = {}
        self.wait = {}  # user -> list of seqs (set semantics)
        self.passes = {}
        self.drain = False

    def weight(self, u):
        return self.w.get(u, 1)

    def _activate(self, u):
        others = [self.c.get(v, 0) for v in self.wait if v != u]
        own = self.c.get(u, 0)
        if others:
            self.c[u] = max(own, min(others) - self.T - 1)

    def add(self, s):
        new = s.user_id not in self.wait
        self.wait.setdefault(s.user_id, []).append(s)
        if new:
            self._activate(s.user_id)

    requeue = add

    def discard(self, s):
        self.passes.pop(s, None)
        lst = self.wait[s.user_id]
        lst.remove(s)
        if not lst:
            del self.wait[s.user_id]

    def remove(self, s):
        if self.drain:
            for q in self.wait[s.user_id]:
                if q.arrival_no < s.arrival_no:
                    self.passes[q] = self.passes.get(q, 0) + 1
        self.discard(s)

    def on_service(self, u, p, o):
        self.c[u] = self.c.get(u, 0) + cdiv((self.pp * p + self.op * o) * S, self.weight(u))

    def before_admission(self, resident):
        num, den = DRAIN_SHARE
        n = sum(len(v) for v in self.wait.values())
        self.drain = n * den <= num * resident

    def user_order(self, u):
        lst = sorted(self.wait[u], key=lambda q: q.arrival_no)
        if self.drain:
            lst = sorted(lst, key=lambda q: (self.passes.get(q, 0) < MAX_DRAIN_PASSES,
                                             -remaining_iterations(q, self.chunk), q.arrival_no))
        return lst

    def order(self):
        qs = {u: self.user_order(u) for u in self.wait}
        local = {u: self.c.get(u, 0) for u in qs}
        out = []
        while qs:
            least = min(local[u] for u in qs)
            elig = [u for u in qs if local[u] <= least + self.T]
            u = min(elig, key=lambda u: qs[u][0].arrival_no)
            s = qs[u].pop(0)
            out.append(s)
            local[u] += cdiv(self.pp * (s.num_prompt_tokens - s.num_prompt_tokens_served) * S, self.weight(u))
            if not qs[u]:
                del qs[u]
        return out


def run(seed, steps=300):
    """One random run, compared after every step; True when every comparison held."""
    rng = random.Random(seed)
    T = rng.choice([0, 0, 1, 5, 20, 100, 1000])
    nusers = rng.randint(1, 12)
    users = [f"u{i}" for i in range(nusers)]
    weights = {u: rng.randint(1, 16) for u in users if rng.random() < 0.4}
    pp, op = rng.choice([(1, 2), (1, 2), (0, 1), (3, 0)])
    pol = VTCPolicy(tolerance_tokens=T, weights=weights, prompt_price=pp, output_price=op)
    ref = Ref(T, weights, pp, op)
    arrival = 0
    waiting = []
    resident = []
    for step in range(steps):
        op_ = rng.random()
        if op_ < 0.35 or not waiting:
            s = Seq(rng.choice(users), arrival, rng.randint(1, 200), rng.randint(1, 50))
            arrival += 1
            pol.add(s); ref.add(s); waiting.append(s)
        elif op_ < 0.55:
            # admit: the k-th of the order (backfill) after before_admission
            resid = rng.choice([0, len(resident), 4 * len(waiting) + rng.randint(0, 5)])
            pol.before_admission(resid, 64); ref.before_admission(resid)
            order = list(pol.admission_order())
            k = 0 if rng.random() < 0.7 else rng.randrange(len(order))
            s = order[k]
            pol.remove(s); ref.remove(s); waiting.remove(s); resident.append(s)
        elif op_ < 0.65 and resident:
            s = resident.pop(rng.randrange(len(resident)))
            s.num_prompt_tokens_served = rng.choice([0, rng.randint(0, s.num_prompt_tokens), s.num_prompt_tokens])
            if rng.random() < 0.5:
                s.req.generated = [0] * rng.randint(1, 10)
            pol.requeue(s); ref.requeue(s); waiting.append(s)
        elif op_ < 0.72:
            s = waiting.pop(rng.randrange(len(waiting)))
            pol.discard(s); ref.discard(s)
        elif op_ < 0.85:
            u = rng.choice(users)
            p, o = rng.randint(0, 100), rng.randint(0, 30)
            pol.on_service(u, p, o); ref.on_service(u, p, o)
        elif resident and op_ < 0.9:
            resident.pop(rng.randrange(len(resident)))  # finished
        # compare
        if rng.random() < 0.5:
            resid = rng.choice([0, len(resident), 4 * len(waiting)])
            pol.before_admission(resid, 64); ref.before_admission(resid)
        got = list(pol.admission_order())
        exp = ref.order()
        assert len(got) == len(set(map(id, got))), ("dup", seed, step, got)
        assert set(map(id, got)) == set(map(id, waiting)), ("set", seed, step)
        for u in users:
            assert pol.counter(u) == ref.c.get(u, 0), ("counter", seed, step, u, pol.counter(u), ref.c.get(u, 0))
        assert got == exp, ("order", seed, step, T, ref.drain, got[:10], exp[:10])
        # lazy partial consumption equals prefix
        it = pol.admission_order()
        k = rng.randint(0, len(exp))
        part = [next(it) for _ in range(k)]
        assert part == exp[:k]
    return True


@pytest.mark.parametrize("seed", range(80))
def test_admission_order_matches_the_brute_force_reference(seed):
    assert run(seed, steps=200)
