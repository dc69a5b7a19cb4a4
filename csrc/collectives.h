// EPL collectives: shared pieces (reduction kernels, rendezvous, timeouts).
//
// A collective is a group of op instances, one per rank, that share a
// `group` attr.  Within one process the instances meet in a rendezvous keyed
// by (group, generation): the k-th run of every rank's kernel meets the k-th
// run of the others.  The last rank to arrive does the work (in parallel
// chunks on the device's worker threads) and completes every rank.  Kernels
// are asynchronous: no inter-op thread ever waits for a peer.
#ifndef EPL_CSRC_COLLECTIVES_H_
#define EPL_CSRC_COLLECTIVES_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tf_compat.h"

namespace epl {

using tensorflow::AsyncOpKernel;
using tensorflow::DataType;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::int64;
using std::string;

enum class ReduceOp { kSum, kMean, kMax, kMin };
Status ParseReduceOp(const string& name, ReduceOp* op);

// out[i] = reduce(ins[0][i], ..., ins[n-1][i]) for i in [begin, end).
// `out` may alias ins[0].  Mean divides by ins.size().
void ReduceRange(DataType dtype, ReduceOp op, const std::vector<const void*>& ins, void* out,
                 int64 begin, int64 end);

// Runs fn(begin, end) over [0, total) on the context's CPU worker threads.
void ParallelFor(OpKernelContext* ctx, int64 total, int64 cost_per_unit,
                 const std::function<void(int64, int64)>& fn);

// Copies `bytes` from src to dst using several threads for large copies.
void ParallelCopy(OpKernelContext* ctx, void* dst, const void* src, int64 bytes);

// For consecutive pieces, piece i = [start[i], start[i + 1]): calls fn(i, from, to) with
// the part [from, to) (relative to the piece) of every piece that [b, e) overlaps.  How
// one parallel loop over a concatenation reaches its pieces.
void ForEachPiece(const std::vector<int64>& start, int64 b, int64 e,
                  const std::function<void(int i, int64 from, int64 to)>& fn);

// Many copies as one parallel loop over their bytes (small pieces share a thread).
struct CopyJob {
  char* dst;
  const char* src;
  int64 bytes;
};
void ParallelCopies(OpKernelContext* ctx, const std::vector<CopyJob>& jobs);

struct Arrival {
  int rank = 0;
  int64 arrive_us = 0;   // when this rank arrived (only while tracing: see Trace* below)
  OpKernelContext* ctx = nullptr;
  AsyncOpKernel::DoneCallback done;
  std::vector<Tensor> inputs;
};

// Meeting point of the ranks of one collective run within this process.
class InProcessRendezvous {
 public:
  using Complete = std::function<void(std::vector<Arrival>* by_rank)>;
  static InProcessRendezvous* Get();

  // `what` describes the collective (op, dtype, reduction); all ranks must agree.
  void Arrive(const string& key, int size, int timeout_seconds, const string& what,
              Arrival arrival, Complete complete);

 private:
  struct Entry {
    int size = 0;
    int arrived = 0;
    string what;
    std::vector<Arrival> by_rank;
    std::vector<bool> seen;
    std::chrono::steady_clock::time_point deadline;
    int timeout_seconds = 0;
  };
  InProcessRendezvous();
  void Watchdog();
  static void FailAll(Entry* e, const Status& s);

  std::mutex mu_;
  std::map<string, Entry> entries_;
};

// What every EPL collective kernel shares, on CPU or over NCCL: the attrs of one rank
// (group, rank, size, timeout_seconds, T) and the meeting of this run's ranks in this
// process.  Subclasses say what they are (Describe) and what the last rank does.
class RendezvousKernel : public AsyncOpKernel {
 public:
  explicit RendezvousKernel(tensorflow::OpKernelConstruction* c);

 protected:
  virtual string Describe() const = 0;
  // The k-th run of this rank meets the k-th run of every other rank of the group in
  // this process; the last to arrive calls `complete` with (*all)[r] = rank r, and
  // must call every rank's `done`.
  void Meet(OpKernelContext* ctx, DoneCallback done, InProcessRendezvous::Complete complete);

  string group_;
  int rank_ = 0, size_ = 1, timeout_ = 600;
  DataType dtype_;

 private:
  std::atomic<int64> generation_{0};
};

// The reduce_op attr of a reducing collective (sum, mean, max, min).
Status GetReduceOp(tensorflow::OpKernelConstruction* c, string* name, ReduceOp* op);

// A reusable output buffer per collective group: a step's output is handed to
// the ranks and, once every consumer dropped it, reused by the next step
// (saves the page faults of a fresh large allocation every step).
Status AllocateShared(OpKernelContext* ctx, const string& group, DataType dtype,
                      const TensorShape& shape, Tensor* out);

string DescribeMissing(const std::vector<bool>& seen);

// ---- tracing (epl.profile) ----------------------------------------------------------
// While Python turns tracing on (epl_trace_enable, around the runs profile.steps names),
// every collective run appends one record to a bounded in-process buffer: the node, what
// it is, its group, rank, size and bytes, and three times on TensorFlow's clock (the
// step stats' clock, Env::NowMicros): when this rank started, when every peer was there
// (the bytes start moving) and when it ended.  Python drains the buffer after the run
// (epl_trace_take).  Off, a collective pays one relaxed atomic load.
bool TraceOn();
int64 TraceNowMicros();
void TraceAdd(const string& node, const string& what, const string& group,
              const string& transport, int rank, int size, int64 bytes, int64 start_us,
              int64 ready_us, int64 end_us);
// Bytes a rank gives a collective: its inputs of the collective's type.
int64 CollectiveBytes(OpKernelContext* ctx, DataType dtype);

// Rows rank `src` sends each rank in an all-to-all: equal parts when `splits` is empty,
// else the split sizes (checked: one per rank, none negative, adding up to the rows).
Status SendCounts(const Tensor& x, const Tensor& splits, int size, int src,
                  std::vector<int64>* counts);

}  // namespace epl

#endif  // EPL_CSRC_COLLECTIVES_H_
