// Collectives between hosts over TCP: ring algorithms over one authenticated
// connection per pair of processes of a job, shared by all of the job's groups.
//
// Every process listens on its own address in EPL_COMM_ADDRESSES ("host:port" per
// rank, rank = worker index; set by epl-launch) -- that host only, not every
// interface.  The lower rank of a pair connects to the higher.  Before any byte of a
// collective is trusted, both sides prove they know the job's secret (EPL_JOB_SECRET,
// set by epl-launch or the scheduler): the listener sends a random nonce, the client
// answers with its own nonce and HMAC-SHA256(secret, client | job | rank | nonces),
// the listener answers with HMAC-SHA256(secret, server | ...).  The secret never
// crosses the network.  A connection that fails the handshake is closed and logged
// with its address; at most kMaxPending handshakes run at once.  Retries back off (a
// peer that refuses this worker's proof is told apart and named in the error), and so
// does a listener whose accept() fails for want of descriptors.  A peer's socket is
// closed once its connection ends.  (Tensors are not encrypted: see docs/cluster.md
// for what this protects against.)
//
// On a connection, frames carry (type, group, length) and a payload; a reader thread
// per connection files data frames into per-(peer, group) mailboxes, so any number
// of groups share the connection.  A peer that disconnects, or an abort frame,
// fails every pending and later collective of the job.
//
// Every error about a peer names it by rank and address ("rank 1 (h1:7001)"): across
// hosts, the address is what tells a person which machine to look at.  Nothing waits
// on the network past communication.timeout_seconds: connecting is non-blocking with
// the collective's deadline, and a connection whose sent data stays unacknowledged
// that long (a partition, a host that went off) fails in the kernel
// (TCP_USER_TIMEOUT), so a send blocked on a full buffer ends too.  A partition is
// silent (no reset, no FIN): it looks like a slow peer, and the collective timeout
// is what ends a collective that waits for data across it.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "crossproc.h"
#include "sha256.h"
#include "tensorflow/core/lib/core/errors.h"
#include "tensorflow/core/lib/strings/strcat.h"

namespace epl {

using tensorflow::errors::Aborted;
using tensorflow::errors::DeadlineExceeded;
using tensorflow::errors::Internal;
using tensorflow::errors::InvalidArgument;
using tensorflow::errors::Unauthenticated;
using tensorflow::errors::Unavailable;
using tensorflow::strings::StrCat;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint32_t kFrameMagic = 0x45504c46;   // "EPLF"
constexpr uint32_t kData = 1, kAbort = 2;
constexpr int64 kMaxFrame = 16 << 20;           // the largest frame a reader accepts
constexpr int64 kSendFrame = 1 << 20;           // larger messages travel as several frames:
                                                // the receiver copies one while the next arrives
constexpr int kMaxPending = 8;                   // handshakes in progress at once
constexpr int kHandshakeSeconds = 5;

// A received payload.
struct Frame {
  std::unique_ptr<char[]> data;
  int64 len;
};

struct FrameHeader {
  uint32_t magic;
  uint32_t type;
  uint64_t group;
  uint64_t len;
};

std::vector<std::pair<string, int>> Addresses() {
  std::vector<std::pair<string, int>> out;
  const char* env = std::getenv("EPL_COMM_ADDRESSES");
  string s = env ? env : "";
  size_t pos = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    string item = s.substr(pos, comma == string::npos ? string::npos : comma - pos);
    size_t colon = item.rfind(':');
    if (colon != string::npos)
      out.emplace_back(item.substr(0, colon), std::atoi(item.c_str() + colon + 1));
    if (comma == string::npos) break;
    pos = comma + 1;
  }
  return out;
}

// "rank k (host:port)": a peer as a person looks for it.
string Where(int rank) {
  auto addrs = Addresses();
  if (rank < 0 || rank >= static_cast<int>(addrs.size())) return StrCat("rank ", rank);
  return StrCat("rank ", rank, " (", addrs[rank].first, ":", addrs[rank].second, ")");
}

// Security events and the missing-secret warning always reach stderr (TensorFlow's
// log level, often 2 in production, would hide a LOG(WARNING)).
void Report(const string& message) {
  fprintf(stderr, "%s\n", message.c_str());
  fflush(stderr);
}

// What to do about an errno that means the process ran out of descriptors.
string FdHint(int err) {
  if (err == EMFILE)
    return " (EMFILE: this process is out of file descriptors; raise its limit, `ulimit -n`, "
           "or find what holds them: ls /proc/<pid>/fd)";
  if (err == ENFILE)
    return " (ENFILE: the system is out of file descriptors: raise fs.file-max)";
  return "";
}

string Secret(const string& job) {
  const char* env = std::getenv("EPL_JOB_SECRET");
  if (env != nullptr && *env) return env;
  static bool warned = false;
  if (!warned) {
    warned = true;
    Report("EPL tcp: EPL_JOB_SECRET is not set, so the job's secret is derived from its id: "
           "a process that knows the job id can join its collectives. epl-launch sets a random "
           "one; with another launcher export the same random EPL_JOB_SECRET to every worker "
           "(docs/cluster.md).");
  }
  return Sha256("epl-job-without-a-secret:" + job);
}

