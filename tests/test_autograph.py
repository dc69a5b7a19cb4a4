"""Autograph never rewrites EPL's own code.

Keras converts a subclassed layer's ``call`` with autograph, which then converts every
Python function the converted code calls unless its module is on autograph's
do-not-convert list.  A layer calling ``tf.einsum`` (patched by EPL for tensor
parallelism) had EPL's capture code converted too, and depending on what had been
converted before, ``sharding.lookup`` failed with "tf__get() takes from 0 to 1 positional
arguments but 2 were given" (the MoE user layer of test_moe_user_layer, in a full run).
"""
import tensorflow.compat.v1 as tf
from tensorflow.python.autograph.impl import conversion

import epl
from epl import ir
from epl.capture import tensor_parallel_routing
from epl.tensor_parallel import sharding


def _left_alone(f):
    """Autograph's own answer: would converted code call ``f`` as it is?"""
    if hasattr(conversion, "is_allowlisted"):               # TF 2.x
        return conversion.is_allowlisted(f)
    return conversion.is_whitelisted_for_graph(f)           # TF 1.15


def test_epl_functions_are_not_converted_once_epl_is_initialized():
    epl.init()
    for f in (tensor_parallel_routing.einsum, sharding.lookup, ir.Graph.get, ir.TensorMap.get):
        assert _left_alone(f), f


def test_a_user_function_is_still_converted():
    epl.init()

    def user_layer_call(x):
        return x
    assert not _left_alone(user_layer_call)
    assert tf.autograph.to_graph(user_layer_call) is not user_layer_call
