"""Launch (layer 6, beside runtime): ``epl-launch``, which starts a job's workers and
watches them.

``launcher`` (the command line, worker processes, triage, restarts, the multi-machine
coordinator), ``processes`` (children that die with their parent) and ``display``
(the live progress view).  Workers and launcher speak through ``core.worker_files``.
May import ``runtime`` and the layers below it.
"""
