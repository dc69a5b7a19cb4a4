// Cross-process collectives over POSIX shared memory (see shm.h).
//
// Segment of a group: a header of per-rank progress counters and metadata,
// then two sets (double buffering) of size+1 slots of kChunk bytes: one input
// slot per rank and one result slot.  A collective runs in "rounds"; in a
// round every rank writes one chunk into its slot, waits for the others, then
// reads (and, for all-reduce, reduces its share of the chunk into the result
// slot).  Round r uses set r % 2, so a rank may run one round ahead.
#include "shm.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "tensorflow/core/lib/core/errors.h"
#include "tensorflow/core/lib/strings/strcat.h"

namespace epl {

using tensorflow::errors::DeadlineExceeded;
using tensorflow::errors::Internal;
using tensorflow::errors::InvalidArgument;
using tensorflow::strings::StrCat;

namespace {

constexpr int kMaxRanks = 64;
constexpr int kMeta = kMaxRanks + 2;
constexpr int64 kChunk = 256 << 10;  // small enough that a round stays in cache

struct alignas(64) Counter {
  std::atomic<int64> v;
};

struct Header {
  Counter written[kMaxRanks];
  Counter reduced[kMaxRanks];
  Counter done[kMaxRanks];
  Counter meta_ready[kMaxRanks];
  Counter meta_read[kMaxRanks];
  int64 meta[2][kMaxRanks][kMeta];  // double-buffered by generation parity
};

const int64 kHeaderBytes = ((sizeof(Header) + 4095) / 4096) * 4096;

uint64_t Fnv1a(const string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

class Group {
 public:
  Group(const string& name, int size, int rank) : name_(name), size_(size), rank_(rank) {}
  ~Group() {
    if (base_) munmap(base_, bytes_);
    if (rank_ == 0 && !shm_name_.empty()) shm_unlink(shm_name_.c_str());
  }

  Status Attach() {
    if (base_) return Status::OK();
    if (size_ > kMaxRanks) return InvalidArgument("EPL shm transport supports at most ", kMaxRanks, " ranks");
    char buf[32];
    snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(Fnv1a(name_)));
    shm_name_ = StrCat("/epl-", buf);
    bytes_ = kHeaderBytes + 2 * (size_ + 1) * kChunk;
    int fd = shm_open(shm_name_.c_str(), O_CREAT | O_RDWR, 0600);
    if (fd < 0) return Internal("shm_open(", shm_name_, ") failed: ", strerror(errno));
    struct stat st;
    if (fstat(fd, &st) == 0 && st.st_size < bytes_ && ftruncate(fd, bytes_) != 0) {
      close(fd);
      return Internal("ftruncate(", shm_name_, ", ", bytes_, ") failed: ", strerror(errno),
                      " (is /dev/shm large enough?)");
    }
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return Internal("mmap(", shm_name_, ") failed: ", strerror(errno));
    base_ = static_cast<char*>(p);
    hdr_ = reinterpret_cast<Header*>(base_);
    return Status::OK();
  }

  char* Slot(int64 round, int k) const {
    return base_ + kHeaderBytes + ((round % 2) * (size_ + 1) + k) * kChunk;
  }

  // Waits until every rank's counter reaches `target`.
  Status WaitAll(Counter* c, int64 target, const char* phase, const ShmArgs& a) {
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::seconds(a.timeout_seconds);
    for (int k = 0; k < size_; ++k) {
      int spins = 0;
      int64 sleep_us = 1;
      while (c[k].v.load(std::memory_order_acquire) < target) {
        // Spin briefly (a peer on another core answers within microseconds),
        // then back off so waiting threads leave the cores to the peers.
        if (++spins < 128) continue;
        if (spins < 160) {
          sched_yield();
          continue;
        }
        if (std::chrono::steady_clock::now() > deadline) {
          std::vector<bool> seen(size_);
          for (int j = 0; j < size_; ++j) seen[j] = c[j].v.load() >= target;
          return DeadlineExceeded("EPL ", a.what, " (group '", a.group, "', ", phase,
                                  "): rank(s) ", DescribeMissing(seen), " of ", size_,
                                  " (other processes) did not arrive within ", a.timeout_seconds,
                                  " s (communication.timeout_seconds): a worker died, or ran a "
                                  "different step.");
        }
        usleep(sleep_us);
        sleep_us = std::min<int64>(sleep_us * 2, 500);
      }
    }
    return Status::OK();
  }

  void Set(Counter* c, int64 v) { c[rank_].v.store(v, std::memory_order_release); }

  // Exchanges per-rank metadata (what-hash + values) for one generation.
  Status ExchangeMeta(const ShmArgs& a, const std::vector<int64>& mine,
                      std::vector<std::vector<int64>>* all) {
    const int64 g = a.generation, par = g % 2;
    if (g >= 1) TF_RETURN_IF_ERROR(WaitAll(hdr_->meta_read, g - 1, "metadata", a));
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

  // Chunked all-reduce of `count` elements from `in` into `out`.
  Status AllReduce(const ShmArgs& a, DataType dtype, ReduceOp op, const char* in, char* out,
                   int64 count) {
    const int64 es = tensorflow::DataTypeSize(dtype);
    const int64 per_chunk = kChunk / es;
    for (int64 begin = 0; begin < count; begin += per_chunk) {
      const int64 n = std::min(per_chunk, count - begin);
      const int64 r = round_++;
      if (r >= 2) TF_RETURN_IF_ERROR(WaitAll(hdr_->done, r - 1, "slot reuse", a));
      std::memcpy(Slot(r, rank_), in + begin * es, n * es);
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
      std::memcpy(out + begin * es, result, n * es);
      Set(hdr_->done, r + 1);
    }
    return Status::OK();
  }

  // Every rank streams `lens[k]` bytes from its `mine`; `consume(k, offset, data, len)`
  // sees every rank's bytes window by window.
  Status Exchange(const ShmArgs& a, const char* mine, const std::vector<int64>& lens,
                  const std::function<void(int, int64, const char*, int64)>& consume) {
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
    return Status::OK();
  }

  int size() const { return size_; }
  int rank() const { return rank_; }

  // Tasks run on this group's own thread, in generation order.
  void Schedule(int64 generation, std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_[generation] = std::move(task);
    if (!thread_started_) {
      thread_started_ = true;
      std::thread([this] { Loop(); }).detach();
    }
    cv_.notify_one();
  }

 private:
  void Loop() {
    while (true) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return tasks_.count(next_gen_) > 0; });
        task = std::move(tasks_[next_gen_]);
        tasks_.erase(next_gen_++);
      }
      task();
    }
  }

  string name_, shm_name_;
  int size_, rank_;
  char* base_ = nullptr;
  Header* hdr_ = nullptr;
  int64 bytes_ = 0;
  int64 round_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int64, std::function<void()>> tasks_;
  int64 next_gen_ = 0;
  bool thread_started_ = false;
};

