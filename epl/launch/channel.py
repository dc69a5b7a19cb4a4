"""The control link between the launchers of a --machine_list job: JSON messages over
TCP, opened only between launchers that prove the job's secret.

Under --max_restarts machine 0's launcher coordinates the others (epl.launch.coordinator)
over these links.  Both sides prove EPL_JOB_SECRET (HMAC-SHA256 over both sides' nonces,
as the workers' TCP collectives do), so a stranger on the network cannot stop or start a
job's workers; a link whose peer is silent too long (a partition, a machine that lost
power) counts as closed, so --host_timeout applies to it.
"""
import hashlib
import hmac
import json
import secrets
import socket
import sys
import threading
import time

from epl.launch.ports import control_address

HANDSHAKE_SECONDS = 5


def _mac(secret, *parts):
    return hmac.new(secret.encode(), "|".join(str(p) for p in parts).encode(),
                    hashlib.sha256).hexdigest()


# A control link whose peer is silent this long (a partition, a machine that lost power:
# no FIN, no reset) counts as closed, so the coordinator's --host_timeout and the machines'
# "coordinator went away" apply to it too.  Kernel keepalive probes are answered by a live
# peer's kernel, however loaded its launcher is.
LINK_DEAD_SECONDS = 20


def _detect_silent_peer(sock, seconds):
    """Keepalive probes after seconds/4 of silence, every seconds/4, 3 unanswered: closed;
    unacknowledged data for ``seconds``: closed (TCP_USER_TIMEOUT).  Where the platform
    lacks an option, the kernel's default applies."""
    step = max(1, int(seconds // 4))
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", step), ("TCP_KEEPINTVL", step), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", int(seconds * 1000))):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, option, value in options:
        try:
            sock.setsockopt(level, option, value)
        except OSError:
            pass   # (not supported here: the kernel's defaults)


class Channel(object):
    """JSON messages, one a line, over a TCP connection.  After the handshake a thread
    reads them into ``events`` as (tag, channel, message); message None: closed."""

    def __init__(self, sock):
        self.sock = sock
        _detect_silent_peer(sock, LINK_DEAD_SECONDS)
        self.reader = sock.makefile("rb")
        self.lock = threading.Lock()

    def send(self, message):
        data = (json.dumps(message) + "\n").encode()
        with self.lock:
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                return False

    def receive(self, timeout):
        """One message, read now (the handshake)."""
        self.sock.settimeout(timeout)
        try:
            line = self.reader.readline()
        finally:
            self.sock.settimeout(None)
        if not line:
            raise OSError("the connection closed")
        message = json.loads(line.decode())
        if not isinstance(message, dict):
            raise ValueError("not a message")
        return message

    def read_into(self, events, tag):
        def read():
            try:
                for line in self.reader:
                    events.put((tag, self, json.loads(line.decode())))
            except (OSError, ValueError):
                pass
            events.put((tag, self, None))
        threading.Thread(target=read, daemon=True).start()

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def connect_to_coordinator(a, job_id, secret, timeout):
    """This machine's authenticated channel to the coordinator (retried until
    ``timeout``: machine 0's launcher may start later)."""
    address = control_address(a)
    deadline = time.time() + timeout
    refused = False   # (a connection closed on this machine's proof: another secret)
    while True:
        answered = False
        try:
            ch = Channel(socket.create_connection(address, timeout=HANDSHAKE_SECONDS))
            ch.sock.settimeout(None)
            hello = ch.receive(HANDSHAKE_SECONDS)
            mine = secrets.token_hex(16)
            ch.send({"machine": a.machine_rank, "nonce": mine,
                     "mac": _mac(secret, "launcher", job_id, a.machine_rank, hello["nonce"],
                                 mine)})
            answered = True
            proof = ch.receive(HANDSHAKE_SECONDS)
            if not hmac.compare_digest(str(proof.get("mac")), _mac(
                    secret, "coordinator", job_id, a.machine_rank, hello["nonce"], mine)):
                raise SystemExit("epl-launch: the coordinator at %s:%d does not prove the "
                                 "job's secret (EPL_JOB_SECRET differs between the machines?)"
                                 % address)
            return ch
        except (OSError, ValueError, KeyError) as e:
            refused = refused or answered
            if time.time() > deadline:
                raise SystemExit(
                    "epl-launch: machine %d cannot reach machine 0's launcher at %s:%d "
                    "within --host_timeout %gs: %s" % ((a.machine_rank,) + address + (
                        timeout, "it closed the connection when it got this machine's proof "
                        "of the job's secret (is EPL_JOB_SECRET the same on every machine?)"
                        if refused else e)))
            time.sleep(0.5)


def accept_launcher(sock, peer, secret, job_id, machines):
    """The coordinator's side of the handshake on an accepted connection: (machine, its
    channel), or None (refused, and logged) when it does not prove the job's secret."""
    ch = Channel(sock)
    try:
        nonce = secrets.token_hex(16)
        ch.send({"nonce": nonce})
        hello = ch.receive(HANDSHAKE_SECONDS)
        k = int(hello["machine"])
        if not 0 <= k < machines or not hmac.compare_digest(
                str(hello["mac"]), _mac(secret, "launcher", job_id, k, nonce, hello["nonce"])):
            raise ValueError("it does not prove the job's secret")
        ch.send({"mac": _mac(secret, "coordinator", job_id, k, nonce, hello["nonce"])})
    except (OSError, ValueError, KeyError, TypeError) as e:
        print("epl-launch: the coordinator refused a connection from %s: %s"
              % (peer[0], e), file=sys.stderr, flush=True)
        ch.close()
        return None
    return k, ch
