// Collectives between the processes of one host over POSIX shared memory.
//
// Segment of a group: a header (owner, per-rank progress counters, metadata), then
// two sets (double buffering) of size+1 slots of kChunk bytes: one input slot per
// rank and one result slot.  A collective runs in "rounds"; in a round every rank
// writes one chunk into its slot, waits for the others, then reads (and, for
// all-reduce, reduces its share of the chunk into the result slot).  Round r uses
// set r % 2, so a rank may run one round ahead.
//
// Ownership.  Segments are named from the launch (EPL_RUN_ID, else the job id) and
// the group.  Rank 0 creates a group's segment (exclusively) and signs it with its
// process identity; the other ranks use a segment only while its owner is alive.  A
// segment left by a process that died (a crashed or killed run of the same job) is
// stale: rank 0 replaces it, the others wait for the new one -- a stale segment is
// never used.  The owner unlinks its segments when it exits; epl-launch removes what
// a killed job leaves.
//
// Faults.  A per-job control segment holds every rank's process identity and the
// job's first error.  A rank waiting for peers fails at once when the job was
// aborted, or when a peer it waits for has exited, naming that rank.
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "crossproc.h"
#include "tensorflow/core/lib/core/errors.h"
#include "tensorflow/core/lib/strings/strcat.h"

namespace epl {

using tensorflow::errors::Aborted;
using tensorflow::errors::DeadlineExceeded;
using tensorflow::errors::Internal;
using tensorflow::errors::InvalidArgument;
using tensorflow::strings::StrCat;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kMaxRanks = 64;
constexpr int kMeta = kMaxRanks + 2;
constexpr int64 kChunk = 256 << 10;  // small enough that a round stays in cache
constexpr int64 kMagic = 0x45504c53484d3032;  // "EPLSHM02"

struct Owner {
  std::atomic<int64> magic;   // kMagic once the owner filled the rest
  int64 pid;
  int64 start;
};

// A rank's progress counter.  Waiters spin on it briefly, then sleep on a futex on
// its low 32 bits (shared between processes); `sleepers` tells the writer whether a
// wake-up system call is needed at all.
struct alignas(64) Counter {
  std::atomic<int64> v;
  std::atomic<int32_t> sleepers;
};

static_assert(sizeof(std::atomic<int64>) == 8, "lock-free 64-bit counters");

long Futex(void* addr, int op, uint32_t val, const struct timespec* timeout) {
  return syscall(SYS_futex, addr, op, val, timeout, nullptr, 0);
}

// The futex word of a counter: its low half (x86-64 and aarch64 are little-endian).
void* FutexWord(Counter* c) { return reinterpret_cast<void*>(&c->v); }

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How long a waiter spins before it sleeps: long enough to cover a peer that is a
// round behind (tens of microseconds), short enough not to starve the compute
// threads of its own process on a small machine.
constexpr int64 kSpinNanos = 60 * 1000;

struct Header {
  Owner owner;
  Counter written[kMaxRanks];
  Counter reduced[kMaxRanks];
  Counter done[kMaxRanks];
  Counter meta_ready[kMaxRanks];
  Counter meta_read[kMaxRanks];
  int64 meta[2][kMaxRanks][kMeta];  // double-buffered by run parity
};

struct JobControl {
  Owner owner;
  std::atomic<int64> claim;     // the first rank to report an error writes the message
  std::atomic<int64> aborted;   // 1 once the message is written
  std::atomic<int64> code;
  char message[2048];
  struct {
    std::atomic<int64> pid;
    std::atomic<int64> start;
  } ranks[kMaxRanks];
};

int64 PageRound(int64 n) { return ((n + 4095) / 4096) * 4096; }

const int64 kHeaderBytes = PageRound(sizeof(Header));

// ---- names and cleanup ------------------------------------------------------------------

string SegmentName(const string& job, const string& what) {
  char buf[32];
  snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(Fnv1a(what)));
  return StrCat("/epl-", RunTag(job), "-", buf);
}

std::mutex& OwnedMu() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}

