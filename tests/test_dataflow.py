"""The planner's replay of a step's dataflow graph on shared cores (``epl.auto.dataflow``):
jobs of work (core-seconds) and width (cores), at most ``cores`` running, processor
sharing by water-filling.  Oracles: schedules whose makespan is known by hand."""
import pytest

from epl.auto import dataflow


def test_a_chain_takes_the_sum_of_its_ops_alone():
    jobs = [(2e-3, 2.0), (1e-3, 1.0), (4e-3, 2.0)]        # alone: 1, 1, 2 ms
    assert dataflow.makespan(jobs, [[], [0], [1]], cores=2) == pytest.approx(4e-3)


def test_independent_thin_ops_share_the_cores():
    # two 1-core ops side by side on 2 cores: the longer one; on 1 core: the sum
    jobs = [(3e-3, 1.0), (2e-3, 1.0)]
    assert dataflow.makespan(jobs, [[], []], cores=2) == pytest.approx(3e-3)
    assert dataflow.makespan(jobs, [[], []], cores=1) == pytest.approx(5e-3)


def test_wide_ops_beside_each_other_take_their_work_over_the_cores():
    # each could use 2 cores: together they get 1 each until the first ends, then the
    # other gets both: (2 + 2) / 2 ms ... and never less than the work over the cores
    jobs = [(2e-3, 2.0), (4e-3, 2.0)]
    assert dataflow.makespan(jobs, [[], []], cores=2) == pytest.approx(3e-3)


def test_water_filling_gives_a_thin_ops_leftover_to_a_wide_one():
    # a 1-core op of 2 ms beside a 4-core op of 8 core-ms on 4 cores: the wide one gets
    # 3 cores for 2 ms (6 core-ms), then 4 cores for the last 2 core-ms (0.5 ms)
    jobs = [(2e-3, 1.0), (8e-3, 4.0)]
    assert dataflow.makespan(jobs, [[], []], cores=4) == pytest.approx(2.5e-3)


def test_instant_ops_keep_the_order():
    # 0 -> 1 (instant) -> 3, and 0 -> 2 (instant) -> 3: op 3 waits for op 0 only once
    jobs = [(1e-3, 1.0), (0.0, 1.0), (0.0, 1.0), (1e-3, 1.0)]
    assert dataflow.makespan(jobs, [[], [0], [0], [1, 2]], cores=2) == pytest.approx(2e-3)


def test_replicas_side_by_side_share_the_cores():
    jobs = [(2e-3, 2.0), (2e-3, 2.0)]
    one = dataflow.makespan(jobs, [[], [0]], cores=2)
    assert one == pytest.approx(2e-3)
    assert dataflow.makespan(jobs, [[], [0]], cores=2, copies=2) == pytest.approx(4e-3)
    assert dataflow.makespan(jobs, [[], [0]], cores=2, copies=4) == pytest.approx(8e-3)


def test_at_most_cores_ops_run_at_once():
    # three 1-core ops of 1 ms on 2 cores: two run, then the third: 2 ms
    jobs = [(1e-3, 1.0)] * 3
    assert dataflow.makespan(jobs, [[], [], []], cores=2) == pytest.approx(2e-3)


def test_job_from_alone_and_shared_times():
    assert dataflow.job(1e-3, 2e-3, 2) == (pytest.approx(2e-3), 2.0, 0.0)  # uses both cores
    assert dataflow.job(1e-3, 1e-3, 2) == (pytest.approx(1e-3), 1.0, 0.0)  # one core
    assert dataflow.job(1e-3, 9e-3, 2) == (pytest.approx(2e-3), 2.0, 0.0)  # at most cores
    assert dataflow.job(0.0, 1e-4, 2) == (0.0, 1.0, 0.0)                     # inline
    assert dataflow.job(1e-5, 4e-5, 2) == (pytest.approx(1e-5), 1.0, 0.0)
    # a wake-up only for a kernel spread over the cores, never negative
    assert dataflow.job(1e-3, 2e-3, 2, 5e-5) == (pytest.approx(2e-3), 2.0, 5e-5)
    assert dataflow.job(1e-3, 1e-3, 2, 5e-5)[2] == 0.0
    assert dataflow.job(1e-3, 2e-3, 2, -5e-5)[2] == 0.0


