"""What runs inside ``Scheduler.tick`` besides ``scheduler.py``: the KV block pool, the metrics
recorder, TTFT isolation, EASY backfilling and the backend interface (standard library only)."""
