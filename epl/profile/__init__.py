"""Where a step's time goes: EPL's traces of chosen runs and their analysis.

    record      (at run time) traces the training steps ``profile.steps`` names (and
                the runs ``profile.runs`` names) into ``profile.dir``: one Chrome trace
                per worker and step, with EPL's own
                spans (collectives: wait vs move; pipeline stages' micro-batches; the
                rewrite's passes)
    collectives the C++ collectives' records (ctypes on the loaded library)
    analysis    reads a folder of traces: per device compute, communication (exposed
                vs hidden behind compute), waiting, idle; the pipeline bubble; top ops
    png / render  a picture of the step (a lane per device, stacked bars per device)

    python -m epl.profile DIR      # prints the breakdown, writes DIR/profile.png

See docs/profiling.md.  Runtime layer (6): may import ``rewrite`` and the layers below.
"""
