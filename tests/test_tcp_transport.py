"""The TCP transport's own hygiene (issue 33, item 7): the handshake nonce, a listener
out of file descriptors, the sockets of peers that died, retries against a peer with
another secret, and the HMAC-SHA256 under the handshake (RFC 4231's test vectors).

The processes here are started with hard timeouts (a hang fails the test, it never
blocks CI).  This file is also the worker program of those processes: run as a script,
it is one rank of a TCP job (``--worker MODE RANK SIZE JOB TIMEOUT``)."""
import ctypes
import errno
import hashlib
import hmac
import os
import socket
import subprocess
import sys
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ---- the worker side (run as a script) ------------------------------------------------------

def _socket_fds():
    """How many of this process's file descriptors are sockets."""
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink("/proc/self/fd/" + name).startswith("socket:")
        except OSError:
            pass   # (the descriptor listdir itself used)
    return n


def _fill_fds(keep):
    """Uses up this process's file descriptors (below a soft limit of 512, so it is
    quick), then frees ``keep`` of them: the listener's next accept() takes a free one,
    or fails with EMFILE when none is left."""
    import resource
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(512, hard), hard))
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as e:
        assert e.errno == errno.EMFILE, e
    for _ in range(keep):
        os.close(held.pop())
    print("FILLED %d" % len(held), flush=True)   # (stdout is open already: no new fd)


def _worker(mode, rank, size, job, timeout):
    import tensorflow.compat.v1 as tf
    tf.disable_v2_behavior()
    from epl.communicators import native_ops as C

    def all_reduce(group, value):
        with tf.Graph().as_default():
            y = C.all_reduce(tf.constant([float(value)]), group, rank, size, "sum",
                             timeout_seconds=timeout, transport="tcp")
            with tf.Session() as sess:
                return float(sess.run(y)[0])

    if mode == "fill_on_request":
        # Waits for the peers that never come; on a line "<n>" on stdin, uses up its file
        # descriptors but n.
        def watch():
            line = sys.stdin.readline()
            if line.strip():
                _fill_fds(int(line))
        threading.Thread(target=watch, daemon=True).start()
        try:
            print("RESULT %s" % all_reduce(job + "/lonely", 1), flush=True)
        except tf.errors.OpError as e:
            print("ERROR " + e.message.replace("\n", " "), flush=True)
    elif mode == "outlive_peers":
        # One job per line on stdin: a collective with that job's (new) rank 0, then one
        # that fails because rank 0 has gone; then how many sockets this process holds.
        for line in sys.stdin:
            peer_job = line.strip()
            if not peer_job:
                break
            print("SUM %s" % all_reduce(peer_job + "/sum", 10 * (rank + 1)), flush=True)
            try:
                all_reduce(peer_job + "/after", 1)
                print("AFTER no error", flush=True)
            except tf.errors.OpError as e:
                print("AFTER " + e.message.replace("\n", " "), flush=True)
            deadline = time.time() + 10   # (the reader thread closes it as it sees the end)
            while _socket_fds() > 1 and time.time() < deadline:
                time.sleep(0.05)
            print("SOCKETS %d" % _socket_fds(), flush=True)


# ---- helpers of the tests ---------------------------------------------------------------

def _env(addresses, timeout, secret="the-job-secret"):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
               EPL_COMM_ADDRESSES=",".join("127.0.0.1:%d" % p for p in addresses),
               EPL_JOB_SECRET=secret, EPL_COMMUNICATION_TIMEOUT_SECONDS=str(timeout))
    return env


def _start(mode, rank, size, job, timeout, env):
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", mode,
                             str(rank), str(size), job, str(timeout)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def _lines(proc):
    """A queue of the process's output lines and the list of all of them (read on a
    thread, so waits can time out)."""
    import queue
    q, seen = queue.Queue(), []

    def pump():
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            seen.append(line)
            q.put(line)
        q.put(None)
    threading.Thread(target=pump, daemon=True).start()
    return q, seen


def _wait_for(q, seen, prefix, timeout):
    import pytest
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            line = q.get(timeout=max(0.1, deadline - time.time()))
        except Exception:  # pylint: disable=broad-except
            break
        if line is None:
            break
        if line.startswith(prefix):
            return line
    pytest.fail("no line %r within %s s; output:\n%s" % (prefix, timeout, "".join(seen[-60:])))


def _until_listening(port, proc, seen, timeout=90):
    import pytest
    deadline = time.time() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail("port %d never listened; output:\n%s" % (port, "".join(seen)))
            time.sleep(0.1)


