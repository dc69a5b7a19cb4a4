"""EPL_TEST_MATRIX (tests/conftest.py): CI's two TensorFlow lines each run every test
function and share the parametrized tests' other variants, so that every variant runs
once between them."""
import types

import pytest

from tests import conftest


def _items():
    """Two test functions of 3 and 40 variants, and 2 plain tests."""
    def item(name, nodeid, params):
        spec = types.SimpleNamespace(params=params) if params is not None else None
        return types.SimpleNamespace(fspath="tests/test_x.py", originalname=name,
                                     nodeid=nodeid, callspec=spec)
    items = [item("test_plain", "t::test_plain", None)]
    items += [item("test_small", "t::test_small[%d]" % i, {"n": i}) for i in range(3)]
    items += [item("test_cross", "t::test_cross[%d-%d]" % (i, j), {"a": i, "b": j})
              for i in range(5) for j in range(8)]
    return items + [item("test_other", "t::test_other", None)]


def _run(spec, monkeypatch, elsewhere=()):
    monkeypatch.setattr(conftest, "_SHARE", conftest._matrix_share(spec))
    monkeypatch.setattr(conftest, "FIRSTS_ELSEWHERE", frozenset(elsewhere))
    items, dropped = _items(), []
    config = types.SimpleNamespace(hook=types.SimpleNamespace(
        pytest_deselected=lambda items: dropped.extend(items)))
    conftest.pytest_collection_modifyitems(config, items)
    assert len(items) + len(dropped) == len(_items())
    return [i.nodeid for i in items]


def test_shares_run_every_variant_once_between_them_and_every_function_on_each(monkeypatch):
    full = _run("full", monkeypatch)
    assert len(full) == 45
    zero, one = _run("share:0/2", monkeypatch), _run("share:1/2", monkeypatch)
    assert sorted(set(zero) | set(one)) == sorted(full)
    both = ["t::test_plain", "t::test_small[0]", "t::test_cross[0-0]", "t::test_other"]
    assert sorted(set(zero) & set(one)) == sorted(both)
    assert 10 < len(zero) < 35 and 10 < len(one) < 35       # (a hash: about half each)
    assert _run("first", monkeypatch) == ["t::test_plain", "t::test_small[0]",
                                          "t::test_cross[0-0]", "t::test_other"]


def test_files_whose_firsts_run_elsewhere_keep_only_their_share(monkeypatch):
    """CI's TF 2.x run after disable_v2_behavior(): the oracle files' plain tests and
    first variants run in the eager_off run (make test-eager-off) instead."""
    one = _run("share:1/2", monkeypatch)
    rest = _run("share:1/2", monkeypatch, elsewhere=["test_x.py"])
    firsts = ["t::test_plain", "t::test_small[0]", "t::test_cross[0-0]", "t::test_other"]
    assert sorted(rest) == sorted(set(one) - set(firsts)) and len(rest) > 5
    assert _run("first", monkeypatch, elsewhere=["test_x.py"]) == firsts
    assert len(_run("full", monkeypatch, elsewhere=["test_x.py"])) == 45


@pytest.mark.parametrize("spec", ["half", "share:2/2", "share:a/2", "share:1"])
def test_a_mistyped_spec_is_named(spec):
    with pytest.raises(ValueError, match="EPL_TEST_MATRIX=%r" % spec):
        conftest._matrix_share(spec)
