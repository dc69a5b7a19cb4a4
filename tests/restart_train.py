"""A worker of the restart tests (tests/test_restarts.py), started by epl-launch.

    restart_train.py OUT_DIR DATA_DIR [estimator]

The job the issue describes: STEPS steps of the models' MLP with Adam (so the optimizer's
slots must survive a restart), a MonitoredTrainingSession that checkpoints every step into
OUT_DIR/ckpt, and deterministic input: FILES record files in DATA_DIR, each worker reading
its share through EPL's io.slicing, BATCH rows a step, skipping to the global step of the
newest checkpoint (the input position of this program is the global step: a restarted
worker reads on from where the restored step left off).  With "estimator", the same job
is an Estimator whose model_dir is OUT_DIR/ckpt (its own checkpoint every step).

Faults, from the environment (the tests set them):
* RESTART_KILL=w:s -- in the first attempt (EPL_RESTART_COUNT=0) worker w kills itself
  with SIGKILL right after global step s;
* RESTART_DOWN=w -- in every restarted attempt worker w exits with status 3 at start-up,
  before it joins the job (its "host" stays down);
* RESTART_PAUSE=w:s -- in the first attempt worker w waits after global step s (the test
  then kills its machine's launcher).

Each worker writes OUT_DIR/pid_<launch attempt>_<rank> (to check that nothing is left
running) and, at the last step, OUT_DIR/worker_<rank>.npz with its weights (not the
Estimator: its weights are in its last checkpoint).
"""
import os
import signal
import sys
import time

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import epl  # noqa: E402
from tests import models  # noqa: E402

STEPS, BATCH, FILES, ROWS_PER_FILE = 10, 4, 4, 20
RECORD = models.IN + 1   # float32s a record: the features, then the label


def write_files(data_dir):
    """The job's input: FILES files of ROWS_PER_FILE records; returns (x, y) of all rows
    in file order."""
    x, y = models.data(FILES * ROWS_PER_FILE)
    rows = np.concatenate([x, y[:, None].astype(np.float32)], axis=1).astype(np.float32)
    for f in range(FILES):
        part = rows[f * ROWS_PER_FILE:(f + 1) * ROWS_PER_FILE]
        with open(os.path.join(data_dir, "part-%d.bin" % f), "wb") as out:
            out.write(part.tobytes())
    return x, y


def files(data_dir):
    return [os.path.join(data_dir, "part-%d.bin" % f) for f in range(FILES)]


def global_batch(x, y, workers, step):
    """The rows of global step ``step`` when ``workers`` workers read the files as this
    program does (io.slicing: worker w reads files w, w + workers, ...)."""
    idx = []
    for w in range(workers):
        mine = np.concatenate([np.arange(f * ROWS_PER_FILE, (f + 1) * ROWS_PER_FILE)
                               for f in range(w, FILES, workers)])
        idx.append(mine[step * BATCH:(step + 1) * BATCH])
    idx = np.concatenate(idx)
    return x[idx], y[idx]


def _fault(name):
    value = os.environ.get(name, "")
    return [int(v) for v in value.split(":")] if value else None


def dataset(data_dir, start):
    """This worker's batches from global step ``start`` on (io.slicing picks its files)."""
    def parse(record):
        values = tf.reshape(tf.io.decode_raw(record, tf.float32), [RECORD])
        return values[:models.IN], tf.cast(values[models.IN], tf.int64)
    ds = tf.data.FixedLengthRecordDataset(files(data_dir), RECORD * 4)
    return ds.map(parse).batch(BATCH).skip(start)


class Faults(object):
    """Counts the global steps from ``start``; kills or pauses this worker where the
    environment says."""

    def __init__(self, attempt, rank, start):
        self.attempt, self.rank, self.step = attempt, rank, start
        self.kill, self.pause = _fault("RESTART_KILL"), _fault("RESTART_PAUSE")

    def stepped(self):
        self.step += 1
        print("step %d" % self.step, flush=True)
        if self.attempt == 0 and self.kill == [self.rank, self.step]:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.attempt == 0 and self.pause == [self.rank, self.step]:
            print("worker %d paused at step %d" % (self.rank, self.step), flush=True)
            time.sleep(300)


def train_monitored(out_dir, data_dir, ckpt_dir, start, faults):
    bx, by = tf.data.make_one_shot_iterator(dataset(data_dir, start)).get_next()
    _, loss = models.forward(bx, by)
    gs = tf.train.get_or_create_global_step()
    op = models.train_op(loss, "adam", gs)
    with tf.train.MonitoredTrainingSession(checkpoint_dir=ckpt_dir, save_checkpoint_steps=1,
                                           save_summaries_steps=None,
                                           save_summaries_secs=None,
                                           log_step_count_steps=None) as sess:
        restored = sess.run(gs)
        if restored != start:
            raise RuntimeError("restored global step %d, the input starts at %d"
                               % (restored, start))
        while faults.step < STEPS:
            sess.run(op)
            faults.stepped()
        np.savez(os.path.join(out_dir, "worker_%d.npz" % faults.rank), **models.weights(sess))


class _Hook(tf.train.SessionRunHook):
    def __init__(self, faults):
        self.faults = faults

    def after_run(self, run_context, run_values):
        self.faults.stepped()


def train_estimator(data_dir, ckpt_dir, start, faults):
    """The same job as an Estimator whose model_dir is the checkpoint folder."""
    def model_fn(features, labels, mode):
        _, loss = models.forward(features, labels)
        op = models.train_op(loss, "adam", tf.train.get_global_step())
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=op)
    config = tf.estimator.RunConfig(save_checkpoints_steps=1, save_summary_steps=None,
                                    log_step_count_steps=None)
    est = tf.estimator.Estimator(model_fn, model_dir=ckpt_dir, config=config)
    est.train(lambda: dataset(data_dir, start), max_steps=STEPS, hooks=[_Hook(faults)])


def main():
    out_dir, data_dir = sys.argv[1], sys.argv[2]
    estimator = len(sys.argv) > 3 and sys.argv[3] == "estimator"
    attempt = int(os.environ.get("EPL_RESTART_COUNT", "0"))
    rank = int(os.environ["EPL_WORKER_INDEX"])
    with open(os.path.join(out_dir, "pid_%d_%d" % (attempt, rank)), "w") as f:
        f.write(str(os.getpid()))
    down = _fault("RESTART_DOWN")
    if down and attempt > 0 and rank == down[0]:
        print("worker %d: its host is down" % rank, flush=True)
        sys.exit(3)
    tf.logging.set_verbosity(tf.logging.ERROR)
    epl.init(epl.Config({"io.slicing": True}))
    epl.set_default_strategy(epl.replicate(1))
    cluster = epl.Env.get().cluster
    ckpt_dir = os.path.join(out_dir, "ckpt")
    latest = tf.train.latest_checkpoint(ckpt_dir)
    start = int(tf.train.load_variable(latest, "global_step")) if latest else 0
    print("attempt %d: worker %d of %d starts at global step %d"
          % (attempt, rank, cluster.worker_num, start), flush=True)
    faults = Faults(attempt, rank, start)
    if estimator:
        train_estimator(data_dir, ckpt_dir, start, faults)
    else:
        train_monitored(out_dir, data_dir, ckpt_dir, start, faults)
    print("worker %d done at global step %d" % (rank, faults.step), flush=True)


if __name__ == "__main__":
    main()
