"""The policy interface with FCFS as its defaults (``policy``), VTC (``vtc``), round robin
(``roundrobin``) and a clairvoyant reference policy (``oracle``); standard library only. The
baseline schedulers live in ``batch.sim.baselines``."""
