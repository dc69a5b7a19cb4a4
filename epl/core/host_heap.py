"""Keep the host memory TensorFlow frees, so that a step does not fault its pages back in.

TensorFlow's CPU tensors (on TF 1.15 and 2.x, without ``TF_CPU_ALLOCATOR_USE_BFC``) come
from the C library's ``malloc``.  glibc's malloc gives memory back to the kernel as soon
as a freed block at the top of a heap exceeds its trim threshold, and serves blocks above
its mmap threshold (128 KiB, rising to the largest block freed, at most 32 MiB) with a
mapping of their own that ``free`` unmaps.  A training step frees and allocates the same
tensors in every step, so each step maps fresh pages and faults every one of them in
again.  Measured here (AMD EPYC, 2 vCPU, the GPT decoder of docs/plan.md on one device,
TF 1.15): 18,394 minor faults a step (72 MiB of pages), median step 155 ms; with the
thresholds below, 33 faults and 138 ms (the MLP: 16.0 -> 13.1 ms; RSS +2 to +8 %).

``keep_freed_memory`` fixes both thresholds (``mallopt``), which also turns glibc's
dynamic adjustment off: blocks up to 32 MiB come from the heaps and stay there, and a
heap keeps up to 1 GiB of free memory at its top.  It is process-wide and applies to the
threads TensorFlow already started (the thresholds are global, not per arena).
``epl.init`` calls it unless ``cluster.keep_freed_host_memory`` is False; the planner
calls it before timing kernels, so that it times them as EPL runs them.
"""
import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 1 << 30
MMAP_THRESHOLD = 32 << 20      # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)

_applied = False


def _mallopt():
    """glibc's ``mallopt``, or None (musl, macOS: another allocator, nothing to set)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc.mallopt


def available():
    """Whether this process's C library is glibc, whose thresholds can be set."""
    return _mallopt() is not None


def keep_freed_memory():
    """Set glibc's trim and mmap thresholds for this process (once); True where set,
    False where the C library is not glibc or refused a value."""
    global _applied
    if _applied:
        return True
    mallopt = _mallopt()
    if mallopt is None:
        return False
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied


def kept():
    """Whether ``keep_freed_memory`` has set the thresholds in this process."""
    return _applied