// 16 fresh random bytes from the kernel (getrandom(2): no file descriptor, so it works in
// a process that has run out of them).  A handshake nonce must never be predictable: a
// fixed one would let a recorded handshake be replayed.  So there is no fallback: when
// the kernel gives no random bytes, the connection is not made and `why` says so.
bool Nonce(string* out, string* why) {
  string n(16, '\0');
  size_t got = 0;
  while (got < n.size()) {
    const ssize_t k = ::getrandom(&n[got], n.size() - got, 0);
    if (k < 0) {
      if (errno == EINTR) continue;
      *why = StrCat("no random bytes for the handshake's nonce (getrandom: ", strerror(errno),
                    "); a connection with a predictable nonce is never made");
      return false;
    }
    got += static_cast<size_t>(k);
  }
  *out = n;
  return true;
}

// Sleeps `*delay_ms` (at most until `deadline`), then doubles it up to `cap_ms`: retries
// against a peer that refuses us must not run every few milliseconds for the whole
// timeout (each one costs the peer a handshake and a line in its log).
void BackOff(int* delay_ms, int cap_ms, Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - Clock::now()).count();
  const int ms = static_cast<int>(std::max<int64>(1, std::min<int64>(*delay_ms, left + 1)));
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  *delay_ms = std::min(*delay_ms * 2, cap_ms);
}

// Small frames (a ring step's length, an empty block) go out at once, on both ends of
// a connection: Nagle's algorithm would hold them until the peer's delayed ACK.
void NoDelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Sent data that stays unacknowledged for `seconds` fails the connection (the peer's
// host is gone or cut off), so no send blocks past the collective timeout.
void UserTimeout(int fd, int seconds) {
  const unsigned int ms = static_cast<unsigned int>(std::max(1, seconds)) * 1000u;
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof(ms));
}

// connect() that gives up at the deadline (a host that is off answers nothing: a
// blocking connect would wait for the kernel's SYN retries, minutes).  Leaves the
// socket blocking; on failure `why` says what happened.
bool ConnectBy(int fd, const sockaddr* addr, socklen_t len, Clock::time_point deadline,
               string* why) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int err = ::connect(fd, addr, len) == 0 ? 0 : errno;
  if (err == EINPROGRESS) {
    err = ETIMEDOUT;
    while (true) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - Clock::now()).count();
      if (ms <= 0) break;
      struct pollfd pfd = {fd, POLLOUT, 0};
      const int k = ::poll(&pfd, 1, static_cast<int>(std::min<int64>(ms, 1000)));
      if (k < 0 && errno != EINTR) {
        err = errno;
        break;
      }
      if (k > 0) {
        socklen_t n = sizeof(err);
        if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &n) != 0) err = errno;
        break;
      }
    }
  }
  ::fcntl(fd, F_SETFL, flags);
  if (err != 0) *why = strerror(err);
  return err == 0;
}

Status SendAll(int fd, const void* p, int64 n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t k = ::send(fd, c, std::min<int64>(n, 1 << 20), MSG_NOSIGNAL);
    if (k <= 0) return Unavailable("send failed: ", strerror(errno));
    c += k;
    n -= k;
  }
  return OkStatus();
}

// Reads exactly n bytes; fails at the deadline (none: wait forever) or when closed.
Status RecvAll(int fd, void* p, int64 n, bool has_deadline, Clock::time_point deadline) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    struct pollfd pfd = {fd, POLLIN, 0};
    int ms = 1000;
    if (has_deadline) {
      ms = static_cast<int>(
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
      if (ms <= 0) return DeadlineExceeded("timed out");
      ms = std::min(ms, 1000);
    }
    if (::poll(&pfd, 1, ms) < 0) return Unavailable("poll failed: ", strerror(errno));
    if (!(pfd.revents & (POLLIN | POLLHUP | POLLERR))) continue;
    ssize_t k = ::recv(fd, c, std::min<int64>(n, 1 << 20), 0);
    if (k <= 0) return Unavailable(k == 0 ? "the connection was closed" : strerror(errno));
    // Acknowledge at once: in one-way traffic (broadcast, a ring step whose peer sends
    // nothing) Linux would otherwise delay the ACK by up to 40 ms once it saw the
    // request-response pattern, and the sender stalls on a full window.  (Not sticky:
    // set after every read.)
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_QUICKACK, &one, sizeof(one));
    c += k;
    n -= k;
  }
  return OkStatus();
}

string PeerAddress(int fd) {
  sockaddr_in sa;
  socklen_t len = sizeof(sa);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return "?";
  char buf[64];
  inet_ntop(AF_INET, &sa.sin_addr, buf, sizeof(buf));
  return StrCat(buf, ":", ntohs(sa.sin_port));
}

string U64(uint64_t v) { return string(reinterpret_cast<const char*>(&v), 8); }