std::vector<string>* Owned() {
  static auto* names = new std::vector<string>();
  return names;
}

void UnlinkOwned() {
  std::lock_guard<std::mutex> lock(OwnedMu());
  for (const auto& n : *Owned()) shm_unlink(n.c_str());
  Owned()->clear();
}

void RememberOwned(const string& name) {
  std::lock_guard<std::mutex> lock(OwnedMu());
  if (Owned()->empty()) {
    static bool registered = false;
    if (!registered) {
      registered = true;
      std::atexit(UnlinkOwned);
    }
  }
  Owned()->push_back(name);
}

// ---- the owner protocol -------------------------------------------------------------------

Status MapOwned(const string& name, int64 bytes, bool creator, const CrossArgs& a,
                const char* purpose, char** base) {
  const auto deadline = Clock::now() + std::chrono::seconds(a.timeout_seconds);
  while (true) {
    if (creator) {
      int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd >= 0) {
        if (ftruncate(fd, bytes) != 0) {
          close(fd);
          shm_unlink(name.c_str());
          return Internal("EPL shm: ftruncate(", name, ", ", bytes, ") failed: ",
                          strerror(errno), " (is /dev/shm large enough?)");
        }
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (p == MAP_FAILED) return Internal("EPL shm: mmap(", name, ") failed: ", strerror(errno));
        RememberOwned(name);
        Owner* o = reinterpret_cast<Owner*>(p);
        const ProcessId me = Self();
        o->pid = me.pid;
        o->start = me.start;
        o->magic.store(kMagic, std::memory_order_release);
        *base = static_cast<char*>(p);
        return OkStatus();
      }
      if (errno != EEXIST)
        return Internal("EPL shm: shm_open(", name, ") failed: ", strerror(errno));
    }
    int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd >= 0) {
      struct stat st;
      bool usable = false, stale = false;
      ProcessId owner;
      if (fstat(fd, &st) == 0 && st.st_size >= static_cast<off_t>(sizeof(Owner))) {
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) {
          Owner* o = reinterpret_cast<Owner*>(p);
          if (o->magic.load(std::memory_order_acquire) == kMagic) {
            owner.pid = o->pid;
            owner.start = o->start;
            const bool alive = Alive(owner);
            if (alive && st.st_size >= bytes) {
              usable = true;
              *base = static_cast<char*>(p);
            } else if (!alive) {
              stale = true;
            }
          } else if (creator) {
            stale = true;   // never signed: its creator died while creating it
          }
          if (!usable) munmap(p, bytes);
        }
      } else if (creator) {
        stale = true;   // (a creator that died before it signed the segment)
      }
      close(fd);
      if (usable) {
        if (creator)
          return Internal("EPL shm: '", name, "' (", purpose, " of group '", a.group,
                          "') belongs to another live process (pid ", owner.pid, "): two "
                          "jobs with the same job id run on this host; give each its own "
                          "EPL_JOB_ID (epl-launch does).");
        return OkStatus();
      }
      if (stale && creator) {
        shm_unlink(name.c_str());   // left by a dead run: never trusted, replaced
        continue;
      }
    } else if (errno != ENOENT) {
      return Internal("EPL shm: shm_open(", name, ") failed: ", strerror(errno));
    }
    if (Clock::now() > deadline)
      return DeadlineExceeded("EPL ", a.what, " (group '", a.group, "'): rank 0 did not set up ",
                              "its shared memory (", purpose, ") within ", a.timeout_seconds,
                              " s (communication.timeout_seconds): it has not reached this "
                              "collective, or died.");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

// ---- the job's control segment ----------------------------------------------------------

class ShmJob {
 public:
  static ShmJob* Get(const CrossArgs& a, Status* s) {
    static std::mutex mu;
    static auto* jobs = new std::map<string, std::unique_ptr<ShmJob>>();
    const string job = JobOf(a.group);
    std::lock_guard<std::mutex> lock(mu);
    auto& j = (*jobs)[job];
    if (!j) {
      std::unique_ptr<ShmJob> fresh(new ShmJob(job));
      *s = fresh->Attach(a);
      if (!s->ok()) return nullptr;
      j = std::move(fresh);
    }
    return j.get();
  }

