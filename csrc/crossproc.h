// Collectives between processes: the transport-independent layer.
//
// A collective group whose ranks are processes (one rank per process: the
// workers of a job) runs over a Link, the group's connection to its peers in
// this process.  Two transports implement Link: shared memory between the
// processes of one host (shm.cc) and TCP between hosts (tcp.cc).  The op bodies
// (all-reduce, all-gather, ...) are written once, here, over the Link.
//
// Every run of a group is queued on the group's SerialQueue, so a group's runs
// happen in the order this process issues them (its k-th run meets the peers'
// k-th run, whatever session or kernel issues it), while different groups run
// concurrently.  A queue holds a thread only while it has work.
//
// The first error of any rank of a job (a failed collective, a peer that died or
// left) aborts the job: every pending and later collective of the job, on every
// rank, fails at once with that first error.  A job is the prefix of a group's
// name up to its first '/' (EPL names groups "<job id>/...").
#ifndef EPL_CSRC_CROSSPROC_H_
#define EPL_CSRC_CROSSPROC_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "collectives.h"

namespace epl {

struct CrossArgs {
  std::string group;     // identical on every rank (starts with the job id)
  int rank = 0;
  int size = 1;
  int timeout_seconds = 600;
  std::string what;      // describes the collective; must agree across ranks
};

// One tensor of a fused all-reduce: `bytes` from `in`, the result to `out` (may be in).
struct Span {
  const char* in;
  char* out;
  int64 bytes;
};

// Copies n bytes with non-temporal stores where the CPU has them (AVX2): for results
// too large to stay in cache, this skips reading the destination into the cache before
// writing it (a third of a copy's memory traffic).  Call StreamFence() before the
// result is handed on.
void StreamCopy(char* dst, const char* src, int64 n);
void StreamFence();
// Outputs at least this large are written with StreamCopy.
constexpr int64 kStreamBytes = 8 << 20;

// Reads and writes byte ranges of the concatenation of spans, front to back.
class SpanCursor {
 public:
  explicit SpanCursor(const std::vector<Span>& spans, bool stream = false)
      : spans_(spans), stream_(stream) {}
  // Copies [off, off + len) of the inputs to dst / src to the outputs.
  void Read(int64 off, int64 len, char* dst) { Walk(off, len, dst, nullptr); }
  void Write(int64 off, int64 len, const char* src) { Walk(off, len, nullptr, src); }