string ClientProof(const string& secret, const string& job, int rank, const string& server_nonce,
                   const string& client_nonce) {
  return HmacSha256(secret, StrCat("epl-client|", job, "|", rank, "|") + server_nonce +
                                client_nonce);
}

string ServerProof(const string& secret, const string& job, int rank, const string& server_nonce,
                   const string& client_nonce) {
  return HmacSha256(secret, StrCat("epl-server|", job, "|", rank, "|") + client_nonce +
                                server_nonce);
}

// x[i] /= n for i < count (integers truncate toward zero).
template <typename T>
void DivideTyped(char* p, int64 count, int n) {
  T* x = reinterpret_cast<T*>(p);
  for (int64 i = 0; i < count; ++i) x[i] = static_cast<T>(x[i] / n);
}

void DivideRange(DataType dtype, char* p, int64 count, int n) {
  switch (dtype) {
    case tensorflow::DT_FLOAT: DivideTyped<float>(p, count, n); break;
    case tensorflow::DT_DOUBLE: DivideTyped<double>(p, count, n); break;
    case tensorflow::DT_INT32: DivideTyped<int32_t>(p, count, n); break;
    case tensorflow::DT_INT64: DivideTyped<int64_t>(p, count, n); break;
    default: {
      Eigen::half* h = reinterpret_cast<Eigen::half*>(p);
      for (int64 i = 0; i < count; ++i) h[i] = Eigen::half(static_cast<float>(h[i]) / n);
    }
  }
}

// ---- one job's connections ----------------------------------------------------------------

class Mesh {
 public:
  Mesh(const string& job, int rank, int size, int timeout_seconds)
      : job_(job), rank_(rank), size_(size), timeout_seconds_(timeout_seconds),
        secret_(Secret(job)), peers_(size) {}

  const string& job() const { return job_; }
  const string& secret() const { return secret_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

  // The connection to `peer`, made (or waited for) until the deadline.
  Status Ensure(int peer, Clock::time_point deadline, const CrossArgs& a);
  // Connects to a higher rank and proves the job's secret (the client's side).
  Status Connect(int peer, Clock::time_point deadline, const CrossArgs& a);

  // Adopts an authenticated connection from `peer` (the listener side).
  bool Adopt(int peer, int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    if (peer < 0 || peer >= size_ || peers_[peer].fd >= 0 || peers_[peer].dead) return false;
    Start(peer, fd);
    cv_.notify_all();
    return true;
  }

  Status Send(int peer, uint64_t group, const char* p, int64 n, const CrossArgs& a) {
    do {
      const int64 len = std::min(n, kSendFrame);
      Status s = SendFrame(peer, kData, group, p, len);
      if (!s.ok()) return Lost(peer, a, s);
      p += len;
      n -= len;
    } while (n > 0);
    return OkStatus();
  }

  // The next `n` bytes `peer` sent for `group`.
  Status Recv(int peer, uint64_t group, char* out, int64 n, const CrossArgs& a) {
    const auto deadline = Clock::now() + std::chrono::seconds(a.timeout_seconds);
    auto key = std::make_pair(peer, group);
    do {
      Frame frame;
      {
        std::unique_lock<std::mutex> lock(mu_);
        while (mail_[key].empty()) {
          Status st = JobState::Get(job_)->Aborted();
          if (!st.ok()) return st;
          if (peers_[peer].dead)
            return Aborted("EPL ", a.what, " (group '", a.group, "'): ", Where(peer),
                           " disconnected while rank ", rank_, " waited for its data (",
                           peers_[peer].why, "): a worker died or left the job before its "
                           "collectives were done.");
          if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && mail_[key].empty())
            return DeadlineExceeded("EPL ", a.what, " (group '", a.group, "'): ",
                                    Where(peer), " sent nothing within ", a.timeout_seconds,
                                    " s (communication.timeout_seconds): a worker ran a "
                                    "different step, is stuck, or cannot be reached (a "
                                    "network partition looks the same).");
        }
        frame = std::move(mail_[key].front());
        mail_[key].pop_front();
      }
      if (frame.len > n)
        return Internal("EPL ", a.what, " (group '", a.group, "'): ", Where(peer), " sent ",
                        frame.len, " bytes where ", n, " were expected");
      std::memcpy(out, frame.data.get(), frame.len);
      out += frame.len;
      n -= frame.len;
    } while (n > 0);
    return OkStatus();
  }

  // Tells every connected peer that the job failed, and wakes this process's waiters.
  void SendAbort(const Status& s) {
    const string msg = StrCat(static_cast<int>(s.code()), ":", StatusMessage(s));
    // (best effort: a peer that cannot be told has died or will time out itself)
    for (int p = 0; p < size_; ++p) SendFrame(p, kAbort, 0, msg.data(), msg.size()).IgnoreError();
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_all();
  }

 private:
  struct Peer {
    int fd = -1;
    bool connecting = false;
    bool dead = false;
    string why;
    std::shared_ptr<std::mutex> send_mu = std::make_shared<std::mutex>();
  };

