// Collectives between processes: job state, queues, and the op bodies (crossproc.h).
#include "crossproc.h"

#include <signal.h>
#include <unistd.h>

#include <cctype>
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
    told = Status(why.code(), StrCat("rank ", rank, " reported: ", why.error_message()));
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
  if (running_) return;
  running_ = true;
  std::thread([this] {
    while (true) {
      std::function<void()> t;
      {
        std::lock_guard<std::mutex> l(mu_);
        if (tasks_.empty()) {
          running_ = false;
          return;
        }
        t = std::move(tasks_.front());
        tasks_.pop_front();
      }
      t();
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

// Every rank checks that all ranks run this collective on as many elements.
Status SameCount(Link* l, const CrossArgs& a, int64 count) {
  std::vector<std::vector<int64>> meta;
  TF_RETURN_IF_ERROR(l->ExchangeMeta(a, {count}, &meta));
  for (int k = 0; k < a.size; ++k)
    if (meta[k][0] != count)
      return InvalidArgument("EPL ", a.what, " (group '", a.group, "'): rank ", k, " has ",
                             meta[k][0], " elements, rank ", a.rank, " has ", count);
  return Status::OK();
}

}  // namespace

Status CrossAllReduce(Link* l, const CrossArgs& a, ReduceOp op, OpKernelContext* ctx) {
  const Tensor& in = ctx->input(0);
  TF_RETURN_IF_ERROR(SameCount(l, a, in.NumElements()));
  Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, in.shape(), &out));
  return l->AllReduce(a, in.dtype(), op, in.tensor_data().data(), Data(out), in.NumElements());
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
  const DataType dtype = ctx->input(0).dtype();
  const int64 es = tensorflow::DataTypeSize(dtype);
  Tensor packed;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(dtype, TensorShape({total}), &packed));
  char* p = Data(&packed);
  int64 offset = 0;   // bytes (64-bit: fused buffers pass 2 GiB)
  for (int i = 0; i < n; ++i) {
    std::memcpy(p + offset, ctx->input(i).tensor_data().data(), ctx->input(i).TotalBytes());
    offset += ctx->input(i).TotalBytes();
  }
  TF_RETURN_IF_ERROR(l->AllReduce(a, dtype, op, p, p, total));
  offset = 0;
  for (int i = 0; i < n; ++i) {
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(i, ctx->input(i).shape(), &out));
    std::memcpy(Data(out), p + offset, out->NumElements() * es);
    offset += out->NumElements() * es;
  }
  return Status::OK();
}

Status CrossReduceScatter(Link* l, const CrossArgs& a, ReduceOp op, OpKernelContext* ctx) {
  const Tensor& in = ctx->input(0);
  if (in.dims() == 0) return InvalidArgument("reduce_scatter needs rank >= 1");
  TF_RETURN_IF_ERROR(SameCount(l, a, in.NumElements()));
  Tensor full;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(in.dtype(), in.shape(), &full));
  TF_RETURN_IF_ERROR(l->AllReduce(a, in.dtype(), op, in.tensor_data().data(), Data(&full),
                                  in.NumElements()));
  const int64 rows = in.dim_size(0), base = rows / a.size, extra = rows % a.size;
  const int64 count = base + (a.rank < extra ? 1 : 0);
  const int64 start = a.rank * base + std::min<int64>(a.rank, extra);
  Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, WithRows(in.shape(), count), &out));
  const int64 rb = RowBytesOf(in);
  std::memcpy(Data(out), full.tensor_data().data() + start * rb, count * rb);
  return Status::OK();
}

Status CrossReduce(Link* l, const CrossArgs& a, int root, ReduceOp op, OpKernelContext* ctx) {
  const Tensor& in = ctx->input(0);
  TF_RETURN_IF_ERROR(SameCount(l, a, in.NumElements()));
  Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, in.shape(), &out));
  TF_RETURN_IF_ERROR(
      l->AllReduce(a, in.dtype(), op, in.tensor_data().data(), Data(out), in.NumElements()));
  if (a.rank != root) std::memset(Data(out), 0, out->TotalBytes());
  return Status::OK();
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
  char* dst = Data(out);
  return l->Exchange(a, in.tensor_data().data(), lens,
                     [&](int k, int64 o, const char* p, int64 len) {
                       std::memcpy(dst + offsets[k] + o, p, len);
                     });
}

Status CrossBroadcast(Link* l, const CrossArgs& a, int root, OpKernelContext* ctx) {
  const Tensor& in = ctx->input(0);
  std::vector<std::vector<int64>> meta;
  TF_RETURN_IF_ERROR(l->ExchangeMeta(a, {in.NumElements()}, &meta));
  if (meta[root][0] != in.NumElements())
    return InvalidArgument("EPL ", a.what, " (group '", a.group, "'): rank ", a.rank, " has ",
                           in.NumElements(), " elements but the root has ", meta[root][0]);
  Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, in.shape(), &out));
  std::vector<int64> lens(a.size, 0);
  lens[root] = in.TotalBytes();
  char* dst = Data(out);
  return l->Exchange(a, in.tensor_data().data(), lens,
                     [&](int k, int64 o, const char* p, int64 len) {
                       std::memcpy(dst + o, p, len);
                     });
}

Status CrossAllToAll(Link* l, const CrossArgs& a, OpKernelContext* ctx) {
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
  TF_RETURN_IF_ERROR(l->ExchangeMeta(a, counts, &meta));
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
  char* dst = Data(out);
  const int me = a.rank;
  return l->Exchange(a, in.tensor_data().data(), lens,
                     [&](int k, int64 o, const char* p, int64 len) {
                       // keep the part of rank k's bytes that is addressed to me
                       const int64 lo_want = src_off[k], hi_want = lo_want + meta[k][me] * rb;
                       const int64 lo = std::max(o, lo_want), hi = std::min(o + len, hi_want);
                       if (hi > lo)
                         std::memcpy(dst + dst_off[k] + (lo - lo_want), p + (lo - o), hi - lo);
                     });
}

}  // namespace epl