def _stop(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def _cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / float(os.sysconf("SC_CLK_TCK"))


# ---- the tests ------------------------------------------------------------------------------
if __name__ != "__main__":     # (the worker side starts without pytest)
    import pytest
    pytestmark = pytest.mark.alone   # processes that wait on each other with timeouts (conftest.py)

def test_handshake_nonces_are_random_even_without_a_free_file_descriptor():
    """The listener's nonce must never be predictable: a fixed one lets a recorded
    handshake be replayed.  With one free descriptor (the accepted connection takes it),
    reading /dev/urandom cannot work; the nonce must still be fresh per connection."""
    from epl.launch.ports import free_ports
    ports = free_ports(2)
    proc = _start("fill_on_request", 1, 2, "nonce-" + uuid.uuid4().hex[:6], 60,
                  _env(ports, 60))
    try:
        q, seen = _lines(proc)
        _until_listening(ports[1], proc, seen)
        proc.stdin.write(b"1\n")
        proc.stdin.flush()
        _wait_for(q, seen, "FILLED", 30)
        nonces = []
        for _ in range(3):
            conn = socket.create_connection(("127.0.0.1", ports[1]), timeout=10)
            conn.settimeout(10)
            hello = b""
            while len(hello) < 20:
                chunk = conn.recv(20 - len(hello))
                assert chunk, "the listener closed without a hello: %s" % "".join(seen)
                hello += chunk
            conn.close()
            assert hello[:4] == b"EPLH", hello
            nonces.append(hello[4:])
            time.sleep(0.5)   # (the listener closes its end: the free descriptor is back)
        print("nonces:", [n.hex() for n in nonces])
        assert b"\0" * 16 not in nonces, "a zero nonce: %s" % [n.hex() for n in nonces]
        assert len(set(nonces)) == len(nonces), [n.hex() for n in nonces]
    finally:
        _stop(proc)


def test_a_listener_out_of_file_descriptors_backs_off_and_says_so():
    """accept() failing with EMFILE (the connection stays queued) must not spin a core,
    and the collective waiting for that peer must fail at its deadline naming the limit."""
    from epl.launch.ports import free_ports
    ports = free_ports(2)
    proc = _start("fill_on_request", 1, 2, "emfile-" + uuid.uuid4().hex[:6], 25,
                  _env(ports, 25))
    try:
        q, seen = _lines(proc)
        _until_listening(ports[1], proc, seen)
        proc.stdin.write(b"0\n")
        proc.stdin.flush()
        _wait_for(q, seen, "FILLED", 30)
        stranger = socket.create_connection(("127.0.0.1", ports[1]), timeout=5)
        time.sleep(0.5)
        before = _cpu_seconds(proc.pid)
        time.sleep(3)
        used = _cpu_seconds(proc.pid) - before
        print("CPU seconds used in 3 s with accept() failing: %.2f" % used)
        assert used < 0.5, "the listener spins on EMFILE: %.2f CPU s in 3 s" % used
        error = _wait_for(q, seen, "ERROR", 90)
        stranger.close()
        print(error)
        assert "EMFILE" in error and "file descriptors" in error and "ulimit -n" in error, error
    finally:
        _stop(proc)


def test_the_sockets_of_peers_that_died_are_closed():
    """A long-lived rank 1 meets a new rank 0 per job; each rank 0 exits after its first
    collective.  Once rank 1 has seen each death, it holds its listening socket only."""
    from epl.launch.ports import free_ports
    ports = free_ports(2)
    env = _env(ports, 30)
    subject = _start("outlive_peers", 1, 2, "-", 30, env)
    peers = []
    try:
        q, seen = _lines(subject)
        counts = []
        for i in range(3):
            job = "died-%d-%s" % (i, uuid.uuid4().hex[:6])
            subject.stdin.write(job.encode() + b"\n")
            subject.stdin.flush()
            peers.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "fault_worker.py"), "0", "2", job, "-",
                 "sum", "tcp"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
            assert _wait_for(q, seen, "SUM", 120).split()[1] == "30.0"
            peers[-1].communicate(timeout=60)
            assert "disconnected" in _wait_for(q, seen, "AFTER", 60)
            counts.append(int(_wait_for(q, seen, "SOCKETS", 60).split()[1]))
        print("sockets held after each dead peer:", counts)
        assert counts == [1, 1, 1], counts   # the listener only
    finally:
        for p in peers + [subject]:
            _stop(p)


