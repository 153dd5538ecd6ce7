"""What runs inside ``Scheduler.tick`` besides ``scheduler.py``: the typed state (``state``), the
tick's steps (``step``), the KV block pool and the opt-in prefix cache, the metrics recorder and the
backend interface (standard library only; ``docs/design.md``)."""
