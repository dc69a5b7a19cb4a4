"""`make bench`: every benchmark, each printing its table and writing benchmarks/results/*.json.

Each benchmark runs under benchmarks/watchdog.py with a bound (BOUND_SECONDS): one that
hangs is stopped and reported as failed, the others still run, and no process is left
behind (also when `make bench` itself is stopped)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import watchdog  # noqa: E402

BOUND_SECONDS = 3 * 3600   # one benchmark (the slowest, collectives, takes about an hour)
BENCHES = [
    ["dp_overhead.py"],
    ["fusion.py"],
    ["pipeline_bubble.py"],
    ["profile_overhead.py"],
    ["split_memory.py"],
    ["tp_transformer.py"],
    ["collectives.py", "--sizes-mib", "1,16,64,256", "--runs", "5"],
    ["e2e_dp.py", "--runs", "3", "--steps", "30"],
    ["memory.py"],
    ["auto_search.py"],
    ["rewrite_time.py"],
    ["netns.py"],   # (needs root: prints why and writes {"skipped": ...} where it cannot run)
]


def main():
    failed = []
    for args in BENCHES:
        print("\n==== %s ====" % " ".join(args), flush=True)
        run = watchdog.run_group([[sys.executable, os.path.join(HERE, args[0])] + args[1:]],
                                 BOUND_SECONDS, capture=False, names=[args[0]])
        if not run.ok:
            print("run_all: %s" % run.failure, flush=True)
            failed.append(args[0])
    if failed:
        sys.exit("benchmarks failed: %s" % ", ".join(failed))


if __name__ == "__main__":
    main()
