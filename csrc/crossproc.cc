// Collectives between processes: job state, queues, and the op bodies (crossproc.h).
#include "crossproc.h"

#include <signal.h>
#include <unistd.h>

#include <cctype>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <thread>

#include "tensorflow/core/lib/core/errors.h"
#include "tensorflow/core/lib/strings/strcat.h"

namespace epl {

using tensorflow::errors::InvalidArgument;
using tensorflow::strings::StrCat;

uint64_t Fnv1a(const string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

string JobOf(const string& group) {
  const size_t slash = group.find('/');
  return slash == string::npos ? group : group.substr(0, slash);
}

string RunTag(const string& job) {
  const char* env = std::getenv("EPL_RUN_ID");
  string tag;
  if (env != nullptr)
    for (const char* c = env; *c && tag.size() < 16; ++c)
      if (std::isalnum(static_cast<unsigned char>(*c))) tag += *c;
  if (!tag.empty()) return tag;
  char buf[32];
  snprintf(buf, sizeof(buf), "%012llx",
           static_cast<unsigned long long>(Fnv1a(job) & 0xffffffffffffull));
  return buf;
}

// ---- Link defaults -------------------------------------------------------------------

Status Link::AllReduceSpans(const CrossArgs& a, DataType dtype, ReduceOp op,
                            const std::vector<Span>& spans) {
  const int64 es = tensorflow::DataTypeSize(dtype);
  if (spans.size() == 1)
    return AllReduce(a, dtype, op, spans[0].in, spans[0].out, spans[0].bytes / es);
  int64 total = 0;
  for (const Span& s : spans) total += s.bytes;
  std::vector<char> packed(total);
  SpanCursor cursor(spans);
  cursor.Read(0, total, packed.data());
  TF_RETURN_IF_ERROR(AllReduce(a, dtype, op, packed.data(), packed.data(), total / es));
  cursor.Write(0, total, packed.data());
  return OkStatus();
}

Status Link::ReduceScatter(const CrossArgs& a, DataType dtype, ReduceOp op, const char* in,
                           char* out, const std::vector<int64>& block) {
  int64 total = 0, mine = 0;
  for (int j = 0; j < a.size; ++j) {
    if (j == a.rank) mine = total;
    total += block[j];
  }
  std::vector<char> full(total);
  TF_RETURN_IF_ERROR(AllReduce(a, dtype, op, in, full.data(),
                               total / tensorflow::DataTypeSize(dtype)));
  if (block[a.rank]) std::memcpy(out, full.data() + mine, block[a.rank]);
  return OkStatus();
}

void StreamCopy(char* dst, const char* src, int64 n) {
#if defined(__AVX2__)
  const int64 head = std::min<int64>(n, (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  for (; n >= 128; n -= 128, dst += 128, src += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 96), d);
  }
#endif
  std::memcpy(dst, src, n);
}

void StreamFence() {
#if defined(__AVX2__)
  _mm_sfence();
#endif
}

int64 SpanCursor::Seek(int64 off) {
  if (off < start_) {
    i_ = 0;
    start_ = 0;
  }
  while (off >= start_ + spans_[i_].bytes) start_ += spans_[i_++].bytes;
  return off - start_;
}

void SpanCursor::Walk(int64 off, int64 len, char* dst, const char* src) {
  while (len > 0) {
    const int64 at = Seek(off);
    const Span& s = spans_[i_];
    const int64 n = std::min(len, s.bytes - at);
    if (dst) std::memcpy(dst, s.in + at, n), dst += n;
    else if (stream_) StreamCopy(s.out + at, src, n), src += n;
    else std::memcpy(s.out + at, src, n), src += n;
    off += n;
    len -= n;
  }
}

Status Link::AllToAll(const CrossArgs& a, const std::vector<const char*>& send,
                      const std::vector<char*>& recv,
                      const std::vector<std::vector<int64>>& bytes) {
  // Every rank's pieces for every rank, concatenated, go to everyone.
  std::vector<int64> lens(a.size, 0), before(a.size, 0);
  for (int k = 0; k < a.size; ++k)
    for (int j = 0; j < a.size; ++j) {
      lens[k] += bytes[k][j];
      if (j < a.rank) before[k] += bytes[k][j];
    }
  std::vector<char> mine(lens[a.rank]);
  int64 off = 0;
  for (int j = 0; j < a.size; ++j) {
    if (bytes[a.rank][j]) std::memcpy(mine.data() + off, send[j], bytes[a.rank][j]);
    off += bytes[a.rank][j];
  }
  return Exchange(a, mine.data(), lens, [&](int k, int64 o, const char* p, int64 len) {
    const int64 want = bytes[k][a.rank];
    const int64 lo = std::max(o, before[k]), hi = std::min(o + len, before[k] + want);
    if (hi > lo) std::memcpy(recv[k] + (lo - before[k]), p + (lo - o), hi - lo);
  });
}

// ---- job state -------------------------------------------------------------------

JobState* JobState::Get(const string& job) {
  static std::mutex mu;
  static auto* jobs = new std::map<string, std::unique_ptr<JobState>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& j = (*jobs)[job];
  if (!j) j.reset(new JobState());
  return j.get();
}

Status JobState::Aborted() {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

Status JobState::Abort(const Status& why, int rank) {
  std::vector<std::function<void(const Status&)>> tell;
  Status told;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status_.ok()) return status_;
    status_ = why;
    tell = tell_;
    told = MakeStatus(static_cast<int>(why.code()), StrCat("rank ", rank, " reported: ", StatusMessage(why)));
  }
  for (auto& t : tell) t(told);
  return why;
}

void JobState::Forward(const Status& why) {
  std::vector<std::function<void(const Status&)>> tell;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status_.ok()) return;
    status_ = why;
    tell = tell_;
  }
  for (auto& t : tell) t(why);
}

