"""Auto (layer 7, with the API): choosing a parallel layout for the user.

``search`` is ``epl.auto.accelerate``: it dry-runs candidate configs and keeps the
fastest that fits.  ``machines``, ``graph_profile``, ``layout``, ``predictor`` and
``planner`` are the scale planner (docs/plan.md): ``Cluster``, ``predict``, ``plan``.
May import every layer below.
"""
from epl.auto.search import accelerate  # noqa: F401
from epl.auto.machines import Cluster  # noqa: F401
from epl.auto.predictor import predict  # noqa: F401
from epl.auto.planner import plan  # noqa: F401
