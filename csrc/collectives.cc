// Shared pieces of EPL's collectives: reductions, parallel loops, rendezvous.
#include "collectives.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <thread>

#include "tensorflow/core/common_runtime/dma_helper.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/lib/core/errors.h"
#include "tensorflow/core/lib/strings/strcat.h"
#include "tensorflow/core/platform/env.h"
#include "tensorflow/core/util/work_sharder.h"

namespace epl {

using tensorflow::errors::InvalidArgument;
using tensorflow::strings::StrCat;

Status ParseReduceOp(const string& name, ReduceOp* op) {
  if (name == "sum") *op = ReduceOp::kSum;
  else if (name == "mean") *op = ReduceOp::kMean;
  else if (name == "max") *op = ReduceOp::kMax;
  else if (name == "min") *op = ReduceOp::kMin;
  else return InvalidArgument("reduce_op must be sum, mean, max or min; got '", name, "'");
  return OkStatus();
}

Status GetReduceOp(tensorflow::OpKernelConstruction* c, string* name, ReduceOp* op) {
  TF_RETURN_IF_ERROR(c->GetAttr("reduce_op", name));
  return ParseReduceOp(*name, op);
}

RendezvousKernel::RendezvousKernel(tensorflow::OpKernelConstruction* c) : AsyncOpKernel(c) {
  OP_REQUIRES_OK(c, c->GetAttr("group", &group_));
  OP_REQUIRES_OK(c, c->GetAttr("rank", &rank_));
  OP_REQUIRES_OK(c, c->GetAttr("size", &size_));
  OP_REQUIRES_OK(c, c->GetAttr("timeout_seconds", &timeout_));
  OP_REQUIRES_OK(c, c->GetAttr("T", &dtype_));
  OP_REQUIRES(c, rank_ < size_,
              InvalidArgument("EPL collective '", group_, "': rank ", rank_,
                              " is not below size ", size_));
}

void RendezvousKernel::Meet(OpKernelContext* ctx, DoneCallback done,
                            InProcessRendezvous::Complete complete) {
  const int64 gen = generation_.fetch_add(1);
  Arrival a;
  a.rank = rank_;
  a.ctx = ctx;
  a.done = std::move(done);
  for (int i = 0; i < ctx->num_inputs(); ++i) a.inputs.push_back(ctx->input(i));
  if (TraceOn()) {
    // The last rank completes every rank: its arrival is when the bytes start moving.
    a.arrive_us = TraceNowMicros();
    const string what = Describe(), group = group_;
    const DataType dtype = dtype_;
    complete = [complete, what, group, dtype](std::vector<Arrival>* all) {
      const int64 ready = TraceNowMicros();
      const int size = static_cast<int>(all->size());
      for (auto& r : *all) {
        // Each rank's record is added before its done(): the run cannot end before it
        // (and done() ends the rank's context, so what it says is read now).
        const string node = r.ctx->op_kernel().name();
        const int64 start = r.arrive_us ? r.arrive_us : ready;
        const int64 bytes = CollectiveBytes(r.ctx, dtype);
        const int rank = r.rank;
        AsyncOpKernel::DoneCallback done = std::move(r.done);
        r.done = [done, node, what, group, rank, size, bytes, start, ready]() {
          TraceAdd(node, what, group, "inprocess", rank, size, bytes, start, ready,
                   TraceNowMicros());
          done();
        };
      }
      complete(all);
    };
  }
  InProcessRendezvous::Get()->Arrive(StrCat(group_, "#", gen), size_, timeout_, Describe(),
                                     std::move(a), std::move(complete));
}

namespace portable {

#include "reduce_kernels.h"   // (namespace portable: the build's target)
}  // namespace portable

#if defined(__x86_64__) && defined(__GNUC__)
#define EPL_REDUCE_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2")
namespace avx2 {
#include "reduce_kernels.h"   // (the same kernels for CPUs with AVX2)
}  // namespace avx2
#pragma GCC pop_options
#endif

void ReduceRange(DataType dtype, ReduceOp op, const std::vector<const void*>& ins, void* out,
                 int64 begin, int64 end) {
#ifdef EPL_REDUCE_AVX2
  static const bool has_avx2 = __builtin_cpu_supports("avx2");
  if (has_avx2) return avx2::ReduceRangeImpl(dtype, op, ins, out, begin, end);
#endif
  portable::ReduceRangeImpl(dtype, op, ins, out, begin, end);
}

void ParallelFor(OpKernelContext* ctx, int64 total, int64 cost_per_unit,
                 const std::function<void(int64, int64)>& fn) {
  if (total <= 0) return;
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  tensorflow::Shard(workers->NumThreads(), workers, total, cost_per_unit, fn);
}

void ParallelCopy(OpKernelContext* ctx, void* dst, const void* src, int64 bytes) {
  if (bytes <= 0 || dst == src) return;
  const int64 kChunk = 1 << 20;
  const int64 chunks = (bytes + kChunk - 1) / kChunk;
  ParallelFor(ctx, chunks, 1 << 20, [&](int64 b, int64 e) {
    const int64 lo = b * kChunk, hi = std::min(bytes, e * kChunk);
    std::memcpy(static_cast<char*>(dst) + lo, static_cast<const char*>(src) + lo, hi - lo);
  });
}

void ForEachPiece(const std::vector<int64>& start, int64 b, int64 e,
                  const std::function<void(int, int64, int64)>& fn) {
  int i = static_cast<int>(std::upper_bound(start.begin(), start.end(), b) - start.begin()) - 1;
  for (int64 pos = b; pos < e; ++i) {
    const int64 hi = std::min(e, start[i + 1]);
    if (hi > pos) fn(i, pos - start[i], hi - start[i]);
    pos = std::max(pos, hi);
  }
}

void ParallelCopies(OpKernelContext* ctx, const std::vector<CopyJob>& jobs) {
  std::vector<int64> start(jobs.size() + 1, 0);
  for (size_t i = 0; i < jobs.size(); ++i) start[i + 1] = start[i] + jobs[i].bytes;
  const int64 kUnit = 256 << 10;
  const int64 units = (start.back() + kUnit - 1) / kUnit;
  ParallelFor(ctx, units, kUnit, [&](int64 b, int64 e) {
    ForEachPiece(start, b * kUnit, std::min(start.back(), e * kUnit),
                 [&](int i, int64 from, int64 to) {
                   std::memcpy(jobs[i].dst + from, jobs[i].src + from, to - from);
                 });
  });
}

Status SendCounts(const Tensor& x, const Tensor& splits, int size, int src,
                  std::vector<int64>* counts) {
  const int64 rows = x.dims() ? x.dim_size(0) : 0;
  counts->assign(size, 0);
  if (splits.NumElements() == 0) {
    if (rows % size)
      return InvalidArgument("EPL all_to_all: rank ", src, " has ", rows,
                             " rows, which do not split evenly over ", size,
                             " ranks; pass explicit split sizes.");
    for (int r = 0; r < size; ++r) (*counts)[r] = rows / size;
    return OkStatus();
  }
  if (splits.NumElements() != size)
    return InvalidArgument("EPL all_to_all: rank ", src, " gave ", splits.NumElements(),
                           " split sizes for ", size, " ranks.");
  int64 total = 0;
  for (int r = 0; r < size; ++r) {
    (*counts)[r] = splits.vec<int64>()(r);
    if ((*counts)[r] < 0) return InvalidArgument("EPL all_to_all: negative split size");
    total += (*counts)[r];
  }
  if (total != rows)
    return InvalidArgument("EPL all_to_all: rank ", src, "'s split sizes add up to ", total,
                           " but its input has ", rows, " rows.");
  return OkStatus();
}

string DescribeMissing(const std::vector<bool>& seen) {
  string s;
  for (size_t r = 0; r < seen.size(); ++r) {
    if (seen[r]) continue;
    if (!s.empty()) s += ", ";
    s += std::to_string(r);
  }
  return s;
}

namespace {

std::atomic<bool> trace_on{false};
std::mutex trace_mu;
std::deque<string>* trace_lines = new std::deque<string>();
const size_t kTraceCapacity = 1 << 16;   // records; the oldest go first

}  // namespace

bool TraceOn() { return trace_on.load(std::memory_order_relaxed); }

int64 TraceNowMicros() { return tensorflow::Env::Default()->NowMicros(); }

int64 CollectiveBytes(OpKernelContext* ctx, DataType dtype) {
  int64 bytes = 0;
  for (int i = 0; i < ctx->num_inputs(); ++i)
    if (ctx->input_dtype(i) == dtype) bytes += ctx->input(i).TotalBytes();
  return bytes;
}

void TraceAdd(const string& node, const string& what, const string& group,
              const string& transport, int rank, int size, int64 bytes, int64 start_us,
              int64 ready_us, int64 end_us) {
  string line = StrCat(node, "\t", what, "\t", group, "\t", transport, "\t", rank, "\t",
                       size, "\t", bytes, "\t", start_us, "\t", ready_us, "\t", end_us, "\n");
  std::lock_guard<std::mutex> lock(trace_mu);
  if (trace_lines->size() >= kTraceCapacity) trace_lines->pop_front();
  trace_lines->push_back(std::move(line));
}

}  // namespace epl

