"""``batch-llm serve``: an OpenAI-compatible HTTP server over the scheduler (the optional ``serve`` extra).

* ``engine``: the engine thread that owns and ticks the ``Scheduler`` (commands in through a
  queue, tokens out through ``loop.call_soon_threadsafe``), and the simulated GPU it serves;
* ``app``: the FastAPI app (completions, chat completions, models, health, metrics);
* ``auth``: API keys (checked in constant time) and the fairness identity the server gives;
* ``metrics``: the Prometheus metrics; ``tokenizer``: text <-> token ids;
* ``serve``: the command line (``batch-llm serve``); ``bench_serve``: the load generator
  (``batch-llm bench-serve``).

``docs/server.md`` has the design and the measured figures. Nothing here is imported by
``scheduler``, ``inference_stub`` or ``request_gen``.
"""
