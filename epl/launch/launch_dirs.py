"""What an attempt leaves on this machine, and how it goes: its launch folder and its
shared memory.

Each attempt has a launch folder ($TMPDIR/epl-launch-<run>-*, its workers' EPL_LAUNCH_DIR,
the files of ``epl.core.worker_files``) and a run id whose shared-memory segments
(/dev/shm/epl-<run>-*) are its own.  The launcher removes both when the attempt ends; a
launcher killed outright (SIGKILL) cannot, so its folder names it (``launcher.pid``) and
the next launch on the machine removes the folders of launchers that are gone.
"""
import glob
import os
import shutil
import tempfile

from epl.core.worker_files import LAUNCH_DIR_PREFIX, OWNER_FILE


def new_launch_dir(run_id):
    """The launch folder of one attempt, marked with this launcher's pid so that a later
    launch can tell it from a live one's when this launcher is killed outright (SIGKILL
    leaves its folder behind)."""
    folder = tempfile.mkdtemp(prefix="%s%s-" % (LAUNCH_DIR_PREFIX, run_id))
    with open(os.path.join(folder, OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    return folder


def sweep_launch_dirs(root=None):
    """Remove the launch folders of launchers that are gone (killed before they could
    remove their own); a folder whose launcher still runs, or that has no owner mark, is
    kept.  Returns the folders removed."""
    removed = []
    for folder in glob.glob(os.path.join(root or tempfile.gettempdir(), LAUNCH_DIR_PREFIX + "*")):
        try:
            with open(os.path.join(folder, OWNER_FILE)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if _alive(pid):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True     # (someone else's process: alive)
    return True


def remove_segments(run_id):
    """Remove the shared memory a run left (a killed worker cannot unlink its own)."""
    removed = 0
    for path in glob.glob("/dev/shm/epl-%s-*" % run_id):
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed


def remove_attempt_leftovers(run_id, launch_dir):
    """An ended attempt's shared memory and launch folder."""
    remove_segments(run_id)
    shutil.rmtree(launch_dir, ignore_errors=True)