 private:
  // Moves to the span that holds byte `off`; returns the offset within it.
  int64 Seek(int64 off);
  void Walk(int64 off, int64 len, char* dst, const char* src);
  const std::vector<Span>& spans_;
  bool stream_;        // Write with StreamCopy
  size_t i_ = 0;       // the span that holds the last position used
  int64 start_ = 0;    // its first byte in the concatenation
};

// rank k's bytes [offset, offset + len) as they arrive.
using Consumer = std::function<void(int k, int64 offset, const char* data, int64 len)>;

class Link {
 public:
  virtual ~Link() {}
  // Every rank's int64 metadata, after checking that every rank runs `a.what`.
  virtual Status ExchangeMeta(const CrossArgs& a, const std::vector<int64>& mine,
                              std::vector<std::vector<int64>>* all) = 0;
  // out = reduction over the ranks of every rank's `in` (count elements; out may be in).
  virtual Status AllReduce(const CrossArgs& a, DataType dtype, ReduceOp op, const char* in,
                           char* out, int64 count) = 0;
  // Every rank contributes lens[rank] bytes from `mine`; `consume` sees every rank's bytes.
  virtual Status Exchange(const CrossArgs& a, const char* mine, const std::vector<int64>& lens,
                          const Consumer& consume) = 0;
  // All-reduce of the concatenation of the spans (every rank has the same byte counts).
  // The default packs them into one buffer; a transport that can read and write the
  // tensors in place overrides it.
  virtual Status AllReduceSpans(const CrossArgs& a, DataType dtype, ReduceOp op,
                                const std::vector<Span>& spans);
  // bytes[k][j] (known to every rank) is what rank k sends to rank j: this rank's
  // send[j] goes to rank j, and what rank k sends this rank lands in recv[k].  The
  // default sends every rank everything through Exchange; a transport with per-pair
  // buffers overrides it.
  // This rank's block of the reduction: every rank's `in` is cut into blocks of
  // block[j] bytes; rank j gets the reduction of block j.  The default all-reduces
  // the whole tensor.
  virtual Status ReduceScatter(const CrossArgs& a, DataType dtype, ReduceOp op, const char* in,
                               char* out, const std::vector<int64>& block);
  virtual Status AllToAll(const CrossArgs& a, const std::vector<const char*>& send,
                          const std::vector<char*>& recv,
                          const std::vector<std::vector<int64>>& bytes);
};

// The job of a group ("<job>/..." -> "<job>").
std::string JobOf(const std::string& group);

// Process-wide state of one job: the first error, once any rank hit one.
class JobState {
 public:
  static JobState* Get(const std::string& job);
  // OK, or the error that aborted the job.
  Status Aborted();
  // Record the job's first error, found by this process's rank `rank` (later ones are
  // dropped), and tell the peers through every registered propagator.  Returns the
  // error the job now has.
  Status Abort(const Status& why, int rank);
  // A transport's way to tell the peers (called once per abort, outside locks).
  void AddPropagator(std::function<void(const Status&)> tell);
  // Adopt the error a peer reported and pass it on unchanged (if the job had none).
  void Forward(const Status& why);

 private:
  std::mutex mu_;
  Status status_;
  std::vector<std::function<void(const Status&)>> tell_;
};

// Runs tasks in the order they were scheduled, on a thread that exists only while
// there is work (or was, within the last two seconds).
class SerialQueue {
 public:
  void Schedule(std::function<void()> task);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool running_ = false;
};

// Process identity that survives pid reuse: (pid, start time in clock ticks).
struct ProcessId {
  int64 pid = 0;
  int64 start = 0;
};
ProcessId Self();
// False when the process has exited (also when it is a zombie or its pid was reused).
bool Alive(const ProcessId& p);

// Link of the group for the transport ("shm" or "tcp"); errors name the group.
Link* ShmLinkFor(const CrossArgs& a, Status* s);
Link* TcpLinkFor(const CrossArgs& a, Status* s);

// Runs `body` for one run of the group on its queue, then calls done.  An error
// aborts the job; an aborted job fails at once.
void RunCross(const std::string& transport, const CrossArgs& a, OpKernelContext* ctx,
              AsyncOpKernel::DoneCallback done, std::function<Status(Link*)> body);

// The op bodies, over a Link.
Status CrossAllReduce(Link* l, const CrossArgs& a, ReduceOp op, OpKernelContext* ctx);
Status CrossAllReduceN(Link* l, const CrossArgs& a, ReduceOp op, OpKernelContext* ctx);
Status CrossAllGather(Link* l, const CrossArgs& a, OpKernelContext* ctx);
Status CrossReduceScatter(Link* l, const CrossArgs& a, ReduceOp op, OpKernelContext* ctx);
Status CrossBroadcast(Link* l, const CrossArgs& a, int root, OpKernelContext* ctx);
Status CrossReduce(Link* l, const CrossArgs& a, int root, ReduceOp op, OpKernelContext* ctx);
Status CrossAllToAll(Link* l, const CrossArgs& a, OpKernelContext* ctx);

// A 64-bit FNV-1a hash (stable across processes and builds).
uint64_t Fnv1a(const std::string& s);

// Where segments and logs of this launch are named from: EPL_RUN_ID (set by epl-launch,
// unique per launch), else a hash of the job id.
std::string RunTag(const std::string& job);

}  // namespace epl

#endif  // EPL_CSRC_CROSSPROC_H_
