"""The split examples run as documented (small sizes) and learn."""
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run(example, *args):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "train.py"] + list(args), cwd=os.path.join(
        ROOT, "examples", example), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        timeout=300)
    text = out.stdout.decode()
    assert out.returncode == 0, text[-3000:]
    return text, [float(v) for v in re.findall(r"loss ([0-9.]+)", text)]


def test_large_scale_classification_example_shards_the_head():
    text, losses = _run("large_scale_classification", "--devices", "2", "--classes", "2000",
                        "--steps", "3")
    assert "head of 2000 classes in 2 shards: [64000] parameters each" in text
    assert len(losses) == 3 and "Train Finished." in text


def test_moe_example_learns():
    text, losses = _run("moe", "--devices", "2", "--experts", "4", "--steps", "6")
    assert "[[2, 32, 128], [2, 32, 128]]" in text    # 4 experts, 2 per device
    assert losses[-1] < losses[0] - 0.1