void JobState::AddPropagator(std::function<void(const Status&)> tell) {
  std::lock_guard<std::mutex> lock(mu_);
  tell_.push_back(std::move(tell));
}

// ---- queues ----------------------------------------------------------------------

void SerialQueue::Schedule(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(mu_);
  tasks_.push_back(std::move(task));
  if (running_) {
    cv_.notify_one();
    return;
  }
  running_ = true;
  std::thread([this] {
    std::unique_lock<std::mutex> l(mu_);
    while (true) {
      // Linger a while when idle: a training loop schedules the next run within
      // milliseconds, and starting a thread per run costs tens of microseconds.
      if (tasks_.empty() &&
          !cv_.wait_for(l, std::chrono::seconds(2), [this] { return !tasks_.empty(); })) {
        running_ = false;
        return;
      }
      std::function<void()> t = std::move(tasks_.front());
      tasks_.pop_front();
      l.unlock();
      t();
      l.lock();
    }
  }).detach();
}

namespace {

SerialQueue* QueueFor(const string& group) {
  static std::mutex mu;
  static auto* queues = new std::map<string, std::unique_ptr<SerialQueue>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& q = (*queues)[group];
  if (!q) q.reset(new SerialQueue());
  return q.get();
}

// (state, start time) of a process from /proc; false when it cannot be read.
bool ReadStat(int64 pid, char* state, int64* start) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = fopen(path, "r");
  if (!f) return false;
  char buf[1024];
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = 0;
  const char* p = strrchr(buf, ')');   // the command name may hold spaces and ')'
  if (!p) return false;
  // After ") ": state (field 3), then fields 4..21, then starttime (field 22).
  *state = p[2];
  const char* q = p + 2;
  for (int field = 3; field < 22 && *q; ++field) {
    q = strchr(q, ' ');
    if (!q) return false;
    ++q;
  }
  *start = std::strtoll(q, nullptr, 10);
  return true;
}

}  // namespace