  // The job's first error, if a rank reported one.
  Status Aborted() const {
    const int64 who = ctl_->aborted.load(std::memory_order_acquire);
    if (who == 0) return OkStatus();
    return MakeStatus(static_cast<int>(ctl_->code.load()), ctl_->message);
  }

  // False when rank k's process has exited (unknown ranks count as alive).
  bool RankAlive(int k, int64* pid) const {
    ProcessId p;
    p.pid = ctl_->ranks[k].pid.load(std::memory_order_acquire);
    p.start = ctl_->ranks[k].start.load(std::memory_order_acquire);
    *pid = p.pid;
    return p.pid == 0 || Alive(p);
  }

 private:
  explicit ShmJob(const string& job) : job_(job) {}

  Status Attach(const CrossArgs& a) {
    char* base = nullptr;
    TF_RETURN_IF_ERROR(MapOwned(SegmentName(job_, job_ + "#control"),
                                PageRound(sizeof(JobControl)), a.rank == 0, a,
                                "the job's control segment", &base));
    ctl_ = reinterpret_cast<JobControl*>(base);
    const ProcessId me = Self();
    ctl_->ranks[a.rank].start.store(me.start, std::memory_order_release);
    ctl_->ranks[a.rank].pid.store(me.pid, std::memory_order_release);
    JobControl* ctl = ctl_;
    JobState::Get(job_)->AddPropagator([ctl](const Status& s) {
      int64 unclaimed = 0;
      if (!ctl->claim.compare_exchange_strong(unclaimed, 1)) return;   // (another rank's)
      const string msg = StatusMessage(s);
      const size_t n = std::min(msg.size(), sizeof(ctl->message) - 1);
      std::memcpy(ctl->message, msg.data(), n);
      ctl->message[n] = 0;
      ctl->code.store(static_cast<int64>(s.code()));
      ctl->aborted.store(1, std::memory_order_release);
    });
    return OkStatus();
  }

  string job_;
  JobControl* ctl_ = nullptr;
};

// ---- a group's link -------------------------------------------------------------------

class ShmLink : public Link {
 public:
  ShmLink(const string& name, int size, int rank) : name_(name), size_(size), rank_(rank) {}

  Status Attach(const CrossArgs& a) {
    if (base_) return OkStatus();
    if (size_ > kMaxRanks)
      return InvalidArgument("EPL shm transport supports at most ", kMaxRanks, " ranks");
    Status s;
    job_ = ShmJob::Get(a, &s);
    TF_RETURN_IF_ERROR(s);
    bytes_ = kHeaderBytes + 2 * (size_ + 1) * kChunk;
    TF_RETURN_IF_ERROR(MapOwned(SegmentName(JobOf(name_), name_), bytes_, rank_ == 0, a,
                                "the group's segment", &base_));
    hdr_ = reinterpret_cast<Header*>(base_);
    return OkStatus();
  }

  int size() const { return size_; }
  int rank() const { return rank_; }

  Status ExchangeMeta(const CrossArgs& a, const std::vector<int64>& mine,
                      std::vector<std::vector<int64>>* all) override {
    const int64 g = meta_runs_++, par = g % 2;
    if (g >= 1) TF_RETURN_IF_ERROR(WaitAll(hdr_->meta_read, g, "metadata", a));
    int64* slot = hdr_->meta[par][rank_];
    slot[0] = static_cast<int64>(Fnv1a(a.what));
    slot[1] = static_cast<int64>(mine.size());
    for (size_t i = 0; i < mine.size() && i < kMaxRanks; ++i) slot[2 + i] = mine[i];
    Set(hdr_->meta_ready, g + 1);
    TF_RETURN_IF_ERROR(WaitAll(hdr_->meta_ready, g + 1, "metadata", a));
    all->assign(size_, {});
    Status s;
    for (int k = 0; k < size_; ++k) {
      const int64* m = hdr_->meta[par][k];
      if (m[0] != slot[0])
        s = InvalidArgument("EPL ", a.what, " (group '", a.group, "'): rank ", k,
                            " runs a different collective; every process must build the "
                            "same collectives in the same order.");
      (*all)[k].assign(m + 2, m + 2 + m[1]);
    }
    Set(hdr_->meta_read, g + 1);
    return s;
  }