  // The descriptor is read under the peer's send lock, which its reader also takes
  // before it closes a dead connection: a send never writes to a closed descriptor (or
  // to another socket that reused its number).
  Status SendFrame(int peer, uint32_t type, uint64_t group, const char* p, int64 n) {
    if (peer == rank_) return Unavailable("not connected");
    std::shared_ptr<std::mutex> send_mu;
    {
      std::lock_guard<std::mutex> lock(mu_);
      send_mu = peers_[peer].send_mu;
    }
    std::lock_guard<std::mutex> send_lock(*send_mu);
    int fd;
    {
      std::lock_guard<std::mutex> lock(mu_);
      fd = peers_[peer].fd;
    }
    if (fd < 0) return Unavailable("not connected");
    FrameHeader h = {kFrameMagic, type, group, static_cast<uint64_t>(n)};
    TF_RETURN_IF_ERROR(SendAll(fd, &h, sizeof(h)));
    return SendAll(fd, p, n);
  }

  Status Lost(int peer, const CrossArgs& a, const Status& s) {
    return Aborted("EPL ", a.what, " (group '", a.group, "'): cannot send to ", Where(peer),
                   " (", StatusMessage(s), "): a worker died, left the job, or cannot be "
                   "reached.");
  }

  // Called with mu_ held.
  void Start(int peer, int fd) {
    UserTimeout(fd, timeout_seconds_);
    peers_[peer].fd = fd;
    std::thread([this, peer, fd] { Read(peer, fd); }).detach();
  }

  void Read(int peer, int fd) {
    Status s;
    while (true) {
      FrameHeader h;
      s = RecvAll(fd, &h, sizeof(h), false, Clock::now());
      if (!s.ok()) break;
      if (h.magic != kFrameMagic || h.len > static_cast<uint64_t>(kMaxFrame)) {
        s = Internal("a malformed frame");
        break;
      }
      Frame frame{std::unique_ptr<char[]>(new char[h.len ? h.len : 1]),
                  static_cast<int64>(h.len)};   // (not zero-filled: the socket fills it)
      s = RecvAll(fd, frame.data.get(), h.len, false, Clock::now());
      if (!s.ok()) break;
      if (h.type == kAbort) {
        const string payload(frame.data.get(), h.len);
        const size_t colon = payload.find(':');
        const int code = std::atoi(payload.substr(0, colon).c_str());
        Status why = MakeStatus(code ? code : tensorflow::error::ABORTED,
                   payload.substr(colon == string::npos ? 0 : colon + 1));
        JobState::Get(job_)->Forward(why);   // (adopts, and tells the other peers)
        std::lock_guard<std::mutex> lock(mu_);
        cv_.notify_all();
        continue;
      }
      std::lock_guard<std::mutex> lock(mu_);
      mail_[std::make_pair(peer, h.group)].push_back(std::move(frame));
      cv_.notify_all();
    }
    // The peer is gone for good (a connection is never made twice): close its socket,
    // or every dead peer would keep a descriptor (and a CLOSE_WAIT socket) for the
    // life of the process.  shutdown() first ends a send blocked on this socket, so
    // the send lock below is free soon.
    std::shared_ptr<std::mutex> send_mu;
    {
      std::lock_guard<std::mutex> lock(mu_);
      peers_[peer].dead = true;
      peers_[peer].why = StatusMessage(s);
      send_mu = peers_[peer].send_mu;
      cv_.notify_all();
    }
    ::shutdown(fd, SHUT_RDWR);
    std::lock_guard<std::mutex> send_lock(*send_mu);
    {
      std::lock_guard<std::mutex> lock(mu_);
      peers_[peer].fd = -1;
    }
    ::close(fd);
  }

  string job_;
  int rank_, size_;
  int timeout_seconds_;   // (the first collective's: sent data unacknowledged that long
                          // fails the connection)
  string secret_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Peer> peers_;
  std::map<std::pair<int, uint64_t>, std::deque<Frame>> mail_;
};

// ---- the process's listener ------------------------------------------------------------

class Hub {
 public:
  static Hub* Get() {
    static Hub* hub = new Hub();
    return hub;
  }

  Status Listen(int rank) {
    std::lock_guard<std::mutex> lock(mu_);
    if (listening_) return OkStatus();
    auto addrs = Addresses();
    if (rank >= static_cast<int>(addrs.size()))
      return InvalidArgument("EPL tcp transport: EPL_COMM_ADDRESSES has ", addrs.size(),
                             " addresses, rank ", rank, " needs its own (set by epl-launch)");
    addrinfo hints, *res = nullptr;
    std::memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    if (::getaddrinfo(addrs[rank].first.c_str(), std::to_string(addrs[rank].second).c_str(),
                      &hints, &res) != 0 || res == nullptr)
      return InvalidArgument("EPL tcp: cannot resolve this worker's address ",
                             addrs[rank].first, ":", addrs[rank].second);
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      const string err = strerror(errno);
      ::freeaddrinfo(res);
      return Internal("EPL tcp: cannot make a socket to listen on ", addrs[rank].first, ":",
                      addrs[rank].second, ": ", err, FdHint(errno));
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    // Only this task's own address (not INADDR_ANY): other interfaces stay closed.
    const bool ok = ::bind(fd, res->ai_addr, res->ai_addrlen) == 0 && ::listen(fd, 64) == 0;
    ::freeaddrinfo(res);
    if (!ok) {
      const string err = strerror(errno);
      ::close(fd);
      return Internal("EPL tcp: cannot listen on ", addrs[rank].first, ":", addrs[rank].second,
                      ": ", err);
    }
    listening_ = true;
    std::thread([this, fd] { Accept(fd); }).detach();
    return OkStatus();
  }