def test_a_wrong_secret_backs_off_and_names_the_mismatch():
    """Rank 0 and rank 1 have different EPL_JOB_SECRETs.  Rank 0 retries with a growing
    delay (not every 20 ms for the whole timeout: every try is a refused handshake in the
    listener's log) and ends with an error that says the secret did not match."""
    from epl.launch.ports import free_ports
    sys.path.insert(0, HERE)
    from test_faults import finish, start_ranks   # pylint: disable=import-error
    ports = free_ports(2)
    env = {"EPL_COMM_ADDRESSES": "127.0.0.1:%d,127.0.0.1:%d" % tuple(ports),
           "EPL_COMMUNICATION_TIMEOUT_SECONDS": "10"}
    procs, job = [], "j-" + uuid.uuid4().hex[:6]
    for rank, secret in ((0, "one-secret"), (1, "another-secret")):
        procs += start_ranks(2, "sum", "tcp", env_extra=dict(env, EPL_JOB_SECRET=secret),
                             job=job, only=[rank])
    codes, outs, _ = finish(procs, timeout=120)
    refused = outs[1].count("refused a connection from")
    print("handshakes the listener refused within the 10 s timeout:", refused)
    assert codes[0] != 0 and codes[1] != 0
    assert 3 <= refused <= 25, outs[1][-3000:]
    assert "rank 1 (127.0.0.1:%d)" % ports[1] in outs[0], outs[0][-3000:]
    assert "secret does not match" in outs[0], outs[0][-3000:]
    assert "EPL_JOB_SECRET differs between the workers" in outs[0], outs[0][-3000:]
    # The listener's side says why nobody connected, too.
    assert "does not prove the job's secret" in outs[1].split("never connected")[-1], \
        outs[1][-3000:]


def _hmac_entry_point():
    """The op library's C entry point (ctypes, on the library TensorFlow loaded)."""
    from epl.communicators import op_library
    op_library.ops()
    lib = ctypes.CDLL(op_library.library_path())
    fn = lib.epl_hmac_sha256
    fn.argtypes = [ctypes.c_char_p, ctypes.c_longlong, ctypes.c_char_p, ctypes.c_longlong,
                   ctypes.c_char_p]
    fn.restype = None

    def call(key, message):
        out = ctypes.create_string_buffer(32)
        fn(key, len(key), message, len(message), out)
        return out.raw
    return call


# RFC 4231, section 4: test cases 1-7 (key, data, bytes of the output compared; case 5
# truncates to 128 bits).  The expected values come from Python's hmac.
RFC_4231 = [
    (b"\x0b" * 20, b"Hi There", 32),
    (b"Jefe", b"what do ya want for nothing?", 32),
    (b"\xaa" * 20, b"\xdd" * 50, 32),
    (bytes(range(1, 26)), b"\xcd" * 50, 32),
    (b"\x0c" * 20, b"Test With Truncation", 16),
    (b"\xaa" * 131, b"Test Using Larger Than Block-Size Key - Hash Key First", 32),
    (b"\xaa" * 131, b"This is a test using a larger than block-size key and a larger than "
                    b"block-size data. The key needs to be hashed before being used by the "
                    b"HMAC algorithm.", 32),
]


def test_hmac_sha256_matches_rfc_4231():
    ours = _hmac_entry_point()
    for case, (key, data, n) in enumerate(RFC_4231, 1):
        want = hmac.new(key, data, hashlib.sha256).digest()[:n]
        assert ours(key, data)[:n] == want, "RFC 4231 test case %d" % case
    # The RFC's published value of case 2, as a check of the oracle itself.
    assert hmac.new(b"Jefe", b"what do ya want for nothing?", hashlib.sha256).hexdigest() \
        .startswith("5bdcc146bf60754e6a042426089575c7")


def test_hmac_sha256_at_the_block_and_padding_boundaries():
    """Keys of 0, 63, 64 and 65 bytes (65 is hashed first) and messages whose padding
    needs one or two more SHA-256 blocks (55, 56, 63, 64, 119, 120 bytes), with zeros
    and high bytes inside."""
    ours = _hmac_entry_point()
    for klen in (0, 1, 32, 63, 64, 65, 200):
        key = bytes((7 * i + 200) % 256 for i in range(klen))
        for mlen in (0, 1, 55, 56, 63, 64, 65, 119, 120, 1000):
            msg = bytes((13 * i) % 256 for i in range(mlen))
            assert ours(key, msg) == hmac.new(key, msg, hashlib.sha256).digest(), (klen, mlen)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
