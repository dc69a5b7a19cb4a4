"""EPL's own modules use the tf.compat.v1 names: running EPL adds no TensorFlow
deprecation warnings of its own (issue 10, item 6)."""
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
EPL_DIR = os.path.join(os.path.dirname(HERE), "epl")


def test_no_deprecation_warnings_from_epl():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.path.dirname(HERE))
    out = subprocess.run([sys.executable, os.path.join(HERE, "warnings_program.py")],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                         timeout=300).stdout.decode()
    assert "EPL warnings program done" in out, out[-5000:]
    sources = re.findall(r"From (\S+?):(\d+):", out)
    assert sources, "expected TensorFlow to warn about the program's own TF1 names"
    ours = ["%s:%s" % (f, line) for f, line in sources
            if os.path.realpath(f).startswith(os.path.realpath(EPL_DIR))]
    assert not ours, "EPL emits deprecation warnings from: %s" % ", ".join(ours)