Group* GetGroup(const ShmArgs& a, Status* s) {
  static std::mutex mu;
  static auto* groups = new std::map<string, std::unique_ptr<Group>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& g = (*groups)[a.group];
  if (!g) g.reset(new Group(a.group, a.size, a.rank));
  if (g->size() != a.size || g->rank() != a.rank) {
    *s = InvalidArgument("EPL shm group '", a.group, "' used with rank ", a.rank, "/", a.size,
                         " and ", g->rank(), "/", g->size(), " in one process");
    return nullptr;
  }
  *s = g->Attach();
  return s->ok() ? g.get() : nullptr;
}

// Runs body(group) on the group's thread, then finishes the op.
void Run(const ShmArgs& a, OpKernelContext* ctx, AsyncOpKernel::DoneCallback done,
         std::function<Status(Group*)> body) {
  Status s;
  Group* g = GetGroup(a, &s);
  if (!g) {
    ctx->SetStatus(s);
    done();
    return;
  }
  g->Schedule(a.generation, [g, ctx, done, body]() {
    Status st = body(g);
    if (!st.ok()) ctx->SetStatus(st);
    done();
  });
}

// Every rank checks that all ranks run this collective on as many elements.
Status SameCount(Group* g, const ShmArgs& a, int64 count) {
  std::vector<std::vector<int64>> meta;
  TF_RETURN_IF_ERROR(g->ExchangeMeta(a, {count}, &meta));
  for (int k = 0; k < a.size; ++k)
    if (meta[k][0] != count)
      return InvalidArgument("EPL ", a.what, " (group '", a.group, "'): rank ", k, " has ",
                             meta[k][0], " elements, rank ", a.rank, " has ", count);
  return Status::OK();
}

