"""`make demo`: the seed's launch command for the quick start, on a machine without GPUs:

    epl-launch --num_workers 1 --gpu_per_worker 2 run.sh

(1 worker with 2 virtual CPU devices), printing its losses.
"""
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
cmd = [sys.executable, "-m", "epl.launch", "--num_workers", "1", "--gpu_per_worker", "2",
       "--log_dir", os.path.join(here, "epl_logs"), "run.sh"]
print("$ epl-launch --num_workers 1 --gpu_per_worker 2 run.sh   (in examples/quick_start)",
      flush=True)
sys.exit(subprocess.call(cmd, env=env, cwd=here))