  void Register(Mesh* mesh) {
    std::lock_guard<std::mutex> lock(mu_);
    meshes_[Fnv1a(mesh->job())] = mesh;
    cv_.notify_all();
  }

  // What kept lower ranks from connecting, for the error of a collective that waited
  // for them in vain ("" when nothing is known): the listener failing to accept (out
  // of file descriptors), else the last connection it refused and why.
  string Trouble() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accept_error_.empty()) return StrCat(" This process cannot accept connections: ",
                                              accept_error_, ".");
    if (!last_refusal_.empty()) return StrCat(" The last connection this process refused: ",
                                              last_refusal_, ".");
    return "";
  }

 private:
  // accept() fails without taking the connection off the queue when the process is out
  // of descriptors (EMFILE, ENFILE) or memory: retrying at once would spin a core until
  // one frees up.  Such failures back off (10 ms doubling to 1 s), are reported once,
  // and are named by Trouble() in the errors of the collectives that wait.
  void Accept(int lfd) {
    int delay_ms = 10;
    while (true) {
      int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        const int err = errno;
        if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;   // (one connection)
        const string what = StrCat("accept() failed: ", strerror(err), FdHint(err));
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (accept_error_ != what) Report(StrCat("EPL tcp: ", what));
          accept_error_ = what;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
        delay_ms = std::min(delay_ms * 2, 1000);
        continue;
      }
      delay_ms = 10;
      NoDelay(fd);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!accept_error_.empty()) {
          Report("EPL tcp: accepting connections again");
          accept_error_.clear();
        }
        if (pending_ >= kMaxPending) {
          Report(StrCat("EPL tcp: refused a connection from ", PeerAddress(fd), ": ",
                        kMaxPending, " handshakes are already in progress"));
          ::close(fd);
          continue;
        }
        ++pending_;
      }
      std::thread([this, fd] {
        const string who = PeerAddress(fd);
        string why;
        bool spoke = false;
        const bool ok = Handshake(fd, &why, &spoke);
        if (!ok) {
          Report(StrCat("EPL tcp: refused a connection from ", who, ": ", why));
          ::close(fd);
        }
        std::lock_guard<std::mutex> lock(mu_);
        // (kept for errors when it sent a handshake: a peer giving up or a port scan
        // says nothing about why a worker could not join)
        if (!ok && spoke) last_refusal_ = StrCat("from ", who, ": ", why);
        --pending_;
      }).detach();
    }
  }

  // The listener's side; on success the connection belongs to a job's mesh.  `spoke`:
  // the peer sent a whole handshake.
  bool Handshake(int fd, string* why, bool* spoke) {
    const auto deadline = Clock::now() + std::chrono::seconds(kHandshakeSeconds);
    string server_nonce;
    if (!Nonce(&server_nonce, why)) return false;
    const string hello = string("EPLH") + server_nonce;
    if (!SendAll(fd, hello.data(), hello.size()).ok()) return (*why = "it went away", false);
    char msg[4 + 8 + 4 + 16 + 32];
    const Status got = RecvAll(fd, msg, sizeof(msg), true, deadline);
    if (!got.ok())
      return (*why = StrCat("no handshake within ", kHandshakeSeconds, " s (",
                            StatusMessage(got), ")"), false);
    *spoke = true;
    if (std::memcmp(msg, "EPLC", 4) != 0) return (*why = "not an EPL handshake", false);
    uint64_t job_hash;
    int32_t peer;
    std::memcpy(&job_hash, msg + 4, 8);
    std::memcpy(&peer, msg + 12, 4);
    const string client_nonce(msg + 16, 16), proof(msg + 32, 32);
    Mesh* mesh = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_until(lock, deadline, [&] { return meshes_.count(job_hash) > 0; });
      if (meshes_.count(job_hash)) mesh = meshes_[job_hash];
    }
    if (mesh == nullptr) return (*why = "it names a job this process does not run", false);
    if (!SameDigest(proof, ClientProof(mesh->secret(), mesh->job(), peer, server_nonce,
                                       client_nonce)))
      return (*why = "the handshake does not prove the job's secret (EPL_JOB_SECRET)", false);
    if (peer < 0 || peer >= mesh->rank())
      return (*why = StrCat("it claims rank ", peer, ", which does not connect to rank ",
                            mesh->rank()), false);
    const string reply = string("EPLS") + ServerProof(mesh->secret(), mesh->job(), mesh->rank(),
                                                      server_nonce, client_nonce);
    if (!SendAll(fd, reply.data(), reply.size()).ok()) return (*why = "it went away", false);
    if (!mesh->Adopt(peer, fd)) return (*why = StrCat("rank ", peer, " is already connected"), false);
    return true;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool listening_ = false;
  int pending_ = 0;
  std::map<uint64_t, Mesh*> meshes_;
  string accept_error_;   // the listener's current accept() failure ("" while it accepts)
  string last_refusal_;   // the last handshake refused: "from <address>: <why>"
};

