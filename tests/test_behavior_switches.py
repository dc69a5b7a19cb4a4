"""A process EPL starts on its own (the strategy search's dry runs, the step-graph reads)
takes the user's TensorFlow switches (epl/tf_adapter/behavior.py) without a deprecation
notice of EPL's: on TF 1.15 ``disable_v2_behavior()`` logs "disable_resource_variables
... is deprecated" from TensorFlow's own file, so test_warnings.py's check of the
warning's source file does not see it; every dry run of ``plan_accuracy`` printed it."""
import json
import os
import subprocess
import sys

from epl.tf_adapter import behavior

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = """
import json, sys
from epl.tf_adapter import behavior
switches = json.loads(sys.argv[1])
behavior.restore(switches)
assert behavior.current() == switches, (behavior.current(), switches)
print("switches restored")
"""


def test_a_fresh_process_takes_the_users_switches_without_a_deprecation_notice():
    switches = behavior.current()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.path.dirname(HERE))
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(switches)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                         timeout=300).stdout.decode()
    assert "switches restored" in out, out[-3000:]
    assert "deprecated" not in out, out[-3000:]