TensorShape WithRows(const TensorShape& s, int64 rows) {
  TensorShape out = s;
  if (out.dims() > 0) out.set_dim(0, rows);
  return out;
}

int64 RowBytesOf(const Tensor& t) {
  int64 inner = tensorflow::DataTypeSize(t.dtype());
  for (int d = 1; d < t.dims(); ++d) inner *= t.dim_size(d);
  return inner;
}

}  // namespace

void ShmAllReduce(const ShmArgs& a, ReduceOp op, OpKernelContext* ctx,
                  AsyncOpKernel::DoneCallback done) {
  Run(a, ctx, std::move(done), [a, op, ctx](Group* g) -> Status {
    const Tensor& in = ctx->input(0);
    TF_RETURN_IF_ERROR(SameCount(g, a, in.NumElements()));
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, in.shape(), &out));
    return g->AllReduce(a, in.dtype(), op, in.tensor_data().data(),
                        const_cast<char*>(out->tensor_data().data()), in.NumElements());
  });
}

void ShmAllReduceN(const ShmArgs& a, ReduceOp op, OpKernelContext* ctx,
                   AsyncOpKernel::DoneCallback done) {
  Run(a, ctx, std::move(done), [a, op, ctx](Group* g) -> Status {
    const int n = ctx->num_inputs();
    int64 total = 0;
    std::vector<int64> counts;
    for (int i = 0; i < n; ++i) {
      counts.push_back(ctx->input(i).NumElements());
      total += counts.back();
    }
    std::vector<std::vector<int64>> meta;
    TF_RETURN_IF_ERROR(g->ExchangeMeta(a, {total, n}, &meta));
    for (int k = 0; k < a.size; ++k)
      if (meta[k][0] != total || meta[k][1] != n)
        return InvalidArgument("EPL ", a.what, ": rank ", k, " reduces ", meta[k][0],
                               " elements in ", meta[k][1], " tensors, rank ", a.rank, " ",
                               total, " in ", n);
    const DataType dtype = ctx->input(0).dtype();
    const int64 es = tensorflow::DataTypeSize(dtype);
    Tensor packed, reduced;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(dtype, TensorShape({total}), &packed));
    TF_RETURN_IF_ERROR(ctx->allocate_temp(dtype, TensorShape({total}), &reduced));
    char* p = const_cast<char*>(packed.tensor_data().data());
    for (int i = 0; i < n; ++i) {
      std::memcpy(p, ctx->input(i).tensor_data().data(), counts[i] * es);
      p += counts[i] * es;
    }
    char* q = const_cast<char*>(reduced.tensor_data().data());
    TF_RETURN_IF_ERROR(g->AllReduce(a, dtype, op, packed.tensor_data().data(), q, total));
    for (int i = 0; i < n; ++i) {
      Tensor* out = nullptr;
      TF_RETURN_IF_ERROR(ctx->allocate_output(i, ctx->input(i).shape(), &out));
      std::memcpy(const_cast<char*>(out->tensor_data().data()), q, counts[i] * es);
      q += counts[i] * es;
    }
    return Status::OK();
  });
}

