"""Strategy annotations: ``replicate``, ``split`` and ``set_default_strategy``.

Each annotation is a :class:`Strategy`; the ops created while it is active
form one TaskGraph of the current ``tf.Graph`` (see :mod:`epl.ir`).  Seed 003
forbids nesting annotations; a ``with`` scope may override the default
strategy (the MoE recipe does exactly that).
"""
import threading

from epl.core.process_state import Env

_state = threading.local()


def _stack():
    if not hasattr(_state, "stack"):
        _state.stack = []
        _state.default = None
    return _state


class Strategy(object):
    """Base class of the two primitives.  Usable as a context manager."""
    kind = None

    def __init__(self, device_count=None, name=None):
        if device_count is not None and (isinstance(device_count, bool)
                                         or not isinstance(device_count, int)
                                         or device_count < 1):
            raise ValueError("epl.%s(device_count=%r): device_count must be a positive "
                             "integer (devices per model replica)." % (self.kind, device_count))
        self.device_count = device_count
        self.name = name

    def __enter__(self):
        _require_init(self)
        st = _stack()
        if st.stack:
            raise RuntimeError(
                "Nested strategy annotations are not allowed (seed 003): %r is opened inside %r. "
                "Close the outer `with` block first; use consecutive scopes for pipeline stages."
                % (self, st.stack[-1]))
        st.stack.append(self)
        return self

    def __exit__(self, *exc):
        _stack().stack.pop()
        return False

    def __repr__(self):
        return "epl.%s(device_count=%r%s)" % (self.kind, self.device_count,
                                              ", name=%r" % self.name if self.name else "")


class Replicate(Strategy):
    kind = "replicate"


class Split(Strategy):
    kind = "split"


def replicate(device_count=None, name=None):
    """Data parallelism: one model replica spans ``device_count`` devices."""
    return Replicate(device_count, name)


def split(device_count=None, name=None):
    """Tensor model parallelism over ``device_count`` devices."""
    return Split(device_count, name)


def set_default_strategy(strategy):
    """Ops created outside any ``with`` scope belong to ``strategy`` from now on.

    Each call starts a new TaskGraph, so consecutive calls make pipeline stages.
    """
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError("epl.set_default_strategy expects epl.replicate(...) or "
                        "epl.split(...), got %r" % (strategy,))
    if strategy is not None:
        _require_init(strategy)
    st = _stack()
    if st.stack:
        raise RuntimeError("epl.set_default_strategy(%r) called inside the scope %r; "
                           "call it outside any `with epl.replicate/split` block."
                           % (strategy, st.stack[-1]))
    st.default = strategy


def current_strategy():
    """The strategy new ops belong to, or None."""
    st = _stack()
    return st.stack[-1] if st.stack else st.default


def reset():
    _state.stack = []
    _state.default = None


def _require_init(strategy):
    if not Env.initialized():
        raise RuntimeError("%r used before epl.init(); call epl.init(config) first." % strategy)