// C entry points for Python's ctypes (epl/profile/collectives.py), on the library
// TensorFlow already loaded.
extern "C" {

void epl_trace_enable(int on) { epl::trace_on.store(on != 0); }

// Moves whole records (tab-separated lines) into buf, at most cap bytes; returns the
// bytes written (0: none left).
long long epl_trace_take(char* buf, long long cap) {
  std::lock_guard<std::mutex> lock(epl::trace_mu);
  long long n = 0;
  while (!epl::trace_lines->empty()) {
    const std::string& line = epl::trace_lines->front();
    if (n + static_cast<long long>(line.size()) > cap) break;
    std::memcpy(buf + n, line.data(), line.size());
    n += line.size();
    epl::trace_lines->pop_front();
  }
  return n;
}

}  // extern "C"

namespace epl {

InProcessRendezvous* InProcessRendezvous::Get() {
  static InProcessRendezvous* instance = new InProcessRendezvous();
  return instance;
}

InProcessRendezvous::InProcessRendezvous() {
  std::thread([this] { Watchdog(); }).detach();
}

void InProcessRendezvous::FailAll(Entry* e, const Status& s) {
  for (size_t r = 0; r < e->by_rank.size(); ++r) {
    if (!e->seen[r]) continue;
    e->by_rank[r].ctx->SetStatus(s);
    e->by_rank[r].done();
  }
}

void InProcessRendezvous::Arrive(const string& key, int size, int timeout_seconds,
                                 const string& what, Arrival arrival, Complete complete) {
  std::vector<Arrival> ready;
  Entry failed;
  Status failed_status;
  Arrival failed_arrival;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = entries_[key];
    if (e.size == 0) {
      e.size = size;
      e.what = what;
      e.by_rank.resize(size);
      e.seen.assign(size, false);
      e.timeout_seconds = timeout_seconds;
      e.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_seconds);
    }
    Status bad;
    if (size != e.size || what != e.what) {
      bad = InvalidArgument("EPL collective group '", key, "': rank ", arrival.rank, " runs ",
                            what, " over ", size, " ranks but another rank runs ", e.what,
                            " over ", e.size, " ranks; every rank must build the same "
                            "collective (same op, dtype, reduction and rank count).");
    } else if (arrival.rank < 0 || arrival.rank >= size) {
      bad = InvalidArgument("EPL collective group '", key, "': rank ", arrival.rank,
                            " is outside [0, ", size, ").");
    } else if (e.seen[arrival.rank]) {
      bad = InvalidArgument("EPL collective group '", key, "': rank ", arrival.rank,
                            " arrived twice; two ops claim the same rank.");
    }
    if (!bad.ok()) {
      failed = std::move(e);   // completed below, outside the lock
      entries_.erase(key);
      failed_status = bad;
      failed_arrival = std::move(arrival);
    } else {
      e.seen[arrival.rank] = true;
      e.by_rank[arrival.rank] = std::move(arrival);
      if (++e.arrived < e.size) return;
      ready = std::move(e.by_rank);
      entries_.erase(key);
    }
  }
  if (!failed_status.ok()) {   // completion callbacks never run under the lock
    FailAll(&failed, failed_status);
    failed_arrival.ctx->SetStatus(failed_status);
    failed_arrival.done();
    return;
  }
  complete(&ready);
}

