"""The protocol between epl-launch and the workers it starts: the environment it gives
them and the files they leave for it in the attempt's launch folder.

It exists once, here, because both sides must spell it the same way and they live in
different layers: the launcher (``epl.launch``) writes the environment and reads the
files; a worker (``epl.runtime``: its session and its progress samples; ``epl.core.
cluster``: the job and its addresses) reads the environment and writes the files.  In
``core`` so that a worker needs nothing of the launcher: ``python -m epl.launch.cli``
would warn if a worker had imported the command-line module already.

The launch folder (``EPL_LAUNCH_DIR``, one per attempt) holds:

* ``worker_<i>.joined`` -- worker ``i`` (its rank in the attempt, ``EPL_WORKER_INDEX``)
  ran the job's rewritten graph for the first time: from then on its peers may wait for it
  in collectives (``mark_joined``, ``joined``);
* ``worker_<i>.progress.jsonl`` -- its progress samples, one JSON line each
  (``progress_path``; written by ``epl.runtime.progress``, read by ``epl.launch.display``);
* ``launcher.pid`` -- the launcher that owns the folder (``OWNER_FILE``).
"""
import os

# -- the environment epl-launch gives every worker ----------------------------------------
LAUNCH_DIR_ENV = "EPL_LAUNCH_DIR"                  # this attempt's launch folder
WORKER_INDEX_ENV = "EPL_WORKER_INDEX"              # the worker's rank in this attempt
RESTART_COUNT_ENV = "EPL_RESTART_COUNT"            # the attempt: 0 first, 1 after a restart
LAUNCH_NUM_WORKERS_ENV = "EPL_LAUNCH_NUM_WORKERS"  # --num_workers as launched
JOB_ID_ENV = "EPL_JOB_ID"                          # names the job's collectives on a host
RUN_ID_ENV = "EPL_RUN_ID"                          # names this attempt's shared memory
JOB_SECRET_ENV = "EPL_JOB_SECRET"                  # what the TCP collectives prove
COMM_ADDRESSES_ENV = "EPL_COMM_ADDRESSES"          # EPL's collectives: host:port a worker
# (the config's environment name of cluster.devices_per_worker: epl.core.config)
DEVICES_PER_WORKER_ENV = "EPL_CLUSTER_DEVICES_PER_WORKER"

# -- the files of a launch folder --------------------------------------------------------
LAUNCH_DIR_PREFIX = "epl-launch-"                  # $TMPDIR/epl-launch-<run>-*
OWNER_FILE = "launcher.pid"
JOINED_PATTERN = "worker_%s.joined"
PROGRESS_PATTERN = "worker_%s.progress.jsonl"

_marked = []


def this_worker():
    """(launch folder, rank) of this process under epl-launch; (None, None) outside it."""
    folder, index = os.environ.get(LAUNCH_DIR_ENV), os.environ.get(WORKER_INDEX_ENV)
    if not folder or index is None:
        return None, None
    return folder, index


def progress_path(launch_dir, worker):
    """Where worker ``worker`` (its rank) appends its progress samples."""
    return os.path.join(launch_dir, PROGRESS_PATTERN % worker)


def mark_joined():
    """Called in a worker (by EPL) when it first runs the job's rewritten graph: from now
    on its peers may wait for it in collectives.  A no-op outside epl-launch."""
    folder, index = this_worker()
    if _marked or folder is None:
        return
    _marked.append(True)
    try:
        open(os.path.join(folder, JOINED_PATTERN % index), "w").close()
    except OSError:
        pass   # (the launcher is gone, or the folder with it: nothing to tell)


def joined(launch_dir, index):
    """Whether worker ``index`` (its rank) of the attempt of ``launch_dir`` joined."""
    return os.path.exists(os.path.join(launch_dir, JOINED_PATTERN % index))