@pytest.mark.parametrize("wake", dataflow.WAKES)
def test_a_wide_op_pays_its_wake_up_only_with_no_other_wide_op_of_its_replica_running(wake):
    # alone: 2 core-ms at width 2 after a 0.5 ms wake-up: 1.5 ms either way (as work:
    # (2 + 1) core-ms at width 2)
    assert dataflow.makespan([(2e-3, 2.0, 5e-4)], [[]], cores=2, wake=wake) \
        == pytest.approx(1.5e-3)
    # two wide ops started together: as work, the first wakes the threads (3 core-ms),
    # the second finds them busy (2 core-ms): 5 core-ms over 2 cores; as a wait, both
    # wait the same 0.5 ms, then 4 core-ms over 2 cores
    jobs = [(2e-3, 2.0, 5e-4), (2e-3, 2.0, 5e-4)]
    assert dataflow.makespan(jobs, [[], []], cores=2, wake=wake) == pytest.approx(2.5e-3)
    # one after the other: each starts alone and pays
    assert dataflow.makespan(jobs, [[], [0]], cores=2, wake=wake) == pytest.approx(3e-3)
    # beside a one-core op, a wide op still wakes Eigen's threads: as work, 4 core-ms
    # over 2 cores; as a wait, the thin op runs its first half alone (0.5 ms), then
    # the two take a core each (0.5 ms: the thin op's last half, the wide op's first
    # 0.5 core-ms), then the wide op's last 1.5 core-ms at width 2 (0.75 ms)
    jobs = [(1e-3, 1.0), (2e-3, 2.0, 5e-4)]
    assert dataflow.makespan(jobs, [[], []], cores=2, wake=wake) == pytest.approx(
        {"work": 2e-3, "wait": 1.75e-3}[wake])


def test_each_replica_pays_its_own_wake_up_as_a_wait_beside_the_others_work():
    # two replicas of a wide op started together: another replica's kernel does not
    # spare one its lone-run cost, but the replicas wait it out at once, holding no
    # cores: 0.5 ms, then (2 + 2) core-ms over 2 cores.  As work (the rule of stops
    # 49-56) each adds 1 core-ms: (3 + 3) core-ms over 2 cores.  Measured on a 2-vCPU
    # Xeon with 33 MiB of L3 (stop 57): the GPT's 2 replicas ran 1.76x as long as 1;
    # the work rule said 1.98x, the wait 1.69x (its DP 2 row +17.6 % -> +0.5 %)
    job = (2e-3, 2.0, 5e-4)
    assert dataflow.makespan([job], [[]], cores=2, copies=2) == pytest.approx(2.5e-3)
    assert dataflow.makespan([job], [[]], cores=2, copies=2, wake="work") \
        == pytest.approx(3e-3)
    a = (2e-3, 2.0, 5e-4, ("/device:CPU:0", "k"))
    b = (2e-3, 2.0, 5e-4, ("/device:CPU:1", "k"))
    # one copy of a built step: its devices (a pipeline's stages, EPL's replicas) each
    # pay their own; two ops of one device the first only (one kernel: the widths kept)
    assert dataflow.makespan([a, b], [[], []], cores=2) == pytest.approx(2.5e-3)
    assert dataflow.makespan([a, b], [[], []], cores=2, wake="work") == pytest.approx(3e-3)
    for wake in dataflow.WAKES:
        assert dataflow.makespan([a, a], [[], []], cores=2, wake=wake) \
            == pytest.approx(2.5e-3)


def test_a_replica_waking_leaves_the_cores_to_one_working():
    # replica 0 (device 0) runs a 1 core-ms thin op, then a wide op; replica 1 (device 1)
    # starts its wide op at once.  As a wait: 0-0.5 ms the thin op alone (replica 1
    # waking); 0.5-1 a core each (replica 1's wide op does 0.5 of its 2 core-ms);
    # 1-1.5 replica 0's wide op wakes while replica 1's has the 2 cores (1 core-ms);
    # 1.5-2 a core each (replica 1 done, replica 0's 0.5 core-ms); then replica 0's last
    # 1.5 core-ms at width 2: 2.75 ms.  As work: each wide op 3 core-ms beside the
    # other's: 3.5 ms
    thin = (1e-3, 1.0, 0.0, ("/device:CPU:0", None))
    w0 = (2e-3, 2.0, 5e-4, ("/device:CPU:0", "k"))
    w1 = (2e-3, 2.0, 5e-4, ("/device:CPU:1", "k"))
    jobs, deps = [thin, w0, w1], [[], [0], []]
    wait, work = [dataflow.makespan(jobs, deps, cores=2, wake=w) for w in ("wait", "work")]
    assert wait == pytest.approx(2.75e-3)
    assert work == pytest.approx(3.5e-3)
    with pytest.raises(ValueError, match="wake must be one of"):
        dataflow.makespan(jobs, deps, cores=2, wake="sleep")


def test_different_wide_kernels_on_different_devices_take_as_long_as_one_after_another():
    # alone 1 ms each, width 1.5 (two copies of each took 1.5 ms): side by side on two
    # devices, different kernels get nothing from the cores' slack: 1 + 1 ms (measured
    # on 2 cores: 24.2 ms side by side, 25.3 one after the other; the widths: 20.4)
    a, b = ("/device:CPU:0", "matmul"), ("/device:CPU:1", "conv")
    jobs = [(1.5e-3, 1.5, 0.0, a), (1.5e-3, 1.5, 0.0, b)]
    assert dataflow.makespan(jobs, [[], []], cores=2) == pytest.approx(2e-3)
    # unequal: the short one (1 ms alone) ends at 2 ms, the long one (2 ms alone) has
    # then done half: 1 ms more at its own width alone
    jobs = [(1.5e-3, 1.5, 0.0, a), (3e-3, 1.5, 0.0, b)]
    assert dataflow.makespan(jobs, [[], []], cores=2) == pytest.approx(3e-3)


