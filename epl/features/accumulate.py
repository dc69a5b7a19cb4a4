"""Gradient accumulation across session runs: ``pipeline.num_micro_batch = m > 1`` on
a model without any EPL annotation (the original EPL's behaviour there).

Each ``session.run`` of the train op computes one micro-batch's gradients and adds
them to accumulators; the m-th run applies their mean (or sum, per
``communication.gradients_reduce_method``) with the user's optimizer and resets
them.  ``global_step`` (and every other effect of ``apply_gradients``: slots,
Adam's beta powers, a keras optimizer's ``iterations``) advances once per m runs;
so does a ``global_step`` incremented by hand beside the train op
(``apply_gate.guard_step``).
The graph holds one copy of the model whatever m is (annotated models instead run
all m micro-batches inside each run, as copies).

How: an apply-path hook (``epl.capture.apply_hooks``, named "accumulate", after
"sparse_as_dense") builds it around each user ``apply_gradients`` call; the
optimizer's update is gated on "this run is the m-th" (``epl.features.apply_gate``).  The
op ``apply_gradients`` returns always runs: after the accumulation, and on the
m-th run after the update and the reset.

The accumulators and the run counter are EPL's own state (``epl.ir.internal_state``):
initialized with the other global variables but left out of checkpoints written by
a default ``tf.train.Saver``, so checkpoints interchange with the same program
trained without accumulation.
"""
import tensorflow as tf

from epl.capture import apply_hooks
from epl.features import apply_gate
from epl.ir.internal_state import variable as _state


class AcrossRuns(object):
    """The accumulation around one ``apply_gradients`` call."""

    def __init__(self, grads_and_vars, num_micro_batch, reduce_method):
        self.m = num_micro_batch
        pairs = [(g, v) for g, v in grads_and_vars]
        with tf.compat.v1.name_scope("EPL_ACCUMULATE"):
            self.counter = _state("run_counter", lambda: tf.zeros([], tf.int64))
            count = self.counter.assign_add(1, read_value=True)
            self.pred = tf.equal(count % self.m, 0, name="apply_now")
            apply_gate.register(self.pred)
            self.accumulators, self.grads_and_vars = [], []
            for g, v in pairs:
                if g is None:
                    self.grads_and_vars.append((g, v))
                    continue
                g = tf.convert_to_tensor(g)   # an embedding's IndexedSlices, densified
                acc = _state(v.op.name + "/accumulator", _zeros_like(v, g))
                total = acc.assign_add(g, read_value=True)
                if reduce_method == "mean":
                    total = total / tf.cast(self.m, total.dtype)
                self.accumulators.append(acc)
                self.grads_and_vars.append((apply_gate.when(total, self.pred), v))

    def finish(self, applied):
        """The op to return to the user: accumulated (and, on the m-th run, applied
        and reset)."""
        with tf.compat.v1.name_scope("EPL_ACCUMULATE"):
            with tf.control_dependencies([applied]):
                resets = [acc.assign(tf.zeros_like(acc), read_value=False)
                          for acc in self.accumulators]
            return apply_gate.done(self.pred, resets or [applied])


def _zeros_like(v, g):
    if g.shape.is_fully_defined():
        return lambda: tf.zeros(g.shape, g.dtype)
    return lambda: tf.zeros(tf.shape(v.initialized_value()), g.dtype)


class _Hook(apply_hooks.ApplyHook):
    """Accumulation's part in a user's ``apply_gradients`` (``pipeline.num_micro_batch >
    1`` on a model without annotation): the optimizer gets the accumulated gradients,
    gated on the m-th run, and the call returns the gate's always-live op."""

    name = "accumulate"
    after = ("sparse_as_dense",)    # accumulates the gradients as the optimizer gets them

    def applies(self, call):
        return call.config.get("pipeline.num_micro_batch") > 1 and not call.epl_graph.taskgraphs

    def prepare(self, call):
        call.across_runs = True

    def wrap(self, call, apply):
        def accumulated(grads_and_vars):
            gate = AcrossRuns(grads_and_vars, call.config.get("pipeline.num_micro_batch"),
                              call.config.get("communication.gradients_reduce_method"))
            return gate.finish(apply(gate.grads_and_vars))
        return accumulated


apply_hooks.register(_Hook())
