"""The planner's event simulation of a pipeline step (``epl.auto.schedule``) against
schedules worked by hand."""
import pytest

from epl.auto import schedule


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 8), (3, 5)])
def test_even_stages_take_the_textbook_makespan(name, p, m):
    """(m - 1) x the slowest stage + the sum of the stages: the (p - 1)/m bubble."""
    got = schedule.simulate([1.0] * p, [2.0] * p, [0.0] * p, m, name)
    assert got == pytest.approx((m - 1) * 3.0 + p * 3.0)


def test_one_micro_batch_crosses_every_send_twice():
    got = schedule.simulate([1.0, 2.0], [3.0, 4.0], [0.5, 0.0], 1, "1f1b")
    assert got == pytest.approx(1 + 0.5 + 2 + 4 + 0.5 + 3)


def test_1f1b_warms_up_with_the_stages_left_and_alternates():
    assert schedule.order(3, 4, "1f1b", 0) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert schedule.order(3, 4, "1f1b", 2) == [
        ("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert schedule.order(2, 3, "gpipe", 1) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]


def test_a_slow_stage_sets_the_pace():
    got = schedule.simulate([1.0, 3.0], [2.0, 6.0], [0.0, 0.0], 4, "1f1b")
    assert got == pytest.approx(1 + 4 * 9 + 2)


def test_shared_cores_go_to_the_busy_stage():
    """Two stages on one machine's cores (each priced at half of it): while one is idle
    (fill, drain) the other runs twice as fast; a nearly idle stage leaves the other
    the whole machine."""
    dedicated = schedule.simulate([1.0, 1.0], [2.0, 2.0], [0, 0], 4, "1f1b")
    shared = schedule.simulate([1.0, 1.0], [2.0, 2.0], [0, 0], 4, "1f1b", shared=True)
    assert dedicated == pytest.approx(15.0) and shared == pytest.approx(12.0)
    lone = schedule.simulate([1e-6, 1.0], [1e-6, 2.0], [0, 0], 4, "1f1b", shared=True)
    assert lone == pytest.approx(4 * 3.0 / 2, rel=1e-4)