void InProcessRendezvous::Watchdog() {
  while (true) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::vector<Entry> expired;
    std::vector<string> keys;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto now = std::chrono::steady_clock::now();
      for (auto it = entries_.begin(); it != entries_.end();) {
        if (now > it->second.deadline) {
          keys.push_back(it->first);
          expired.push_back(std::move(it->second));
          it = entries_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (size_t i = 0; i < expired.size(); ++i) {
      Entry& e = expired[i];
      FailAll(&e, tensorflow::errors::DeadlineExceeded(
          "EPL ", e.what, " (group '", keys[i], "'): rank(s) ", DescribeMissing(e.seen), " of ",
          e.size, " did not arrive within ", e.timeout_seconds,
          " s (communication.timeout_seconds). Every replica must run the collective in the "
          "same step: a fetch that runs only some replicas, or a worker that died, leaves the "
          "others waiting."));
    }
  }
}

Status AllocateShared(OpKernelContext* ctx, const string& group, DataType dtype,
                      const TensorShape& shape, Tensor* out) {
  static std::mutex mu;
  static std::map<string, Tensor>* cache = new std::map<string, Tensor>();
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache->find(group);
    if (it != cache->end() && it->second.dtype() == dtype && it->second.shape() == shape &&
        tensorflow::DMAHelper::buffer(&it->second) != nullptr &&
        tensorflow::DMAHelper::buffer(&it->second)->RefCountIsOne()) {
      *out = it->second;
      return OkStatus();
    }
  }
  TF_RETURN_IF_ERROR(ctx->allocate_temp(dtype, shape, out));
  if (shape.num_elements() * tensorflow::DataTypeSize(dtype) >= (1 << 16)) {
    std::lock_guard<std::mutex> lock(mu);
    (*cache)[group] = *out;
  }
  return OkStatus();
}

}  // namespace epl