  Status AllReduce(const CrossArgs& a, DataType dtype, ReduceOp op, const char* in, char* out,
                   int64 count) override {
    return AllReduceSpans(a, dtype, op, {Span{in, out, count * tensorflow::DataTypeSize(dtype)}});
  }

  // Rounds of kChunk bytes of the concatenated spans: every rank copies its chunk into
  // its slot, reduces its share of the chunk from every slot into the result slot,
  // then copies the whole result out.  The tensors are read and written in place.
  Status AllReduceSpans(const CrossArgs& a, DataType dtype, ReduceOp op,
                        const std::vector<Span>& spans) override {
    const int64 es = tensorflow::DataTypeSize(dtype);
    int64 total = 0;
    for (const Span& sp : spans) total += sp.bytes;
    SpanCursor gather(spans), scatter(spans, total >= kStreamBytes);
    for (int64 begin = 0; begin < total; begin += kChunk) {
      const int64 len = std::min(kChunk, total - begin), n = len / es;
      const int64 r = round_++;
      if (r >= 2) TF_RETURN_IF_ERROR(WaitAll(hdr_->done, r - 1, "slot reuse", a));
      gather.Read(begin, len, Slot(r, rank_));
      Set(hdr_->written, r + 1);
      TF_RETURN_IF_ERROR(WaitAll(hdr_->written, r + 1, "inputs", a));
      const int64 share = (n + size_ - 1) / size_;
      const int64 lo = std::min(n, rank_ * share), hi = std::min(n, lo + share);
      std::vector<const void*> ins;
      for (int k = 0; k < size_; ++k) ins.push_back(Slot(r, k) + lo * es);
      char* result = Slot(r, size_);
      ReduceRange(dtype, op, ins, result + lo * es, 0, hi - lo);
      Set(hdr_->reduced, r + 1);
      TF_RETURN_IF_ERROR(WaitAll(hdr_->reduced, r + 1, "reduction", a));
      scatter.Write(begin, len, result);
      Set(hdr_->done, r + 1);
    }
    StreamFence();
    return OkStatus();
  }

  // Each rank's slot is cut into one part per destination; in a round every rank
  // copies the next piece of what it sends rank j into part j, and every rank then
  // consumes the parts addressed to it.  pieces[k][j]: bytes rank k sends rank j.
  // `consume(off, from)` sees, per source k != rank, a pointer to its bytes
  // [off, off + len_k) (null where rank k has nothing left for this rank).
  Status Pairwise(const CrossArgs& a, const std::vector<const char*>& send,
                  const std::vector<std::vector<int64>>& pieces,
                  const std::function<void(int64 off, int64 part,
                                           const std::vector<const char*>& from)>& consume) {
    const int64 part = (kChunk / size_) & ~int64{63};
    int64 longest = 0;
    for (int k = 0; k < size_; ++k)
      for (int j = 0; j < size_; ++j)
        if (j != k) longest = std::max(longest, pieces[k][j]);
    std::vector<const char*> from(size_);
    for (int64 off = 0; off < longest; off += part) {
      const int64 r = round_++;
      if (r >= 2) TF_RETURN_IF_ERROR(WaitAll(hdr_->done, r - 1, "slot reuse", a));
      for (int j = 0; j < size_; ++j) {
        const int64 n = std::min(part, pieces[rank_][j] - off);
        if (j != rank_ && n > 0) std::memcpy(Slot(r, rank_) + j * part, send[j] + off, n);
      }
      Set(hdr_->written, r + 1);
      TF_RETURN_IF_ERROR(WaitAll(hdr_->written, r + 1, "exchange", a));
      for (int k = 0; k < size_; ++k)
        from[k] = (k != rank_ && pieces[k][rank_] > off) ? Slot(r, k) + rank_ * part : nullptr;
      consume(off, part, from);
      Set(hdr_->reduced, r + 1);  // keep the counters in step with AllReduce rounds
      Set(hdr_->done, r + 1);
    }
    return OkStatus();
  }