Status Mesh::Ensure(int peer, Clock::time_point deadline, const CrossArgs& a) {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (peers_[peer].dead)
      return Aborted("EPL ", a.what, " (group '", a.group, "'): ", Where(peer),
                     " disconnected (", peers_[peer].why, "): a worker died or left the job "
                     "before its collectives were done.");
    if (peers_[peer].fd >= 0) return OkStatus();
    if (peer > rank_ && !peers_[peer].connecting) break;   // this process connects
    // The lower rank connects to us, or another of this job's groups is connecting.
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && peers_[peer].fd < 0) {
      lock.unlock();
      return DeadlineExceeded("EPL ", a.what, " (group '", a.group, "'): ", Where(peer),
                              peer < rank_ ? " never connected to " : " was not reached by ",
                              Where(rank_), " within ", a.timeout_seconds,
                              " s (communication.timeout_seconds): is it running, and can "
                              "the hosts reach each other?",
                              peer < rank_ ? Hub::Get()->Trouble() : string());
    }
  }
  peers_[peer].connecting = true;   // one connection per pair: the others wait for it
  lock.unlock();
  Status result = Connect(peer, deadline, a);
  lock.lock();
  peers_[peer].connecting = false;
  cv_.notify_all();
  return result;
}

// Retries until the deadline, waiting longer after each failure: up to 250 ms while the
// peer is not up yet (it may be importing TensorFlow), up to 1 s while it refuses this
// worker's proof of the secret (that does not fix itself; every try costs the peer a
// handshake and a line in its log).  A refusal is a listener that closes the connection
// on reading the proof: its secret is not ours.
Status Mesh::Connect(int peer, Clock::time_point deadline, const CrossArgs& a) {
  auto addrs = Addresses();
  if (peer >= static_cast<int>(addrs.size()))
    return InvalidArgument("EPL tcp transport: no address for rank ", peer,
                           " in EPL_COMM_ADDRESSES");
  string last = "refused", rejection;
  int delay_ms = 20, rejections = 0;
  while (true) {
    bool rejected = false;   // (this try)
    addrinfo hints, *res = nullptr;
    std::memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (::getaddrinfo(addrs[peer].first.c_str(), std::to_string(addrs[peer].second).c_str(),
                      &hints, &res) != 0) {
      last = StrCat("cannot resolve ", addrs[peer].first);
    } else {
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) {
        last = StrCat("no socket: ", strerror(errno), FdHint(errno));
        ::freeaddrinfo(res);
      } else {
        const bool connected = ConnectBy(fd, res->ai_addr, res->ai_addrlen, deadline, &last);
        ::freeaddrinfo(res);
        if (connected) {
          NoDelay(fd);
          const auto hs = Clock::now() + std::chrono::seconds(kHandshakeSeconds);
          char hello[4 + 16];
          string client_nonce, no_nonce;
          Status s = RecvAll(fd, hello, sizeof(hello), true, hs);
          if (s.ok() && std::memcmp(hello, "EPLH", 4) != 0) s = Internal("not an EPL listener");
          if (s.ok() && !Nonce(&client_nonce, &no_nonce)) {
            ::close(fd);
            return Internal("EPL ", a.what, " (group '", a.group, "'): cannot connect to ",
                            Where(peer), ": ", no_nonce);
          }
          if (s.ok()) {
            const string server_nonce(hello + 4, 16);
            const uint64_t job_hash = Fnv1a(job_);
            const int32_t me = rank_;
            const string msg = string("EPLC") + U64(job_hash) +
                               string(reinterpret_cast<const char*>(&me), 4) + client_nonce +
                               ClientProof(secret_, job_, rank_, server_nonce, client_nonce);
            s = SendAll(fd, msg.data(), msg.size());
            char reply[4 + 32];
            if (s.ok()) {
              s = RecvAll(fd, reply, sizeof(reply), true, hs);
              // Closed (or reset) as soon as it read the proof: the listener's secret is
              // not this worker's.
              rejected = !s.ok() && s.code() == tensorflow::error::UNAVAILABLE;
            }
            if (s.ok() && (std::memcmp(reply, "EPLS", 4) != 0 ||
                           !SameDigest(string(reply + 4, 32),
                                       ServerProof(secret_, job_, peer, server_nonce,
                                                   client_nonce)))) {
              rejected = true;
              s = Internal("it does not prove the job's secret");
            }
          }
          if (s.ok()) {
            std::lock_guard<std::mutex> lock(mu_);
            Start(peer, fd);
            return OkStatus();
          }
          last = StatusMessage(s);
          if (rejected) rejection = last;
        }
        ::close(fd);
      }
    }
    rejections += rejected;
    if (Clock::now() < deadline) BackOff(&delay_ms, rejected ? 1000 : 250, deadline);
    if (Clock::now() >= deadline) {   // (no try after it: the peer would log a dropped one)
      if (rejections > 0)
        return Unauthenticated(
            "EPL ", a.what, " (group '", a.group, "'): ", Where(peer), " refused this "
            "worker's handshake ", rejections, " times in ", a.timeout_seconds,
            " s (last: ", rejection, "): the job's secret does not match -- EPL_JOB_SECRET "
            "differs between the workers.  Give every worker of the job the same "
            "EPL_JOB_SECRET (epl-launch sets one for all the workers it starts); the peer's "
            "log names these refused connections.");
      return DeadlineExceeded("EPL ", a.what, " (group '", a.group, "'): ", Where(peer),
                              " did not accept within ", a.timeout_seconds,
                              " s (communication.timeout_seconds; last: ", last,
                              "): is it running, and can the hosts reach each other?");
    }
  }
}