ProcessId Self() {
  ProcessId me;
  me.pid = getpid();
  char state;
  if (!ReadStat(me.pid, &state, &me.start)) me.start = 0;
  return me;
}

bool Alive(const ProcessId& p) {
  if (p.pid <= 0) return true;   // (unknown: not known to be dead)
  char state;
  int64 start;
  if (!ReadStat(p.pid, &state, &start)) {
    if (access("/proc/self/stat", R_OK) != 0) return kill(p.pid, 0) == 0 || errno == EPERM;
    return false;
  }
  if (state == 'Z' || state == 'X') return false;
  return p.start == 0 || start == p.start;
}

// ---- running a collective ----------------------------------------------------------

void RunCross(const string& transport, const CrossArgs& a, OpKernelContext* ctx,
              AsyncOpKernel::DoneCallback done, std::function<Status(Link*)> body) {
  JobState* job = JobState::Get(JobOf(a.group));
  Status s = job->Aborted();
  if (!s.ok()) {
    ctx->SetStatus(s);
    done();
    return;
  }
  QueueFor(a.group)->Schedule([transport, a, ctx, done, body, job] {
    Status st = job->Aborted();
    Link* link = nullptr;
    if (st.ok()) link = transport == "shm" ? ShmLinkFor(a, &st) : TcpLinkFor(a, &st);
    if (st.ok()) st = body(link);
    if (!st.ok()) st = job->Abort(st, a.rank);
    if (!st.ok()) ctx->SetStatus(st);
    done();
  });
}

// ---- op bodies -----------------------------------------------------------------------

namespace {

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

char* Data(Tensor* t) { return const_cast<char*>(t->tensor_data().data()); }

// Output `index`: the buffer of input `input` when TensorFlow lets it be forwarded
// (nobody else reads it: the result is written in place), else a buffer of the group
// reused across steps once nobody holds it (a fresh large allocation costs a page
// fault per 4 KiB, which is slower than the collective itself).
Status OutputFor(OpKernelContext* ctx, const CrossArgs& a, int index, int input,
                 const TensorShape& shape, Tensor* out) {
  const DataType dtype = ctx->expected_output_dtype(index);
  if (input >= 0) {
    std::unique_ptr<Tensor> fwd = ctx->forward_input(input, index, dtype, shape,
                                                     tensorflow::DEVICE_MEMORY,
                                                     ctx->output_alloc_attr(index));
    if (fwd) {
      *out = *fwd;
      ctx->set_output(index, *out);
      return OkStatus();
    }
  }
  TF_RETURN_IF_ERROR(AllocateShared(ctx, StrCat(a.group, "#out", index), dtype, shape, out));
  ctx->set_output(index, *out);
  return OkStatus();
}

// A reused output that never aliases an input.
Status Reusable(OpKernelContext* ctx, const CrossArgs& a, int index, const TensorShape& shape,
                Tensor* out) {
  return OutputFor(ctx, a, index, -1, shape, out);
}

// Every rank checks that all ranks run this collective on as many elements.
Status SameCount(Link* l, const CrossArgs& a, int64 count) {
  std::vector<std::vector<int64>> meta;
  TF_RETURN_IF_ERROR(l->ExchangeMeta(a, {count}, &meta));
  for (int k = 0; k < a.size; ++k)
    if (meta[k][0] != count)
      return InvalidArgument("EPL ", a.what, " (group '", a.group, "'): rank ", k, " has ",
                             meta[k][0], " elements, rank ", a.rank, " has ", count);
  return OkStatus();
}

}  // namespace

Status CrossAllReduce(Link* l, const CrossArgs& a, ReduceOp op, OpKernelContext* ctx) {
  const Tensor& in = ctx->input(0);   // (a reference: a copy would stop forwarding)
  TF_RETURN_IF_ERROR(SameCount(l, a, in.NumElements()));
  Tensor out;
  TF_RETURN_IF_ERROR(OutputFor(ctx, a, 0, 0, in.shape(), &out));
  return l->AllReduce(a, in.dtype(), op, in.tensor_data().data(), Data(&out), in.NumElements());
}

