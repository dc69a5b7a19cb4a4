"""EPL's collective records, read from the C++ library (csrc/collectives.cc): while
tracing is on, every collective run leaves one record (node, what, group, transport,
rank, peers, bytes, and when it started, when its peers were all there, when it ended,
on TensorFlow's clock).  Read through ctypes on the library TensorFlow already loaded
(the same handle, so the same buffer).
"""
import collections
import ctypes

from epl.communicators import op_library

Record = collections.namedtuple(
    "Record", "node what group transport rank size bytes start_us ready_us end_us")

_lib = []


def _library():
    """The loaded op library's C entry points, or None without the library."""
    if not _lib:
        lib = None
        if op_library.available():
            lib = ctypes.CDLL(op_library.library_path())
            lib.epl_trace_enable.argtypes = [ctypes.c_int]
            lib.epl_trace_take.argtypes = [ctypes.c_char_p, ctypes.c_longlong]
            lib.epl_trace_take.restype = ctypes.c_longlong
        _lib.append(lib)
    return _lib[0]


def enable(on):
    """Start (or stop) recording collective runs; without EPL's library there are
    none to record."""
    lib = _library()
    if lib is not None:
        lib.epl_trace_enable(1 if on else 0)


def take():
    """The records since the last call, oldest first (and forgets them)."""
    lib = _library()
    if lib is None:
        return []
    buf = ctypes.create_string_buffer(1 << 20)
    text = []
    while True:
        n = lib.epl_trace_take(buf, len(buf))
        if n <= 0:
            break
        text.append(buf.raw[:n].decode("utf-8", "replace"))
    out = []
    for line in "".join(text).splitlines():
        f = line.split("\t")
        if len(f) == 10:
            out.append(Record(f[0], f[1], f[2], f[3], int(f[4]), int(f[5]), int(f[6]),
                              int(f[7]), int(f[8]), int(f[9])))
    return out
