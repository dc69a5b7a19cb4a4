"""EPL's one TensorFlow adapter: the only code that touches TensorFlow's private
attributes, its C API and raw graph surgery.

The rest of EPL works through these small named functions and EPL's IR, so that the
differences between TensorFlow 1.15 and 2.x live here and nowhere else
(``tests/test_architecture.py`` fails when a module outside this package reaches into
TensorFlow's internals).

    version    which TensorFlow line is installed
    graph      op ids and creation order, edges (control inputs, rewiring), placement,
               reference dtypes, control-flow contexts, op creation and copies
    c_graph    the C API: bulk import of NodeDefs, NodeDef bytes, ops made from C outputs
    patching   the patch table: each TensorFlow entry point EPL wraps, by name
    behavior   the process-wide switches (eager, resource variables, ...) a process EPL
               spawns takes over from the one that started it
    op_types   op type names that differ between lines (tf.einsum's products)
    keras_state  the graph-mode keras backend that initializes EPL's own variables
    functions  control flow v2: the bodies of While / If ops in the function library
               (which captured variables they write, their FuncGraphs, adding copies)
    contexts   control flow v1: the kind of a WhileContext / CondContext, one rebuilt
               from its proto
    devices    the devices TensorFlow makes in this process (GPUs counted)
    variables  variable kinds without a public name (partitioned variables)
    grappler   the graph optimizer run on a built graph (what a session really runs)

It imports nothing else from EPL.
"""
from epl.tf_adapter.version import IS_TF2, VERSION  # noqa: F401
