"""A patched point that TensorFlow wraps in its deprecation notice (the Estimator's
``RunConfig`` on TF 2.15): the notice still names the user's line, never EPL's, and EPL's
own call of the original adds none (epl/tf_adapter/patching.py)."""
import logging

from tensorflow.python.util import deprecation

from epl.tf_adapter import patching

POINT = "test.deprecated_init"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class Old:
    """A constructor in TensorFlow's deprecation wrapper, as tensorflow_estimator 2.15's
    ``deprecated`` classes have it (TF 2.x wraps a deprecated class's ``__init__``)."""

    @deprecation.deprecated(None, "Use something else.")
    def __init__(self, value):
        self.value = value


def _notices(run):
    """The deprecation notices logged while ``run()`` runs (each function's notice is
    logged once per process: the test forgets that it was)."""
    logger = logging.getLogger("tensorflow")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    deprecation._PRINTED_WARNING.clear()
    try:
        run()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return [m for m in handler.messages if "is deprecated" in m]


def test_the_notice_names_the_users_line_and_epl_calls_the_original_silently():
    calls = []

    def replacement(self, value):
        calls.append(value)
        patching.original(POINT)(self, value * 2)   # EPL's own call: no notice

    patching.POINTS[POINT] = (__name__, "Old", "__init__")
    try:
        assert patching.install(POINT, replacement)
        wrapper = vars(Old)["__init__"]

        def users_program():
            return Old(3)
        users_line = "%s:%d:" % (__file__.rstrip("c"), users_program.__code__.co_firstlineno + 1)
        notices = _notices(users_program)
        assert calls == [3]
        assert len(notices) == 1, notices
        assert users_line in notices[0] and "Old.__init__" in notices[0], (users_line, notices)
        assert Old(4).value == 8                   # the replacement ran, then the original
        assert vars(Old)["__init__"] is wrapper    # TensorFlow's wrapper stays in place
    finally:
        patching.uninstall(POINT)
        del patching.POINTS[POINT]
    calls.clear()
    assert Old(5).value == 5 and not calls         # uninstalled: TensorFlow's own again
