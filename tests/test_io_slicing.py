"""IO slicing: disjoint, complete shares; the unbalanced and drop-last rules."""
import json

import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.capture.readers import slice_files

FILES = ["f%d" % i for i in range(10)]


def test_balanced_shares_are_disjoint_and_complete():
    shares = [slice_files(FILES, 5, i) for i in range(5)]
    assert sorted(sum(shares, [])) == sorted(FILES)
    assert all(len(s) == 2 for s in shares)


def test_uneven_needs_a_rule():
    with pytest.raises(ValueError, match=r"10 files cannot be divided evenly over 4 workers "
                                         r"\(2 left over\).*io.unbalanced_io_slicing"):
        slice_files(FILES, 4, 0)


def test_unbalanced_reads_everything():
    shares = [slice_files(FILES, 4, i, unbalanced=True) for i in range(4)]
    assert sorted(sum(shares, [])) == sorted(FILES)
    assert [len(s) for s in shares] == [3, 3, 2, 2]


def test_drop_last_files():
    shares = [slice_files(FILES, 4, i, drop_last=True) for i in range(4)]
    assert sum(shares, []) and all(len(s) == 2 for s in shares)
    assert sorted(sum(shares, [])) == FILES[:8]          # f8, f9 dropped


def test_too_few_files():
    with pytest.raises(ValueError, match="2 file\\(s\\) are too few for 3 workers"):
        slice_files(FILES[:2], 3, 0)
    assert slice_files(FILES[:2], 3, 2, unbalanced=True) == []


def test_reader_reads_its_share(tmp_path, monkeypatch):
    paths = []
    for i in range(4):
        p = tmp_path / ("part%d.txt" % i)
        p.write_text("line-%d-a\nline-%d-b\n" % (i, i))
        paths.append(str(p))
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:1"]},
                                                "task": {"type": "worker", "index": 1}}))
    epl.init(epl.Config({"io.slicing": True}))
    ds = tf.data.TextLineDataset(paths)
    nxt = tf.data.make_one_shot_iterator(ds).get_next()
    lines = []
    with tf.Session() as sess:
        try:
            while True:
                lines.append(sess.run(nxt).decode())
        except tf.errors.OutOfRangeError:
            pass
    assert lines == ["line-1-a", "line-1-b", "line-3-a", "line-3-b"]
