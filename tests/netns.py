"""Hosts on a real (virtual) network: Linux network namespaces joined by a bridge.

Every multi-host test before this one ran its "hosts" as 127.0.0.2 / 127.0.0.3 on one
network stack, where nothing between them can be slow or cut.  ``Network`` makes 2-3
hosts that each have their own network stack (a namespace), their own address in a
private subnet and their own link (a veth pair whose outer end is on a bridge), and it can

* run a command on a host (``ip netns exec``; ``popen``);
* cut a host's link and restore it (``ip link set DEV down / up``: a partition; also a
  host that is not up yet);
* add latency between the hosts with a small TCP relay of our own (this kernel has no
  ``netem``): the relay lives in a namespace of its own on the same bridge, with one
  address per relayed host, and forwards every port of that host to the host's real
  address after ``latency`` seconds, each way.  Every host finds the others by name
  (``h0``, ``h1``...) through its own hosts file (``/etc/netns/<ns>/hosts``, which
  ``ip netns exec`` mounts over /etc/hosts): its own name is its own address (where its
  workers listen), the others' names are their relay addresses.  So one
  ``--machine_list h0:7000,h1:7000`` is the same on every host, as on real machines, and
  every port the job derives from it (TensorFlow's and EPL's collectives, port + i) is
  relayed without being listed.

Names are unique per process (``epl<pid>...``), so parallel runs do not clash; the
subnet is ``10.231.<pid % 250>.0/24`` (private; it exists only inside the namespaces).
``close()`` removes everything -- processes in the namespaces, namespaces, veths, bridge,
hosts files, the shared memory of the runs named with ``add_run`` -- and runs from the
test's finalizer and at exit; a new Network also removes what a killed earlier process
left (names with a pid that no longer runs).

``python tests/netns.py relay --delay S --map LISTEN=TARGET ...`` is the relay itself.
"""
import argparse
import atexit
import glob
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

PREFIX = "epl"          # namespaces epl<pid>h<i> / epl<pid>r, links e<pid>...
HERE = os.path.dirname(os.path.abspath(__file__))
RELAY_OFFSET = 100      # the relay's address for host i: .<RELAY_OFFSET + i + 1>


def _ip(*args, check=True):
    out = subprocess.run(["ip"] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError("ip %s: %s" % (" ".join(args), out.stderr.decode().strip()))
    return out


def unavailable():
    """Why namespaces cannot be made here (a reason to skip), or None.  Checked by trying:
    make a namespace with a veth pair and a bridge, then remove them."""
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) on this machine"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "network namespaces need root (euid %d)" % os.geteuid()
    name = "%sp%d" % (PREFIX, os.getpid())
    try:
        _ip("netns", "add", name)
        try:
            _ip("link", "add", "ep%dx" % os.getpid(), "type", "bridge")
            _ip("link", "del", "ep%dx" % os.getpid())
            _ip("-n", name, "link", "set", "lo", "up")
        finally:
            _ip("netns", "del", name, check=False)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return "cannot make network namespaces here: %s" % e
    return None


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


_NS_NAME = re.compile(r"^%s(\d+)[a-z](h\d+|r)$" % PREFIX)
_LINK_NAME = re.compile(r"^e[bv](\d+)[a-z]")


def remove_leftovers():
    """Namespaces, links and hosts files of earlier runs whose process is gone."""
    for line in _ip("netns", "list", check=False).stdout.decode().splitlines():
        name = (line.split() or [""])[0]
        m = _NS_NAME.match(name)
        if m and not _alive(int(m.group(1))):
            _kill_namespace_pids(name)
            _ip("netns", "del", name, check=False)
            shutil.rmtree("/etc/netns/" + name, ignore_errors=True)
    for line in _ip("-o", "link", "show", check=False).stdout.decode().splitlines():
        dev = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        m = _LINK_NAME.match(dev)
        if m and not _alive(int(m.group(1))):
            _ip("link", "del", dev, check=False)
    for path in glob.glob("/tmp/%s*-relay.log" % PREFIX):
        m = re.match(r"^%s(\d+)[a-z]-relay\.log$" % PREFIX, os.path.basename(path))
        if m and not _alive(int(m.group(1))):
            os.unlink(path)


def _kill_namespace_pids(ns):
    out = _ip("netns", "pids", ns, check=False).stdout.decode().split()
    for pid in out:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    return [int(p) for p in out if p.isdigit()]


