"""The marks a worker leaves in its launch folder for epl-launch.

A worker writes ``worker_<i>.joined`` into ``EPL_LAUNCH_DIR`` when it first runs the
job's rewritten graph (from then on its peers may wait for it in collectives); the
launcher reads them.  Kept apart from epl.launch.launcher so that a worker (through
epl.runtime) does not import the launcher's command-line module: ``python -m
epl.launch.launcher`` would then find it already imported and warn.
"""
import os

# The folder through which the workers tell the launcher that they joined the job.
LAUNCH_DIR_ENV = "EPL_LAUNCH_DIR"
_marked = []


def mark_joined():
    """Called in a worker (by EPL) when it first runs the job's rewritten graph: from now
    on its peers may wait for it in collectives.  A no-op outside epl-launch."""
    folder, index = os.environ.get(LAUNCH_DIR_ENV), os.environ.get("EPL_WORKER_INDEX")
    if _marked or not folder or index is None:
        return
    _marked.append(True)
    try:
        open(os.path.join(folder, "worker_%s.joined" % index), "w").close()
    except OSError:
        pass   # (the launcher is gone, or the folder with it: nothing to tell)


def joined(launch_dir, index):
    return os.path.exists(os.path.join(launch_dir, "worker_%d.joined" % index))
