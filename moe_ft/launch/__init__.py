"""``moe-ft launch``: a torch elastic launcher that replaces only the workers that failed.

``agent.py`` subclasses torch elastic's ``LocalElasticAgent`` (its rendezvous and store stay): every worker
runs in a process context of its own, so one that dies leaves the others running; a warm spare (started
with the group, imports done, waiting) takes the dead rank, and the agent announces a new *attempt*
through the store. The agent is built in layers, one module each (``state.py``, ``processes.py``,
``membership.py``, ``spares.py``, ``decisions.py``; the policy as pure functions in ``policy.py``).
``protocol.py`` is the store contract between the agent and its workers; ``worker.py`` is the worker's
side: a spare waits for its rank, a survivor tears its process groups down and joins the next attempt in
the same process. ``cli.py`` parses torchrun's flags plus the spare options.
"""
