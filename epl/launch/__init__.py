"""Launch (layer 6, beside runtime): ``epl-launch``, which starts a job's workers and
watches them.

One job a module: ``cli`` (the command line and ``main``; ``python -m epl.launch``),
``ports`` (where workers listen), ``launch_dirs`` (an attempt's folder and shared memory),
``workers`` (the processes of an attempt: environment, logs, watch, stop), ``triage``
(the root cause of a failure), ``restart`` (the one restart policy, the attempt loop, the
summary), ``signals`` (Ctrl-C and SIGTERM), ``channel`` and ``coordinator`` (several
machines: machine 0's launcher decides), ``slurm`` (``--slurm``: the workers as a Slurm
job step, a new step a restart), ``processes`` (children that die with their
parent) and ``display`` (the live progress view).  Workers and launcher speak through
``core.worker_files``.  May import ``runtime`` and the layers below it.
"""
