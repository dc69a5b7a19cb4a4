"""`make bench`: every benchmark, each printing its table and writing benchmarks/results/*.json."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHES = [
    ["dp_overhead.py"],
    ["fusion.py"],
    ["pipeline_bubble.py"],
    ["split_memory.py"],
    ["collectives.py", "--sizes-mib", "1,16,64,256", "--runs", "5"],
    ["e2e_dp.py", "--runs", "3", "--steps", "30"],
    ["memory.py"],
    ["auto_search.py"],
    ["rewrite_time.py"],
]


def main():
    failed = []
    for args in BENCHES:
        print("\n==== %s ====" % " ".join(args), flush=True)
        if subprocess.call([sys.executable, os.path.join(HERE, args[0])] + args[1:]) != 0:
            failed.append(args[0])
    if failed:
        sys.exit("benchmarks failed: %s" % ", ".join(failed))


if __name__ == "__main__":
    main()
