"""Plan (layer 7, api): ``python -m epl.plan``, the command line of the scale planner
(``epl.auto.plan``, docs/plan.md): the ranked layouts of a model on a cluster, printed
and written as JSON.  May import every layer below.
"""