def test_copies_of_one_kernel_and_one_devices_kernels_keep_their_widths():
    # the same kernel on two devices (data parallelism, identical stages), or two
    # kernels of one device's step: each gets 1 core for its 1.5 core-ms
    same = [(1.5e-3, 1.5, 0.0, ("/device:CPU:0", "matmul")),
            (1.5e-3, 1.5, 0.0, ("/device:CPU:1", "matmul"))]
    one_device = [(1.5e-3, 1.5, 0.0, ("/device:CPU:0", "matmul")),
                  (1.5e-3, 1.5, 0.0, ("/device:CPU:0", "conv"))]
    unplaced = [(1.5e-3, 1.5, 0.0, None), (1.5e-3, 1.5, 0.0, None)]
    for jobs in (same, one_device, unplaced):
        assert dataflow.makespan(jobs, [[], []], cores=2) == pytest.approx(1.5e-3)


def test_a_one_thread_kernel_beside_another_devices_wide_kernel_keeps_both_widths():
    # a 1-core op of 1 ms (another device, another kernel) beside a width-2 op of 2 core-ms:
    # only spread ones are compared, so the wide one gets the other core, then both
    jobs = [(1e-3, 1.0, 0.0, ("/device:CPU:0", "relu")),
            (2e-3, 2.0, 0.0, ("/device:CPU:1", "matmul"))]
    assert dataflow.makespan(jobs, [[], []], cores=2) == pytest.approx(1.5e-3)


def test_more_worker_processes_than_cores_take_as_long_as_one_after_another():
    # copies of one kernel (alone 1 ms, width 1.5): in one process, two share the
    # cores' slack (1.5 ms), the third follows alone (1 ms); 3 worker processes on 2
    # cores (each its own pool as wide as the machine, its own variables) take turns:
    # each needs the cores for its time alone, 3 x 1 ms (measured: the GPT's 3
    # processes 540 ms a step, its one-device step 178 ms)
    jobs = [(1.5e-3, 1.5, 0.0, ("", "matmul"))]
    assert dataflow.makespan(jobs, [[]], cores=2, copies=3) == pytest.approx(2.5e-3)
    assert dataflow.makespan(jobs, [[]], cores=2, copies=3, processes=3) == \
        pytest.approx(3e-3)
    # no more processes than cores: as replicas in one process (measured: 2 processes
    # 9-12 % slower than that, 4-8 % faster than one after another)
    assert dataflow.makespan(jobs, [[]], cores=2, copies=2, processes=2) == \
        pytest.approx(1.5e-3)


def test_each_worker_process_has_its_own_pool():
    # three one-thread kernels of 1 ms on 2 cores: one process runs two, then the third
    # (2 ms); three processes run all three at once on the 2 cores (1.5 ms)
    thin = [(1e-3, 1.0, 0.0, ("", "relu"))]
    assert dataflow.makespan(thin, [[]], cores=2, copies=3) == pytest.approx(2e-3)
    assert dataflow.makespan(thin, [[]], cores=2, copies=3, processes=3) == \
        pytest.approx(1.5e-3)


def test_one_devices_cheap_ops_take_turns_and_other_devices_run_beside():
    # a cheap op (under INLINE_S: one thread, a few microseconds) is the executor's own
    # work: one device runs them one at a time (measured: the mini-BERT's one-device
    # step took its ops' times one after another; two at a time read it 16 % fast)
    cheap = dataflow.INLINE_S / 4
    same = [(cheap, 1.0, 0.0, ("d0", "a")), (cheap, 1.0, 0.0, ("d0", "b"))]
    assert dataflow.makespan(same, [[], []], cores=2) == pytest.approx(2 * cheap)
    apart = [(cheap, 1.0, 0.0, ("d0", "a")), (cheap, 1.0, 0.0, ("d1", "b"))]
    assert dataflow.makespan(apart, [[], []], cores=2) == pytest.approx(cheap)
    # replicas each run on their own device
    assert dataflow.makespan(same[:1], [[]], cores=2, copies=2) == pytest.approx(cheap)
    # an op that is not cheap runs beside them on its device
    wide = [(cheap, 1.0, 0.0, ("d0", "a")), (1e-3, 1.0, 0.0, ("d0", "b"))]
    assert dataflow.makespan(wide, [[], []], cores=2) == pytest.approx(1e-3)