  Status AllToAll(const CrossArgs& a, const std::vector<const char*>& send,
                  const std::vector<char*>& recv,
                  const std::vector<std::vector<int64>>& bytes) override {
    int64 total = 0;
    for (int k = 0; k < size_; ++k) total += bytes[k][rank_];
    const bool stream = total >= kStreamBytes;
    auto copy = [stream](char* d, const char* s, int64 n) {
      if (stream) StreamCopy(d, s, n);
      else std::memcpy(d, s, n);
    };
    if (bytes[rank_][rank_]) copy(recv[rank_], send[rank_], bytes[rank_][rank_]);
    Status s = Pairwise(a, send, bytes, [&](int64 off, int64 part,
                                            const std::vector<const char*>& from) {
      for (int k = 0; k < size_; ++k)
        if (from[k]) copy(recv[k] + off, from[k], std::min(part, bytes[k][rank_] - off));
    });
    StreamFence();
    return s;
  }

  Status ReduceScatter(const CrossArgs& a, DataType dtype, ReduceOp op, const char* in,
                       char* out, const std::vector<int64>& block) override {
    const int64 es = tensorflow::DataTypeSize(dtype);
    std::vector<const char*> send(size_);
    std::vector<std::vector<int64>> pieces(size_, std::vector<int64>(size_, 0));
    int64 off = 0, mine = 0;
    for (int j = 0; j < size_; ++j) {
      send[j] = in + off;
      if (j == rank_) mine = off;
      off += block[j];
      for (int k = 0; k < size_; ++k) pieces[k][j] = block[j];
    }
    const int64 own = block[rank_];
    if (own == 0 || size_ == 1) {
      if (own) std::memcpy(out, in + mine, own);
      return Pairwise(a, send, pieces, [](int64, int64, const std::vector<const char*>&) {});
    }
    return Pairwise(a, send, pieces, [&](int64 o, int64 part,
                                         const std::vector<const char*>& from) {
      if (o >= own) return;   // (longer blocks of other ranks)
      std::vector<const void*> ins = {in + mine + o};
      for (int k = 0; k < size_; ++k)
        if (from[k]) ins.push_back(from[k]);
      ReduceRange(dtype, op, ins, out + o, 0, std::min(part, own - o) / es);
    });
  }

  Status Exchange(const CrossArgs& a, const char* mine, const std::vector<int64>& lens,
                  const Consumer& consume) override {
    int64 longest = 0;
    for (int64 l : lens) longest = std::max(longest, l);
    for (int64 off = 0; off < longest; off += kChunk) {
      const int64 r = round_++;
      if (r >= 2) TF_RETURN_IF_ERROR(WaitAll(hdr_->done, r - 1, "slot reuse", a));
      const int64 my = std::max<int64>(0, std::min(kChunk, lens[rank_] - off));
      if (my > 0) std::memcpy(Slot(r, rank_), mine + off, my);
      Set(hdr_->written, r + 1);
      TF_RETURN_IF_ERROR(WaitAll(hdr_->written, r + 1, "exchange", a));
      for (int k = 0; k < size_; ++k) {
        const int64 len = std::max<int64>(0, std::min(kChunk, lens[k] - off));
        if (len > 0) consume(k, off, Slot(r, k), len);
      }
      Set(hdr_->reduced, r + 1);  // keep the counters in step with AllReduce rounds
      Set(hdr_->done, r + 1);
    }
    return OkStatus();
  }

 private:
  char* Slot(int64 round, int k) const {
    return base_ + kHeaderBytes + ((round % 2) * (size_ + 1) + k) * kChunk;
  }