void ShmReduceScatter(const ShmArgs& a, ReduceOp op, OpKernelContext* ctx,
                      AsyncOpKernel::DoneCallback done) {
  Run(a, ctx, std::move(done), [a, op, ctx](Group* g) -> Status {
    const Tensor& in = ctx->input(0);
    if (in.dims() == 0) return InvalidArgument("reduce_scatter needs rank >= 1");
    TF_RETURN_IF_ERROR(SameCount(g, a, in.NumElements()));
    Tensor full;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(in.dtype(), in.shape(), &full));
    TF_RETURN_IF_ERROR(g->AllReduce(a, in.dtype(), op, in.tensor_data().data(),
                                    const_cast<char*>(full.tensor_data().data()),
                                    in.NumElements()));
    const int64 rows = in.dim_size(0), base = rows / a.size, extra = rows % a.size;
    const int64 count = base + (a.rank < extra ? 1 : 0);
    const int64 start = a.rank * base + std::min<int64>(a.rank, extra);
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, WithRows(in.shape(), count), &out));
    const int64 rb = RowBytesOf(in);
    std::memcpy(const_cast<char*>(out->tensor_data().data()),
                full.tensor_data().data() + start * rb, count * rb);
    return Status::OK();
  });
}

void ShmReduce(const ShmArgs& a, int root, ReduceOp op, OpKernelContext* ctx,
               AsyncOpKernel::DoneCallback done) {
  Run(a, ctx, std::move(done), [a, root, op, ctx](Group* g) -> Status {
    const Tensor& in = ctx->input(0);
    TF_RETURN_IF_ERROR(SameCount(g, a, in.NumElements()));
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, in.shape(), &out));
    char* dst = const_cast<char*>(out->tensor_data().data());
    TF_RETURN_IF_ERROR(
        g->AllReduce(a, in.dtype(), op, in.tensor_data().data(), dst, in.NumElements()));
    if (a.rank != root) std::memset(dst, 0, out->TotalBytes());
    return Status::OK();
  });
}

void ShmAllGather(const ShmArgs& a, OpKernelContext* ctx, AsyncOpKernel::DoneCallback done) {
  Run(a, ctx, std::move(done), [a, ctx](Group* g) -> Status {
    const Tensor& in = ctx->input(0);
    if (in.dims() == 0) return InvalidArgument("all_gather needs rank >= 1");
    std::vector<int64> mine = {in.dim_size(0), in.dims()};
    for (int d = 1; d < in.dims(); ++d) mine.push_back(in.dim_size(d));
    std::vector<std::vector<int64>> meta;
    TF_RETURN_IF_ERROR(g->ExchangeMeta(a, mine, &meta));
    int64 rows = 0;
    for (int k = 0; k < a.size; ++k) {
      if (std::vector<int64>(meta[k].begin() + 1, meta[k].end()) !=
          std::vector<int64>(mine.begin() + 1, mine.end()))
        return InvalidArgument("EPL ", a.what, ": rank ", k,
                               " has different inner dimensions than rank ", a.rank);
      rows += meta[k][0];
    }
    Tensor* out = nullptr;
    Tensor* sizes = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, WithRows(in.shape(), rows), &out));
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, TensorShape({a.size}), &sizes));
    const int64 rb = RowBytesOf(in);
    std::vector<int64> lens(a.size), offsets(a.size);
    int64 off = 0;
    for (int k = 0; k < a.size; ++k) {
      lens[k] = meta[k][0] * rb;
      offsets[k] = off;
      off += lens[k];
      sizes->vec<int64>()(k) = meta[k][0];
    }
    char* dst = const_cast<char*>(out->tensor_data().data());
    return g->Exchange(a, in.tensor_data().data(), lens,
                       [&](int k, int64 o, const char* p, int64 len) {
                         std::memcpy(dst + offsets[k] + o, p, len);
                       });
  });
}

