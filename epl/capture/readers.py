"""IO slicing: each worker reads a disjoint share of a file-based dataset.

With ``io.slicing`` the file list given to ``tf.data.TFRecordDataset``,
``TextLineDataset`` or ``FixedLengthRecordDataset`` is divided across the
workers (the replicas of a worker share its iterator, each pulling its own
batches).  Together the workers read every file, except that
``io.drop_last_files`` drops the last ``n % workers`` files so that the
shares are equal; ``io.unbalanced_io_slicing`` allows unequal shares (and
fewer files than workers) instead of failing.

Patch point 10 of ``epl.capture.patches``:
``readers.{TFRecord,TextLine,FixedLengthRecord}DatasetV2.__init__`` read
:func:`sliced_filenames` (:func:`reader_init`).
"""
from epl.core.process_state import Env
from epl.tf_adapter.patching import original


def slice_files(files, num_shards, index, unbalanced=False, drop_last=False):
    """This shard's files: files[index::num_shards] of the (possibly truncated) list."""
    files = list(files)
    n = len(files)
    if num_shards <= 1:
        return files
    fix = ("set io.unbalanced_io_slicing to allow unequal shares, or io.drop_last_files "
           "to drop the last files")
    if drop_last:
        keep = n - n % num_shards
        if keep == 0 and not unbalanced:
            raise ValueError("io.slicing: %d file(s) cannot be shared by %d workers: every "
                             "file would be dropped (io.drop_last_files); provide at least %d "
                             "files." % (n, num_shards, num_shards))
        files = files[:keep] if keep else files
    elif n < num_shards and not unbalanced:
        raise ValueError("io.slicing: %d file(s) are too few for %d workers (each needs at "
                         "least one); provide more files, or %s." % (n, num_shards, fix))
    elif n % num_shards and not unbalanced:
        raise ValueError("io.slicing: %d files cannot be divided evenly over %d workers "
                         "(%d left over); %s." % (n, num_shards, n % num_shards, fix))
    return files[index::num_shards]


def sliced_filenames(filenames):
    """``filenames`` as this worker should read them (unchanged without io.slicing)."""
    if not Env.initialized():
        return filenames
    env = Env.get()
    if not env.config.get("io.slicing") or env.cluster.worker_num <= 1:
        return filenames
    if isinstance(filenames, (bytes, str)):
        filenames = [filenames]
    if not isinstance(filenames, (list, tuple)):
        raise ValueError("io.slicing needs the file names as a Python list (got %r); pass "
                         "the list, or shard the dataset yourself with Dataset.shard."
                         % (filenames,))
    return slice_files(filenames, env.cluster.worker_num, env.cluster.worker_index,
                       env.config.get("io.unbalanced_io_slicing"),
                       env.config.get("io.drop_last_files"))


def reader_init(point):
    """The ``__init__`` of the reader dataset at patch ``point``, on this worker's files."""
    def init(self, filenames, *args, **kwargs):
        return original(point)(self, sliced_filenames(filenames), *args, **kwargs)
    return init
