import atexit
import os
import shutil
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# A collective whose peers never come fails fast in tests instead of after 10 minutes.
os.environ.setdefault("EPL_COMMUNICATION_TIMEOUT_SECONDS", "60")
# Jobs the tests launch without --log_dir write their worker logs to a temporary folder,
# never to ./epl_logs of the checkout (epl-launch's default).
_LOGS = tempfile.mkdtemp(prefix="epl-test-logs-")
atexit.register(shutil.rmtree, _LOGS, True)
os.environ.setdefault("EPL_LOG_DIR", _LOGS)

import pytest  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.logging.set_verbosity(tf.logging.ERROR)


@pytest.fixture(autouse=True)
def fresh_graph():
    """Every test starts with a new default graph, no EPL strategy and EPL not initialized
    (an oracle built in-process must not see another test's cluster)."""
    from tests import models
    models.reset()
    yield
    models.reset()