void ShmBroadcast(const ShmArgs& a, int root, OpKernelContext* ctx,
                  AsyncOpKernel::DoneCallback done) {
  Run(a, ctx, std::move(done), [a, root, ctx](Group* g) -> Status {
    const Tensor& in = ctx->input(0);
    std::vector<std::vector<int64>> meta;
    TF_RETURN_IF_ERROR(g->ExchangeMeta(a, {in.NumElements()}, &meta));
    if (meta[root][0] != in.NumElements())
      return InvalidArgument("EPL ", a.what, ": rank ", a.rank, " has ", in.NumElements(),
                             " elements but the root has ", meta[root][0]);
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, in.shape(), &out));
    std::vector<int64> lens(a.size, 0);
    lens[root] = in.TotalBytes();
    char* dst = const_cast<char*>(out->tensor_data().data());
    return g->Exchange(a, in.tensor_data().data(), lens,
                       [&](int k, int64 o, const char* p, int64 len) {
                         std::memcpy(dst + o, p, len);
                       });
  });
}

void ShmAllToAll(const ShmArgs& a, OpKernelContext* ctx, AsyncOpKernel::DoneCallback done) {
  Run(a, ctx, std::move(done), [a, ctx](Group* g) -> Status {
    const Tensor& in = ctx->input(0);
    const Tensor& splits = ctx->input(1);
    if (in.dims() == 0) return InvalidArgument("all_to_all needs rank >= 1");
    const int64 rows = in.dim_size(0);
    std::vector<int64> counts(a.size);
    if (splits.NumElements() == 0) {
      if (rows % a.size)
        return InvalidArgument("EPL all_to_all: rank ", a.rank, " has ", rows,
                               " rows, which do not split evenly over ", a.size,
                               " ranks; pass explicit split sizes.");
      for (auto& c : counts) c = rows / a.size;
    } else {
      if (splits.NumElements() != a.size)
        return InvalidArgument("EPL all_to_all: ", splits.NumElements(), " split sizes for ",
                               a.size, " ranks");
      int64 total = 0;
      for (int k = 0; k < a.size; ++k) total += (counts[k] = splits.vec<int64>()(k));
      if (total != rows)
        return InvalidArgument("EPL all_to_all: split sizes add up to ", total, " but the "
                               "input has ", rows, " rows");
    }
    std::vector<std::vector<int64>> meta;
    TF_RETURN_IF_ERROR(g->ExchangeMeta(a, counts, &meta));
    const int64 rb = RowBytesOf(in);
    int64 out_rows = 0;
    std::vector<int64> lens(a.size), src_off(a.size), dst_off(a.size);
    for (int k = 0; k < a.size; ++k) {
      lens[k] = 0;
      for (int j = 0; j < a.size; ++j) lens[k] += meta[k][j] * rb;
      src_off[k] = 0;
      for (int j = 0; j < a.rank; ++j) src_off[k] += meta[k][j] * rb;
      dst_off[k] = out_rows * rb;
      out_rows += meta[k][a.rank];
    }
    Tensor* out = nullptr;
    Tensor* recv = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, WithRows(in.shape(), out_rows), &out));
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, TensorShape({a.size}), &recv));
    for (int k = 0; k < a.size; ++k) recv->vec<int64>()(k) = meta[k][a.rank];
    char* dst = const_cast<char*>(out->tensor_data().data());
    const int me = a.rank;
    return g->Exchange(a, in.tensor_data().data(), lens,
                       [&](int k, int64 o, const char* p, int64 len) {
                         // keep the part of rank k's window that is addressed to me
                         const int64 want_lo = src_off[k], want_hi = want_lo + meta[k][me] * rb;
                         const int64 lo = std::max(o, want_lo), hi = std::min(o + len, want_hi);
                         if (hi > lo) std::memcpy(dst + dst_off[k] + (lo - want_lo), p + (lo - o), hi - lo);
                       });
  });
}

}  // namespace epl
