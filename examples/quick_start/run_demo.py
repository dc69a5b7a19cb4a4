"""`make demo`: the quick start on 2 virtual CPU devices, printing its losses."""
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
env = dict(os.environ, EPL_CLUSTER_DEVICES_PER_WORKER=os.environ.get(
    "EPL_CLUSTER_DEVICES_PER_WORKER", "2"), TF_CPP_MIN_LOG_LEVEL="2")
print("Running examples/quick_start/local_model.py on %s virtual CPU devices"
      % env["EPL_CLUSTER_DEVICES_PER_WORKER"], flush=True)
sys.exit(subprocess.call([sys.executable, os.path.join(here, "local_model.py")], env=env,
                         cwd=here))
