"""Admission and victim policies (``policy``: VTC, FCFS, round robin), the baseline schedulers
(``baselines``) and a clairvoyant reference policy (``oracle``); standard library only."""
