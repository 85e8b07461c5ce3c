"""Localized recovery (MoEvement §3.4, App. A): only the failed pipeline stage's data-parallel group rolls
back and replays, fed by the logs its neighbours kept (``docs/localized.md``).

Upstream logging and log-fed replay: ``log_store.py`` (the per-rank log directory), ``upstream_log.py``
(capture at Megatron's p2p seam), ``collective_log.py`` (results of collectives that span stages),
``log_replay.py`` (replay under logs, ``exchange_logs``), ``component.py`` (the runtime component).
"""