Status CrossAllReduceN(Link* l, const CrossArgs& a, ReduceOp op, OpKernelContext* ctx) {
  const int n = ctx->num_inputs();
  int64 total = 0;
  for (int i = 0; i < n; ++i) total += ctx->input(i).NumElements();
  std::vector<std::vector<int64>> meta;
  TF_RETURN_IF_ERROR(l->ExchangeMeta(a, {total, n}, &meta));
  for (int k = 0; k < a.size; ++k)
    if (meta[k][0] != total || meta[k][1] != n)
      return InvalidArgument("EPL ", a.what, " (group '", a.group, "'): rank ", k, " reduces ",
                             meta[k][0], " elements in ", meta[k][1], " tensors, rank ", a.rank,
                             " ", total, " in ", n);
  std::vector<Tensor> outs(n);
  std::vector<Span> spans;
  for (int i = 0; i < n; ++i) {
    const Tensor& in = ctx->input(i);   // (a reference: a copy would stop forwarding)
    TF_RETURN_IF_ERROR(OutputFor(ctx, a, i, i, in.shape(), &outs[i]));
    if (in.TotalBytes())
      spans.push_back(Span{in.tensor_data().data(), Data(&outs[i]),
                           static_cast<int64>(in.TotalBytes())});
  }
  if (spans.empty()) return OkStatus();
  return l->AllReduceSpans(a, ctx->input(0).dtype(), op, spans);
}

Status CrossReduceScatter(Link* l, const CrossArgs& a, ReduceOp op, OpKernelContext* ctx) {
  const Tensor& in = ctx->input(0);
  if (in.dims() == 0) return InvalidArgument("reduce_scatter needs rank >= 1");
  TF_RETURN_IF_ERROR(SameCount(l, a, in.NumElements()));
  const int64 rows = in.dim_size(0), base = rows / a.size, extra = rows % a.size;
  const int64 rb = RowBytesOf(in);
  std::vector<int64> block(a.size);
  for (int j = 0; j < a.size; ++j) block[j] = (base + (j < extra ? 1 : 0)) * rb;
  Tensor out;
  TF_RETURN_IF_ERROR(
      Reusable(ctx, a, 0, WithRows(in.shape(), base + (a.rank < extra ? 1 : 0)), &out));
  return l->ReduceScatter(a, in.dtype(), op, in.tensor_data().data(), Data(&out), block);
}

Status CrossReduce(Link* l, const CrossArgs& a, int root, ReduceOp op, OpKernelContext* ctx) {
  const Tensor& in = ctx->input(0);
  TF_RETURN_IF_ERROR(SameCount(l, a, in.NumElements()));
  Tensor out;
  TF_RETURN_IF_ERROR(OutputFor(ctx, a, 0, 0, in.shape(), &out));
  TF_RETURN_IF_ERROR(
      l->AllReduce(a, in.dtype(), op, in.tensor_data().data(), Data(&out), in.NumElements()));
  if (a.rank != root) std::memset(Data(&out), 0, out.TotalBytes());
  return OkStatus();
}

