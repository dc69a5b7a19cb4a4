"""Saver capture: a ``tf.train.Saver``'s save and restore ops are the save phase, and a
default Saver leaves EPL's own state out (patch point 5 of ``epl.capture.patches``).

5. ``saver.Saver.build`` (:func:`saver_build`): the ops a Saver builds are recorded in
   the save phase (the rewrite leaves them alone); a Saver built with the default
   variable list saves the user's variables only, not EPL's own state
   (``epl.ir.internal_state``: accumulators, AMP's loss scale), and its restore starts
   that state again.  (``saver.Saver.save`` writes only on the chief:
   ``epl.runtime.integration``.)
"""
import tensorflow as tf

from epl.ir import internal_state
from epl.ir.capture_context import state as _c
from epl.tf_adapter import objects
from epl.tf_adapter.patching import original


def saver_build(self, *args, **kwargs):
    c = _c()
    c.save += 1
    graph = None
    if objects.saver_default_var_list(self):
        graph = tf.compat.v1.get_default_graph()
        if graph.get_collection(internal_state.COLLECTION):
            objects.set_saver_var_list(self, internal_state.saveable_default(graph))
        else:
            graph = None
    try:
        built = original("saver.build")(self, *args, **kwargs)
    finally:
        c.save -= 1
    if graph is not None:   # its restore starts EPL's own state again
        internal_state.reinitialize_on_restore(self, graph)
    return built