Mesh* MeshFor(const CrossArgs& a, Status* s) {
  static std::mutex mu;
  static auto* meshes = new std::map<string, std::unique_ptr<Mesh>>();
  const string job = JobOf(a.group);
  std::lock_guard<std::mutex> lock(mu);
  auto& m = (*meshes)[job];
  if (!m) {
    *s = Hub::Get()->Listen(a.rank);
    if (!s->ok()) return nullptr;
    m.reset(new Mesh(job, a.rank, a.size, a.timeout_seconds));
    Mesh* mesh = m.get();
    JobState::Get(job)->AddPropagator([mesh](const Status& st) { mesh->SendAbort(st); });
    Hub::Get()->Register(mesh);
  }
  if (m->rank() != a.rank || m->size() != a.size) {
    *s = InvalidArgument("EPL tcp group '", a.group, "' runs as rank ", a.rank, "/", a.size,
                         " but the job's other groups as ", m->rank(), "/", m->size());
    return nullptr;
  }
  return m.get();
}

// ---- a group's link: ring algorithms over the mesh -----------------------------------------

class TcpLink : public Link {
 public:
  TcpLink(Mesh* mesh, const string& group)
      : mesh_(mesh), group_(Fnv1a(group)), rank_(mesh->rank()), size_(mesh->size()) {}

  Status Connect(const CrossArgs& a) {
    if (size_ == 1) return OkStatus();
    const auto deadline = Clock::now() + std::chrono::seconds(a.timeout_seconds);
    TF_RETURN_IF_ERROR(mesh_->Ensure(Next(), deadline, a));
    return mesh_->Ensure(Prev(), deadline, a);
  }

  Status ExchangeMeta(const CrossArgs& a, const std::vector<int64>& mine,
                      std::vector<std::vector<int64>>* all) override {
    std::vector<int64> block = {static_cast<int64>(Fnv1a(a.what)),
                                static_cast<int64>(mine.size())};
    block.insert(block.end(), mine.begin(), mine.end());
    std::vector<string> blocks(size_);
    blocks[rank_] = string(reinterpret_cast<const char*>(block.data()), block.size() * 8);
    // Ring all-gather of variable-length blocks: frame lengths carry the sizes.
    for (int s = 0; s < size_ - 1; ++s) {
      const int send = Mod(rank_ - s), recv = Mod(rank_ - s - 1);
      const int64 out_len = blocks[send].size();
      TF_RETURN_IF_ERROR(mesh_->Send(Next(), group_, reinterpret_cast<const char*>(&out_len), 8, a));
      TF_RETURN_IF_ERROR(mesh_->Send(Next(), group_, blocks[send].data(), out_len, a));
      int64 len = 0;
      TF_RETURN_IF_ERROR(mesh_->Recv(Prev(), group_, reinterpret_cast<char*>(&len), 8, a));
      blocks[recv].resize(len);
      if (len) TF_RETURN_IF_ERROR(mesh_->Recv(Prev(), group_, &blocks[recv][0], len, a));
    }
    all->assign(size_, {});
    Status st;
    for (int k = 0; k < size_; ++k) {
      const int64* m = reinterpret_cast<const int64*>(blocks[k].data());
      const size_t words = blocks[k].size() / 8;
      if (words < 2 || m[0] != block[0]) {
        st = InvalidArgument("EPL ", a.what, " (group '", a.group, "'): rank ", k,
                             " runs a different collective; every process must build the same "
                             "collectives in the same order.");
        continue;
      }
      (*all)[k].assign(m + 2, m + std::min<size_t>(words, 2 + m[1]));
    }
    return st;
  }

