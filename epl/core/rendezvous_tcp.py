"""The TCP meeting point: how the tasks of a multi-node job meet without a shared folder.

The file rendezvous (``epl.core.rendezvous``) needs a folder every node sees; many
clusters have one, but not all (node-local scratch, a submit folder on the login node
only), and a task that waits for files no other node can write only fails after the
timeout.  Here one task listens and the others connect:

* **Where.**  The first task of the first node of the step's node list (``node_id`` 0,
  ``local_rank`` 0; rank 0 when the manager gives no node ids) listens on every interface
  at a port derived from the job's key (``port_for``): Slurm's job and step ids pick one
  of 16384 ports below Linux's ephemeral range (16384-32767), so concurrent steps of a
  job (step ids less than 64 apart) and concurrent jobs (job ids less than 256 apart) on
  one node never get the same port.  The others connect to that node's name (the first
  of the node list), or ``EPL_RENDEZVOUS_HOST``; ``EPL_RENDEZVOUS_PORT`` overrides the
  port.  A port already taken is named, never shared: the listener refuses to start.
* **What.**  One JSON line each way.  The listener greets with its job's key and a nonce;
  a task answers with its rank, its record (host, ports, ...) and a nonce of its own;
  once every rank has arrived the listener sends each task every record, in rank order.
  A task that reaches another job's listener (same port) sees the other key and stops,
  named.  With ``EPL_JOB_SECRET`` set (the same on every task; ``epl-launch --slurm``
  sets it) both directions carry HMAC-SHA256 over the nonces and the message, so a
  stranger on the network can neither claim a rank nor feed the tasks addresses; without
  it the meeting is not authenticated (rank 0's generated job secret travels in the
  clear), and EPL says so.
* **Never hangs.**  Every wait ends at the same ``EPL_RENDEZVOUS_TIMEOUT`` as the file
  rendezvous.  The listener then names the ranks that did not arrive -- in its own error
  and in the answer every waiting task raises -- and a task that cannot reach the
  listener names it (host, port, which task serves it).

Pure transport: the records are built, and the job's environment derived from them, by
``epl.core.rendezvous``.
"""
import errno
import hashlib
import hmac
import json
import logging
import re
import secrets
import socket
import time

log = logging.getLogger("epl")

HOST_ENV = "EPL_RENDEZVOUS_HOST"
PORT_ENV = "EPL_RENDEZVOUS_PORT"
PORT_BASE, JOB_SLOTS, STEP_SLOTS = 16384, 256, 64   # ports 16384 .. 16384 + 256 * 64 - 1
MAX_LINE = 1 << 16
HELLO_SECONDS = 5.0    # how long one connection may take to say who it is
GRACE_SECONDS = 15.0   # a task waits this much past its own deadline for the listener's word


class RendezvousError(RuntimeError):
    """The tasks of a job did not all meet.  (Defined here, the lower of the two
    rendezvous modules; ``epl.core.rendezvous`` re-exports it.)"""


def port_for(key):
    """The meeting point's port of the job step ``key`` (``slurm-<job>.<step>``; any
    other key is hashed)."""
    m = re.match(r"^slurm-(\d+)\.(\d+)$", key)
    if m:
        slot = (int(m.group(1)) % JOB_SLOTS) * STEP_SLOTS + int(m.group(2)) % STEP_SLOTS
    else:
        slot = int(hashlib.sha1(key.encode()).hexdigest(), 16) % (JOB_SLOTS * STEP_SLOTS)
    return PORT_BASE + slot


def serves(job):
    """Whether this task listens: the first task of the node list's first node."""
    if job.node_id is not None and job.local_rank is not None:
        return job.node_id == 0 and job.local_rank == 0
    return job.rank == 0


def address(job, environ):
    """(host, port) of the job's meeting point."""
    host = environ.get(HOST_ENV) or (job.hosts[0] if job.hosts else None)
    if not host:
        raise RendezvousError(
            "the TCP meeting point needs the address of the node whose first task listens: "
            "the manager gives no node list, so export %s=<that node's address> (or a "
            "shared folder: EPL_RENDEZVOUS_DIR)." % HOST_ENV)
    port = environ.get(PORT_ENV)
    return host, int(port) if port else port_for(job.key)


def _mac(secret, *parts):
    if not secret:
        return ""
    msg = "\n".join(str(p) for p in parts).encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def _macs_match(secret, got, *parts):
    return not secret or hmac.compare_digest(str(got or ""), _mac(secret, *parts))


def _send(conn, message):
    conn.sendall((json.dumps(message, sort_keys=True) + "\n").encode())


def _receive(conn, deadline):
    """One JSON line from ``conn`` before ``deadline`` (None: closed, late or garbled)."""
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.time()
        if left <= 0 or len(data) > MAX_LINE:
            return None
        conn.settimeout(left)
        try:
            chunk = conn.recv(4096)
        except (socket.timeout, OSError):
            return None
        if not chunk:
            return None
        data += chunk
    try:
        message = json.loads(data.decode())
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def _close(conn):
    try:
        conn.close()
    except OSError:
        pass


def _missing_line(what, missing, where, timeout, timeout_env):
    return ("%s: rank(s) %s did not reach the rendezvous at %s within %.0f s (%s); is every "
            "task running `epl.init()`?" % (what, ", ".join(map(str, missing)), where,
                                           timeout, timeout_env))