class Network(object):
    """``hosts`` namespaces on a bridge; with ``latency`` > 0 a relay adds it each way
    between every pair of hosts, on ``ports`` of every host (TCP)."""

    def __init__(self, hosts=2, latency=0.0, ports=()):
        if not 2 <= hosts <= 8:
            raise ValueError("hosts must be 2..8, got %d" % hosts)
        pid = os.getpid()
        Network._count = getattr(Network, "_count", 0) + 1
        self.tag = "%d%s" % (pid, chr(ord("a") + (Network._count - 1) % 26))
        self.subnet = "10.231.%d" % (pid % 250)
        self.hosts = hosts
        self.latency = float(latency)
        self.ports = list(ports)
        self.bridge = "eb%s" % self.tag
        self.namespaces = ["%s%sh%d" % (PREFIX, self.tag, i) for i in range(hosts)]
        self.relay_ns = "%s%sr" % (PREFIX, self.tag)
        self.procs = []
        self.runs = []
        self.closed = False
        self._made = []    # ("netns" | "link" | "dir", name), in creation order
        self._relay = None
        atexit.register(self.close)
        try:
            remove_leftovers()
            self._make()
        except BaseException:
            self.close()
            raise

    # ---- names and addresses
    def name(self, i):
        """Host i's name (what a --machine_list uses)."""
        return "h%d" % i

    def address(self, i):
        """Host i's own address (where its processes listen)."""
        return "%s.%d" % (self.subnet, i + 1)

    def relay_address(self, i):
        return "%s.%d" % (self.subnet, RELAY_OFFSET + i + 1)

    def veth(self, i):
        """The outer end (on the bridge) of host i's link."""
        return "ev%sx%d" % (self.tag, i)

    # ---- building
    def _make(self):
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.namespaces):
            self._host(ns, self.veth(i), [self.address(i)])
            self._hosts_file(i)
        if self.latency > 0:
            self._host(self.relay_ns, "ev%sxr" % self.tag,
                       [self.relay_address(i) for i in range(self.hosts)])
            self._start_relay()

    def _host(self, ns, outer, addresses):
        _ip("netns", "add", ns)
        self._made.append(("netns", ns))
        inner = outer + "i"
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        self._made.append(("link", outer))
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        for a in addresses:
            _ip("-n", ns, "addr", "add", a + "/24", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def _hosts_file(self, i):
        folder = "/etc/netns/" + self.namespaces[i]
        os.makedirs(folder, exist_ok=True)
        self._made.append(("dir", folder))
        lines = ["127.0.0.1 localhost"]
        for j in range(self.hosts):
            if j == i:
                lines.append("%s %s" % (self.address(j), self.name(j)))
            else:
                lines.append("%s %s" % (self.relay_address(j) if self.latency > 0
                                        else self.address(j), self.name(j)))
        with open(os.path.join(folder, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def relayed(self):
        """Connections the relay forwarded so far, by the address they reached it at."""
        counts = {}
        try:
            with open(self._relay_log) as f:
                for line in f:
                    counts[line.strip()] = counts.get(line.strip(), 0) + 1
        except OSError:
            pass
        return counts

    def _start_relay(self):
        self._relay_log = "/tmp/%s%s-relay.log" % (PREFIX, self.tag)
        self._made.insert(0, ("file", self._relay_log))
        maps = ["%s:%d=%s:%d" % (self.relay_address(i), p, self.address(i), p)
                for i in range(self.hosts) for p in self.ports]
        self._relay = self.popen(None, [sys.executable, os.path.abspath(__file__), "relay",
                                        "--delay", str(self.latency), "--log", self._relay_log]
                                 + ["--map"] + maps,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 ns=self.relay_ns)
        line = self._relay.stdout.readline().decode()
        if not line.startswith("RELAY READY"):
            raise RuntimeError("the latency relay did not start: %s%s"
                               % (line, self._relay.stdout.read().decode()[-2000:]))

    # ---- running and faults
    def popen(self, i, cmd, ns=None, **kw):
        """Starts ``cmd`` on host i (in a session of its own); the Network stops it at the end."""
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", ns or self.namespaces[i]] + list(cmd),
                                **kw)
        self.procs.append(proc)
        return proc

    def run(self, i, cmd, timeout=60):
        return subprocess.run(["ip", "netns", "exec", self.namespaces[i]] + list(cmd),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)

    def cut(self, i):
        """Host i's link goes down: nothing reaches it, nothing leaves it, and nobody is told
        (no reset, no FIN: a partition, or a machine that is off)."""
        _ip("link", "set", self.veth(i), "down")

    def restore(self, i):
        _ip("link", "set", self.veth(i), "up")

    def pids(self, i=None):
        """Processes running in host i's namespace (every host's, and the relay's, if None)."""
        names = self.namespaces if i is None else [self.namespaces[i]]
        found = []
        for ns in names:
            found += [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        return found

    def add_run(self, run_id):
        """A launch whose shared memory (/dev/shm/epl-<run_id>-*) close() removes."""
        self.runs.append(run_id)

    def close(self):
        """Removes everything this Network made, in reverse; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        for kind, name in reversed(self._made):
            if kind == "netns":
                _kill_namespace_pids(name)
                _ip("netns", "del", name, check=False)
            elif kind == "link":
                _ip("link", "del", name, check=False)
            elif kind == "file":
                if os.path.exists(name):
                    os.unlink(name)
            else:
                shutil.rmtree(name, ignore_errors=True)
        for run in self.runs:
            for path in glob.glob("/dev/shm/epl-%s-*" % run):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        try:
            atexit.unregister(self.close)
        except Exception:  # pylint: disable=broad-except
            pass

    def leftovers(self):
        """What close() should have removed and did not (empty when clean)."""
        left = []
        listed = _ip("netns", "list", check=False).stdout.decode()
        left += [ns for ns in self.namespaces + [self.relay_ns] if ns in listed.split()]
        links = _ip("-o", "link", "show", check=False).stdout.decode()
        left += [name for kind, name in self._made if kind == "link" and name + ":" in links
                 or kind == "link" and name + "@" in links]
        left += [name for kind, name in self._made
                 if kind in ("dir", "file") and os.path.exists(name)]
        for run in self.runs:
            left += glob.glob("/dev/shm/epl-%s-*" % run)
        return left

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- the latency relay


def _pump(src, dst, delay, done):
    """src -> dst, every chunk delivered ``delay`` seconds after it arrived (a reader
    and a writer thread: the delay is latency, not a bandwidth limit)."""
    q = queue.Queue()

    def write():
        while True:
            due, data = q.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                if data is None:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
            except OSError:
                break
        done()

    threading.Thread(target=write, daemon=True).start()
    while True:
        try:
            data = src.recv(1 << 20)
        except OSError:
            data = b""
        q.put((time.monotonic() + delay, data or None))
        if not data:
            return


_LOG_LOCK = threading.Lock()


def _serve(listen, target, delay, log):
    host, port = listen.rsplit(":", 1)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, int(port)))
    srv.listen(64)
    thost, tport = target.rsplit(":", 1)

    def handle(client):
        if log:
            with _LOG_LOCK, open(log, "a") as f:
                f.write(listen + "\n")
        try:
            upstream = socket.create_connection((thost, int(tport)), timeout=10)
        except OSError:
            client.close()   # (as the target would: refused / unreachable)
            return
        upstream.settimeout(None)
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        closed = []

        def done():
            if not closed:
                closed.append(True)
                for s in (client, upstream):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
        threading.Thread(target=_pump, args=(client, upstream, delay, done),
                         daemon=True).start()
        _pump(upstream, client, delay, done)

    def accept():
        while True:
            c, _ = srv.accept()
            threading.Thread(target=handle, args=(c,), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()


def relay_main(argv):
    p = argparse.ArgumentParser(prog="netns.py relay")
    p.add_argument("--delay", type=float, required=True, help="seconds added each way")
    p.add_argument("--log", default="", help="a file: one line per connection (its LISTEN)")
    p.add_argument("--map", nargs="+", required=True, help="LISTEN_HOST:PORT=TARGET_HOST:PORT")
    a = p.parse_args(argv)
    for m in a.map:
        listen, target = m.split("=")
        _serve(listen, target, a.delay, a.log)
    print("RELAY READY", flush=True)
    signal.sigwait([signal.SIGTERM, signal.SIGINT])


if __name__ == "__main__":
    if sys.argv[1:2] == ["relay"]:
        relay_main(sys.argv[2:])
    else:
        sys.exit("usage: netns.py relay --delay S --map LISTEN=TARGET ...")
