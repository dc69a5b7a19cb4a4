"""The model's head under ``epl.split``: finding the head worth splitting, and opening
the split scope around it while the user's model builds.

``accelerate``'s ``split`` candidate (the replicated-backbone / split-head hybrid of
docs/split.md) and the planner's built step of it (``step_graph``) build the model the
same way, so both take it from here: the k-th Dense layer in build order, and
everything after it, under ``epl.split(devices)``; the rest replicated."""
import tensorflow as tf

import epl
from epl.capture import patches
from epl.ir import capture_context
from epl.ir import strategies


class DenseLayers(object):
    """Records every Dense layer model_fn builds: (name, weights) in build order."""

    def __init__(self):
        self.layers = []

    def building(self, layer, input_shape):
        inputs = tf.compat.dimension_value(tf.TensorShape(input_shape)[-1]) or 0
        self.layers.append((layer.name, inputs * layer.units + layer.units))

    def called(self, layer):
        pass


class SplitFrom(object):
    """Opens ``epl.split(devices)`` when the ``index``-th Dense layer builds; after its
    call the rest of the model (the loss) is left unannotated, as in the hybrid of
    docs/split.md."""

    def __init__(self, index, devices):
        self.index, self.devices = index, devices
        self.seen = 0
        self.scope = None
        self.layer = None

    def building(self, layer, input_shape):
        if self.seen == self.index:
            epl.set_default_strategy(None)
            self.scope = epl.split(self.devices)
            self.scope.__enter__()
            self.layer = layer
        self.seen += 1

    def called(self, layer):
        if layer is self.layer and self.scope is not None:
            self.scope.__exit__(None, None, None)
            self.scope = None

    def check(self):
        if self.layer is None:
            raise ValueError("epl.auto: the strategy splits Dense layer %d, but the model "
                             "builds %d Dense layers." % (self.index, self.seen))


def find(model_fn, dataset_fn):
    """The build-order index of the model's largest Dense layer when it is the last
    one built (a head worth splitting), else None.  Probed in a scratch graph."""
    patches.install()    # (idempotent; the probe needs the Dense observers)
    probe = DenseLayers()
    saved = strategies.current_strategy()
    strategies.reset()
    try:
        with tf.Graph().as_default():
            features = tf.compat.v1.data.make_one_shot_iterator(dataset_fn()).get_next()
            with capture_context.observing_dense(probe):
                model_fn(features)
    finally:
        strategies.reset()
        if saved is not None:
            strategies._stack().default = saved  # pylint: disable=protected-access
    if len(probe.layers) < 2:
        return None
    sizes = [size for _, size in probe.layers]
    return len(sizes) - 1 if sizes[-1] > max(sizes[:-1]) else None


def build_loss(model_fn, features, layer, devices):
    """``model_fn(features)`` with its ``layer``-th Dense layer and what follows under
    ``epl.split(devices)`` (after ``epl.init``, the default strategy replicated): the
    loss."""
    observer = SplitFrom(int(layer), devices)
    with capture_context.observing_dense(observer):
        loss = model_fn(features)
    observer.check()
    return loss