def serve(job, port, record, timeout, secret=None, what="", timeout_env="", host=""):
    """Listen on ``port``, take every other rank's record, send each all of them; returns
    the records in rank order.  ``what``: the job's line for errors."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("", port))
    except OSError as e:
        listener.close()
        if e.errno == errno.EADDRINUSE:
            raise RendezvousError(
                "%s: the meeting point's port %d is taken on this node (another job's "
                "meeting point, or another program); export %s=<a free port> on every "
                "task" % (what, port, PORT_ENV))
        raise
    listener.listen(64)
    listener.settimeout(0.2)
    records, conns = {job.rank: record}, {}
    deadline = time.time() + timeout
    try:
        while len(records) < job.size and time.time() < deadline:
            try:
                conn, peer = listener.accept()
            except socket.timeout:
                continue
            got = _greet(conn, job, secret)
            if isinstance(got, str):
                log.warning("EPL rendezvous: refused a connection from %s: %s", peer[0], got)
                _close(conn)
                continue
            rank, rec, nonce = got
            if rank in conns:
                _close(conns[rank][0])   # (the same rank again: its new connection counts)
            records[rank], conns[rank] = rec, (conn, nonce)
        missing = [r for r in range(job.size) if r not in records]
        if missing:
            line = _missing_line(what, missing, "%s:%d" % (host or "this node", port),
                                 timeout, timeout_env)
            for conn, _ in conns.values():
                _try_send(conn, {"error": line})
            raise RendezvousError(line)
        ordered = [records[r] for r in range(job.size)]
        for conn, nonce in conns.values():
            _try_send(conn, {"records": ordered,
                             "mac": _mac(secret, nonce, json.dumps(ordered, sort_keys=True))})
        return ordered
    finally:
        for conn, _ in conns.values():
            _close(conn)
        listener.close()


def _try_send(conn, message):
    try:
        conn.settimeout(HELLO_SECONDS)
        _send(conn, message)
    except OSError:
        pass


def _greet(conn, job, secret):
    """(rank, record, its nonce) of a task that proved itself, else why not (a str)."""
    mine = secrets.token_hex(16)
    try:
        conn.settimeout(HELLO_SECONDS)
        _send(conn, {"key": job.key, "nonce": mine})
    except OSError as e:
        return "cannot greet it: %s" % e
    hello = _receive(conn, time.time() + HELLO_SECONDS)
    if hello is None:
        return "no hello within %g s" % HELLO_SECONDS
    rank, rec = hello.get("rank"), hello.get("record")
    if hello.get("key") != job.key:
        return "it belongs to job %r, not %r" % (hello.get("key"), job.key)
    if not isinstance(rank, int) or not 0 <= rank < job.size or not isinstance(rec, dict):
        return "rank %r is not one of the job's %d" % (rank, job.size)
    if not _macs_match(secret, hello.get("mac"), mine, hello.get("nonce"), job.key, rank,
                       json.dumps(rec, sort_keys=True)):
        return "rank %d did not prove the job's secret (EPL_JOB_SECRET)" % rank
    return rank, rec, hello.get("nonce")


def join(job, host, port, record, timeout, secret=None, what="", timeout_env=""):
    """Connect to the meeting point ``host:port``, give this task's record, return every
    rank's, in rank order."""
    where = "%s:%d" % (host, port)
    deadline = time.time() + timeout
    last = "no answer"
    while time.time() < deadline:
        try:
            conn = socket.create_connection((host, port), timeout=min(2.0, timeout))
        except OSError as e:
            last = str(e)
            time.sleep(0.1)
            continue
        try:
            answer = _ask(conn, job, record, secret, deadline + GRACE_SECONDS, what, where)
        finally:
            _close(conn)
        if answer is not None:
            return answer
        last = "the connection closed before every rank arrived"
        time.sleep(0.1)
    raise RendezvousError(
        "%s: the meeting point %s (the first task of node %s listens there) did not answer "
        "within %.0f s (%s; last: %s); did that task start `epl.init()`, and is the port "
        "open between the nodes?" % (what, where, host, timeout, timeout_env, last))


def _ask(conn, job, record, secret, deadline, what, where):
    greeting = _receive(conn, time.time() + HELLO_SECONDS)
    if greeting is None:
        return None
    if greeting.get("key") != job.key:
        raise RendezvousError(
            "%s: %s is the meeting point of job %r, not of this one (%s): two jobs derived "
            "the same port; export EPL_RENDEZVOUS_PORT=<a free port> on every task"
            % (what, where, greeting.get("key"), job.key))
    nonce = secrets.token_hex(16)
    text = json.dumps(record, sort_keys=True)
    try:
        _send(conn, {"key": job.key, "rank": job.rank, "record": record, "nonce": nonce,
                     "mac": _mac(secret, greeting.get("nonce"), nonce, job.key, job.rank,
                                 text)})
    except OSError:
        return None
    answer = _receive(conn, deadline)
    if answer is None:
        return None
    if "error" in answer:
        raise RendezvousError(str(answer["error"]))
    records = answer.get("records")
    if (not isinstance(records, list) or len(records) != job.size or
            not _macs_match(secret, answer.get("mac"), nonce,
                            json.dumps(records, sort_keys=True))):
        raise RendezvousError("%s: the meeting point %s sent records that do not prove the "
                              "job's secret (EPL_JOB_SECRET)" % (what, where))
    return records
