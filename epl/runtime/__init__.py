"""Runtime (layer 6): where EPL meets the user's training loop while it runs.

``session_run`` (EPL's devices in every session, when to rewrite, merged fetches),
``integration`` (Session, Estimator, checkpoint and summary hooks), ``distributed``
(workers that serve an in-graph job) and ``progress`` (a worker's live progress).
May import ``rewrite`` and every layer below it.
"""
