"""The simulation harness: arrival replay through a scheduler on the simulated GPU
(``simulate``), benchmark workloads (``workloads``) and production-trace loading (``traces``)."""