  // Ring all-reduce: size-1 reduce-scatter steps, then size-1 all-gather steps.  The
  // first step sends straight from the input and every reduction reads this rank's part
  // of the input in place (no copy of the input into the output first); a mean divides
  // each rank's fully reduced block once, before it is passed around.
  Status AllReduce(const CrossArgs& a, DataType dtype, ReduceOp op, const char* in, char* out,
                   int64 count) override {
    const int64 es = tensorflow::DataTypeSize(dtype);
    if (size_ == 1) {
      if (in != out) std::memcpy(out, in, count * es);
      return OkStatus();
    }
    auto lo = [&](int k) { return count * k / size_; };
    const int64 need = (count / size_ + 1) * es;
    if (buf_bytes_ < need) {   // (kept across runs: no allocation per step)
      buf_.reset(new char[need]);
      buf_bytes_ = need;
    }
    char* buf = buf_.get();
    const ReduceOp sum_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
    for (int s = 0; s < size_ - 1; ++s) {   // reduce-scatter
      const int send = Mod(rank_ - s), recv = Mod(rank_ - s - 1);
      const int64 rn = lo(recv + 1) - lo(recv);
      TF_RETURN_IF_ERROR(Step((s == 0 ? in : out) + lo(send) * es,
                              (lo(send + 1) - lo(send)) * es, buf, rn * es, a));
      std::vector<const void*> ins = {in + lo(recv) * es, buf};
      ReduceRange(dtype, sum_op, ins, out + lo(recv) * es, 0, rn);
    }
    const int mine = Mod(rank_ + 1);   // the block this rank now holds reduced
    if (op == ReduceOp::kMean)
      DivideRange(dtype, out + lo(mine) * es, lo(mine + 1) - lo(mine), size_);
    for (int s = 0; s < size_ - 1; ++s) {   // all-gather
      const int send = Mod(rank_ + 1 - s), recv = Mod(rank_ - s);
      TF_RETURN_IF_ERROR(Step(out + lo(send) * es, (lo(send + 1) - lo(send)) * es,
                              out + lo(recv) * es, (lo(recv + 1) - lo(recv)) * es, a));
    }
    return OkStatus();
  }

  Status Exchange(const CrossArgs& a, const char* mine, const std::vector<int64>& lens,
                  const Consumer& consume) override {
    std::vector<int64> off(size_ + 1, 0);
    for (int k = 0; k < size_; ++k) off[k + 1] = off[k] + lens[k];
    std::vector<char> all(off[size_]);
    if (lens[rank_]) std::memcpy(all.data() + off[rank_], mine, lens[rank_]);
    for (int s = 0; s < size_ - 1; ++s) {   // ring all-gather of the blocks
      const int send = Mod(rank_ - s), recv = Mod(rank_ - s - 1);
      TF_RETURN_IF_ERROR(Step(all.data() + off[send], lens[send], all.data() + off[recv],
                              lens[recv], a));
    }
    for (int k = 0; k < size_; ++k)
      if (lens[k] > 0) consume(k, 0, k == rank_ ? mine : all.data() + off[k], lens[k]);
    return OkStatus();
  }

 private:
  int Mod(int k) const { return ((k % size_) + size_) % size_; }
  int Next() const { return Mod(rank_ + 1); }
  int Prev() const { return Mod(rank_ - 1); }

  // Sends to the next rank, then receives from the previous one (the peers' reader
  // threads drain every connection, so a send never waits for the peer's receive).
  Status Step(const char* out, int64 out_len, char* in, int64 in_len, const CrossArgs& a) {
    int64 n = out_len;
    TF_RETURN_IF_ERROR(mesh_->Send(Next(), group_, reinterpret_cast<const char*>(&n), 8, a));
    if (out_len) TF_RETURN_IF_ERROR(mesh_->Send(Next(), group_, out, out_len, a));
    int64 got = 0;
    TF_RETURN_IF_ERROR(mesh_->Recv(Prev(), group_, reinterpret_cast<char*>(&got), 8, a));
    if (got != in_len)
      return InvalidArgument("EPL ", a.what, " (group '", a.group, "'): rank ", Prev(),
                             " sent ", got, " bytes where ", in_len, " were expected");
    if (in_len) TF_RETURN_IF_ERROR(mesh_->Recv(Prev(), group_, in, in_len, a));
    return OkStatus();
  }

  Mesh* mesh_;
  uint64_t group_;
  int rank_, size_;
  std::unique_ptr<char[]> buf_;   // the all-reduce's receive buffer
  int64 buf_bytes_ = 0;
};

}  // namespace

Link* TcpLinkFor(const CrossArgs& a, Status* s) {
  static std::mutex mu;
  static auto* links = new std::map<string, std::unique_ptr<TcpLink>>();
  Mesh* mesh = MeshFor(a, s);
  if (mesh == nullptr) return nullptr;
  TcpLink* link;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto& l = (*links)[a.group];
    if (!l) l.reset(new TcpLink(mesh, a.group));
    link = l.get();
  }
  *s = link->Connect(a);   // (on the group's queue: one run at a time)
  return s->ok() ? link : nullptr;
}

}  // namespace epl
