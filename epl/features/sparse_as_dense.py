"""``communication.sparse_as_dense``: an optimizer gets every sparse gradient
(``tf.IndexedSlices``: an embedding's, a gather's) as a dense tensor.

The gradient is converted where the user's ``apply_gradients`` call receives it,
before the apply phase (an apply-path hook, ``epl.capture.apply_hooks``, named
"sparse_as_dense", first): the optimizer, the ``ir.ApplyRecord`` the rewrite reads
and the hooks after it all see the dense gradient.
"""
import tensorflow as tf

from epl.capture import apply_hooks


def densified(grads_and_vars):
    """``grads_and_vars`` with each ``tf.IndexedSlices`` gradient made dense."""
    return [(tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g, v)
            for g, v in grads_and_vars]


class _Hook(apply_hooks.ApplyHook):
    """``sparse_as_dense``'s part in a user's ``apply_gradients``."""

    name = "sparse_as_dense"

    def applies(self, call):
        return bool(call.config.get("communication.sparse_as_dense"))

    def prepare(self, call):
        call.grads_and_vars = densified(call.grads_and_vars)


apply_hooks.register(_Hook())
