"""Auto (layer 7, with the API): choosing a parallel layout for the user.

``search`` is ``epl.auto.accelerate``: it dry-runs candidate configs and keeps the
fastest that fits.  May import every layer below.
"""
from epl.auto.search import accelerate  # noqa: F401