Status CrossAllGather(Link* l, const CrossArgs& a, OpKernelContext* ctx) {
  const Tensor& in = ctx->input(0);
  if (in.dims() == 0) return InvalidArgument("all_gather needs rank >= 1");
  std::vector<int64> mine = {in.dim_size(0), in.dims()};
  for (int d = 1; d < in.dims(); ++d) mine.push_back(in.dim_size(d));
  std::vector<std::vector<int64>> meta;
  TF_RETURN_IF_ERROR(l->ExchangeMeta(a, mine, &meta));
  int64 rows = 0;
  for (int k = 0; k < a.size; ++k) {
    if (std::vector<int64>(meta[k].begin() + 1, meta[k].end()) !=
        std::vector<int64>(mine.begin() + 1, mine.end()))
      return InvalidArgument("EPL ", a.what, " (group '", a.group, "'): rank ", k,
                             " has different inner dimensions than rank ", a.rank);
    rows += meta[k][0];
  }
  Tensor out;
  Tensor* sizes = nullptr;
  TF_RETURN_IF_ERROR(Reusable(ctx, a, 0, WithRows(in.shape(), rows), &out));
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
  char* dst = Data(&out);
  const bool stream = out.TotalBytes() >= kStreamBytes;
  Status s = l->Exchange(a, in.tensor_data().data(), lens,
                         [&](int k, int64 o, const char* p, int64 len) {
                           if (stream) StreamCopy(dst + offsets[k] + o, p, len);
                           else std::memcpy(dst + offsets[k] + o, p, len);
                         });
  StreamFence();
  return s;
}

Status CrossBroadcast(Link* l, const CrossArgs& a, int root, OpKernelContext* ctx) {
  const Tensor& in = ctx->input(0);
  std::vector<std::vector<int64>> meta;
  TF_RETURN_IF_ERROR(l->ExchangeMeta(a, {in.NumElements()}, &meta));
  if (meta[root][0] != in.NumElements())
    return InvalidArgument("EPL ", a.what, " (group '", a.group, "'): rank ", a.rank, " has ",
                           in.NumElements(), " elements but the root has ", meta[root][0]);
  Tensor out;
  TF_RETURN_IF_ERROR(OutputFor(ctx, a, 0, 0, in.shape(), &out));
  std::vector<int64> lens(a.size, 0);
  lens[root] = in.TotalBytes();
  char* dst = Data(&out);
  const bool stream = out.TotalBytes() >= kStreamBytes;
  Status s = l->Exchange(a, in.tensor_data().data(), lens,
                         [&](int k, int64 o, const char* p, int64 len) {
                           if (stream) StreamCopy(dst + o, p, len);
                           else std::memcpy(dst + o, p, len);
                         });
  StreamFence();
  return s;
}

Status CrossAllToAll(Link* l, const CrossArgs& a, OpKernelContext* ctx) {
  const Tensor& in = ctx->input(0);
  const Tensor& splits = ctx->input(1);
  if (in.dims() == 0) return InvalidArgument("all_to_all needs rank >= 1");
  std::vector<int64> counts;
  TF_RETURN_IF_ERROR(SendCounts(in, splits, a.size, a.rank, &counts));
  std::vector<std::vector<int64>> meta;
  TF_RETURN_IF_ERROR(l->ExchangeMeta(a, counts, &meta));
  const int64 rb = RowBytesOf(in);
  int64 out_rows = 0;
  for (int k = 0; k < a.size; ++k) out_rows += meta[k][a.rank];
  Tensor out;
  Tensor* recv = nullptr;
  TF_RETURN_IF_ERROR(Reusable(ctx, a, 0, WithRows(in.shape(), out_rows), &out));
  TF_RETURN_IF_ERROR(ctx->allocate_output(1, TensorShape({a.size}), &recv));
  std::vector<std::vector<int64>> bytes(a.size, std::vector<int64>(a.size));
  std::vector<const char*> send(a.size);
  std::vector<char*> dst(a.size);
  const char* src = in.tensor_data().data();
  char* o = Data(&out);
  for (int k = 0; k < a.size; ++k)
    for (int j = 0; j < a.size; ++j) bytes[k][j] = meta[k][j] * rb;
  for (int k = 0; k < a.size; ++k) {
    recv->vec<int64>()(k) = meta[k][a.rank];
    dst[k] = o;
    o += bytes[k][a.rank];
    send[k] = src;
    src += bytes[a.rank][k];
  }
  return l->AllToAll(a, send, dst, bytes);
}

}  // namespace epl