  // Publishes this rank's progress and wakes peers that sleep on it.  (Both sides
  // use sequentially consistent operations on `v` and `sleepers`, so either the writer
  // sees the sleeper or the sleeper sees the new value: no lost wake-up.)
  void Set(Counter* c, int64 v) {
    Counter* mine = &c[rank_];
    mine->v.store(v, std::memory_order_seq_cst);
    if (mine->sleepers.load(std::memory_order_seq_cst) > 0)
      Futex(FutexWord(mine), FUTEX_WAKE, INT32_MAX, nullptr);
  }

  // Waits until every rank's counter reaches `target`: spins for up to kSpinNanos
  // (a peer on another core answers within microseconds), then sleeps on the
  // counter's futex in 20 ms slices; between slices it fails at once when the job was
  // aborted or the rank it waits for has exited, and after the timeout.
  Status WaitAll(Counter* c, int64 target, const char* phase, const CrossArgs& a) {
    Clock::time_point deadline{};
    bool timed = false;
    for (int k = 0; k < size_; ++k) {
      if (c[k].v.load(std::memory_order_acquire) >= target) continue;
      const auto spin_until = Clock::now() + std::chrono::nanoseconds(kSpinNanos);
      bool reached = false;
      for (int i = 1; !reached; ++i) {
        CpuRelax();
        reached = c[k].v.load(std::memory_order_acquire) >= target;
        if ((i & 63) == 0 && Clock::now() > spin_until) break;
      }
      while (!reached) {
        if (!timed) {
          deadline = Clock::now() + std::chrono::seconds(a.timeout_seconds);
          timed = true;
        }
        TF_RETURN_IF_ERROR(job_->Aborted());
        int64 pid = 0;
        if (!job_->RankAlive(k, &pid))
          return Aborted("EPL ", a.what, " (group '", a.group, "', ", phase, "): rank ", k,
                         " (pid ", pid, ") exited while rank ", rank_, " waited for it: a "
                         "worker died or left the job before its collectives were done.");
        if (Clock::now() > deadline) {
          std::vector<bool> seen(size_);
          for (int j = 0; j < size_; ++j) seen[j] = c[j].v.load() >= target;
          return DeadlineExceeded("EPL ", a.what, " (group '", a.group, "', ", phase,
                                  "): rank(s) ", DescribeMissing(seen), " of ", size_,
                                  " (other processes) did not arrive within ", a.timeout_seconds,
                                  " s (communication.timeout_seconds): a worker ran a different "
                                  "step, or is stuck.");
        }
        c[k].sleepers.fetch_add(1, std::memory_order_seq_cst);
        const int64 seen = c[k].v.load(std::memory_order_seq_cst);
        if (seen < target) {
          struct timespec slice = {0, 20 * 1000 * 1000};
          Futex(FutexWord(&c[k]), FUTEX_WAIT, static_cast<uint32_t>(seen), &slice);
        }
        c[k].sleepers.fetch_sub(1, std::memory_order_seq_cst);
        reached = c[k].v.load(std::memory_order_acquire) >= target;
      }
    }
    return OkStatus();
  }

  string name_;
  int size_, rank_;
  ShmJob* job_ = nullptr;
  char* base_ = nullptr;
  Header* hdr_ = nullptr;
  int64 bytes_ = 0;
  int64 round_ = 0;
  int64 meta_runs_ = 0;
};

}  // namespace

Link* ShmLinkFor(const CrossArgs& a, Status* s) {
  static std::mutex mu;
  static auto* links = new std::map<string, std::unique_ptr<ShmLink>>();
  ShmLink* link;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto& l = (*links)[a.group];
    if (!l) l.reset(new ShmLink(a.group, a.size, a.rank));
    link = l.get();
  }
  if (link->size() != a.size || link->rank() != a.rank) {
    *s = InvalidArgument("EPL shm group '", a.group, "' used with rank ", a.rank, "/", a.size,
                         " and ", link->rank(), "/", link->size(), " in one process");
    return nullptr;
  }
  *s = link->Attach(a);   // (on the group's queue: one run at a time)
  return s->ok() ? link : nullptr;
}

}  // namespace epl
