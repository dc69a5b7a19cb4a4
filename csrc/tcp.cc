// Ring collectives over TCP (see tcp.h).
#include "tcp.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <cstring>
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
using Clock = std::chrono::steady_clock;

namespace {

std::vector<std::pair<string, int>> Addresses() {
  std::vector<std::pair<string, int>> out;
  const char* env = std::getenv("EPL_COMM_ADDRESSES");
  string s = env ? env : "";
  size_t pos = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    string item = s.substr(pos, comma == string::npos ? string::npos : comma - pos);
    size_t colon = item.rfind(':');
    if (colon != string::npos) out.emplace_back(item.substr(0, colon), std::atoi(item.c_str() + colon + 1));
    if (comma == string::npos) break;
    pos = comma + 1;
  }
  return out;
}

Status SendAll(int fd, const void* p, int64 n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t k = ::send(fd, c, std::min<int64>(n, 1 << 20), MSG_NOSIGNAL);
    if (k <= 0) return Internal("EPL tcp: send failed: ", strerror(errno));
    c += k;
    n -= k;
  }
  return Status::OK();
}

Status RecvAll(int fd, void* p, int64 n, Clock::time_point deadline, const string& what) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    struct pollfd pfd = {fd, POLLIN, 0};
    int ms = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                  deadline - Clock::now()).count());
    if (ms <= 0 || ::poll(&pfd, 1, std::min(ms, 1000)) < 0)
      return DeadlineExceeded(what);
    if (!(pfd.revents & (POLLIN | POLLHUP | POLLERR))) continue;
    ssize_t k = ::recv(fd, c, std::min<int64>(n, 1 << 20), 0);
    if (k <= 0) return Internal("EPL tcp: the peer closed the connection (", what, ")");
    c += k;
    n -= k;
  }
  return Status::OK();
}

// Accepts connections for every group of this process and hands them out.
class Hub {
 public:
  static Hub* Get() {
    static Hub* hub = new Hub();
    return hub;
  }
  Status Start(int rank) {
    std::lock_guard<std::mutex> lock(mu_);
    if (listening_) return Status::OK();
    auto addrs = Addresses();
    if (rank >= static_cast<int>(addrs.size()))
      return InvalidArgument("EPL tcp transport: EPL_COMM_ADDRESSES has ", addrs.size(),
                             " addresses, rank ", rank, " needs its own (set by epl-launch)");
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sin_family = AF_INET;
    sa.sin_port = htons(addrs[rank].second);
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 || ::listen(fd, 64) != 0)
      return Internal("EPL tcp: cannot listen on port ", addrs[rank].second, ": ",
                      strerror(errno));
    listening_ = true;
    std::thread([this, fd] { Accept(fd); }).detach();
    return Status::OK();
  }
  // The connection `src` opened for `group`, waiting until the deadline.
  Status Take(const string& group, int src, Clock::time_point deadline, int* fd) {
    std::unique_lock<std::mutex> lock(mu_);
    auto key = std::make_pair(group, src);
    if (!cv_.wait_until(lock, deadline, [&] { return conns_.count(key) > 0; }))
      return DeadlineExceeded("EPL tcp: rank ", src, " never connected for group '", group, "'");
    *fd = conns_[key];
    conns_.erase(key);
    return Status::OK();
  }

 private:
  void Accept(int lfd) {
    while (true) {
      int fd = ::accept(lfd, nullptr, nullptr);
      if (fd < 0) continue;
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      std::thread([this, fd] {
        int32_t len = 0, src = 0;
        auto dl = Clock::now() + std::chrono::seconds(30);
        if (!RecvAll(fd, &len, 4, dl, "header").ok() || len <= 0 || len > 4096) return;
        string group(len, '\0');
        if (!RecvAll(fd, &group[0], len, dl, "header").ok()) return;
        if (!RecvAll(fd, &src, 4, dl, "header").ok()) return;
        std::lock_guard<std::mutex> lock(mu_);
        conns_[std::make_pair(group, src)] = fd;
        cv_.notify_all();
      }).detach();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<string, int>, int> conns_;
  bool listening_ = false;
};

class Ring {
 public:
  Ring(const string& group, int rank, int size) : group_(group), rank_(rank), size_(size) {}

  Status Connect(const ShmArgs& a) {
    if (next_ >= 0 || size_ == 1) return Status::OK();
    TF_RETURN_IF_ERROR(Hub::Get()->Start(rank_));
    auto addrs = Addresses();
    const int peer = (rank_ + 1) % size_;
    if (peer >= static_cast<int>(addrs.size()))
      return InvalidArgument("EPL tcp transport: no address for rank ", peer,
                             " in EPL_COMM_ADDRESSES");
    const auto deadline = Clock::now() + std::chrono::seconds(a.timeout_seconds);
    while (true) {
      addrinfo hints, *res = nullptr;
      std::memset(&hints, 0, sizeof(hints));
      hints.ai_family = AF_INET;
      hints.ai_socktype = SOCK_STREAM;
      if (::getaddrinfo(addrs[peer].first.c_str(), std::to_string(addrs[peer].second).c_str(),
                        &hints, &res) == 0) {
        int fd = ::socket(AF_INET, SOCK_STREAM, 0);
        if (::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
          ::freeaddrinfo(res);
          int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          int32_t len = static_cast<int32_t>(group_.size()), me = rank_;
          TF_RETURN_IF_ERROR(SendAll(fd, &len, 4));
          TF_RETURN_IF_ERROR(SendAll(fd, group_.data(), len));
          TF_RETURN_IF_ERROR(SendAll(fd, &me, 4));
          next_ = fd;
          break;
        }
        ::close(fd);
        ::freeaddrinfo(res);
      }
      if (Clock::now() > deadline)
        return DeadlineExceeded("EPL ", a.what, " (group '", group_, "'): rank ", peer, " at ",
                                addrs[peer].first, ":", addrs[peer].second,
                                " did not accept within ", a.timeout_seconds, " s");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return Hub::Get()->Take(group_, (rank_ - 1 + size_) % size_, deadline, &prev_);
  }

  // Sends `out` to the next rank while receiving `in_len` bytes from the previous one.
  Status Exchange(const char* out, int64 out_len, char* in, int64 in_len, const ShmArgs& a) {
    Status send_status;
    std::thread sender([&] { send_status = SendAll(next_, out, out_len); });
    Status s = RecvAll(prev_, in, in_len,
                       Clock::now() + std::chrono::seconds(a.timeout_seconds),
                       StrCat("EPL ", a.what, " (group '", group_, "'): rank ",
                              (rank_ - 1 + size_) % size_, " sent nothing within ",
                              a.timeout_seconds, " s"));
    sender.join();
    return s.ok() ? send_status : s;
  }

  // Ring all-reduce: reduce-scatter, then all-gather, over `size` segments.
  Status AllReduce(const ShmArgs& a, DataType dtype, ReduceOp op, const char* in, char* out,
                   int64 count) {
    const int64 es = tensorflow::DataTypeSize(dtype);
    if (in != out) std::memcpy(out, in, count * es);
    if (size_ == 1) return Status::OK();
    auto lo = [&](int k) { return count * k / size_; };
    std::vector<char> buf((count / size_ + 1) * es);
    for (int s = 0; s < size_ - 1; ++s) {
      const int send = ((rank_ - s) % size_ + size_) % size_;
      const int recv = ((rank_ - s - 1) % size_ + size_) % size_;
      const int64 rn = lo(recv + 1) - lo(recv);
      TF_RETURN_IF_ERROR(Exchange(out + lo(send) * es, (lo(send + 1) - lo(send)) * es,
                                  buf.data(), rn * es, a));
      std::vector<const void*> ins = {out + lo(recv) * es, buf.data()};
      ReduceRange(dtype, op == ReduceOp::kMean ? ReduceOp::kSum : op, ins,
                  out + lo(recv) * es, 0, rn);
    }
    for (int s = 0; s < size_ - 1; ++s) {
      const int send = ((rank_ + 1 - s) % size_ + size_) % size_;
      const int recv = ((rank_ - s) % size_ + size_) % size_;
      TF_RETURN_IF_ERROR(Exchange(out + lo(send) * es, (lo(send + 1) - lo(send)) * es,
                                  out + lo(recv) * es, (lo(recv + 1) - lo(recv)) * es, a));
    }
    if (op == ReduceOp::kMean) {
      for (int64 i = 0; i < count; ++i) {
        switch (dtype) {
          case tensorflow::DT_FLOAT: reinterpret_cast<float*>(out)[i] /= size_; break;
          case tensorflow::DT_DOUBLE: reinterpret_cast<double*>(out)[i] /= size_; break;
          case tensorflow::DT_INT32: reinterpret_cast<int32_t*>(out)[i] /= size_; break;
          case tensorflow::DT_INT64: reinterpret_cast<int64_t*>(out)[i] /= size_; break;
          default: {
            auto* h = reinterpret_cast<Eigen::half*>(out);
            h[i] = Eigen::half(static_cast<float>(h[i]) / size_);
          }
        }
      }
    }
    return Status::OK();
  }

  // Ring all-gather of per-rank byte blocks of lengths `lens` into `out` (concatenated).
  Status AllGather(const ShmArgs& a, const std::vector<int64>& lens, char* out) {
    std::vector<int64> off(size_ + 1, 0);
    for (int k = 0; k < size_; ++k) off[k + 1] = off[k] + lens[k];
    for (int s = 0; s < size_ - 1; ++s) {
      const int send = ((rank_ - s) % size_ + size_) % size_;
      const int recv = ((rank_ - s - 1) % size_ + size_) % size_;
      TF_RETURN_IF_ERROR(Exchange(out + off[send], lens[send], out + off[recv], lens[recv], a));
    }
    return Status::OK();
  }

  void Schedule(int64 gen, std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_[gen] = std::move(task);
    if (!started_) {
      started_ = true;
      std::thread([this] {
        while (true) {
          std::function<void()> t;
          {
            std::unique_lock<std::mutex> l(mu_);
            cv_.wait(l, [this] { return tasks_.count(next_gen_) > 0; });
            t = std::move(tasks_[next_gen_]);
            tasks_.erase(next_gen_++);
          }
          t();
        }
      }).detach();
    }
    cv_.notify_one();
  }

 private:
  string group_;
  int rank_, size_;
  int next_ = -1, prev_ = -1;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int64, std::function<void()>> tasks_;
  int64 next_gen_ = 0;
  bool started_ = false;
};

void Run(const ShmArgs& a, OpKernelContext* ctx, AsyncOpKernel::DoneCallback done,
         std::function<Status(Ring*)> body) {
  static std::mutex mu;
  static auto* rings = new std::map<string, std::unique_ptr<Ring>>();
  Ring* ring;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto& r = (*rings)[a.group];
    if (!r) r.reset(new Ring(a.group, a.rank, a.size));
    ring = r.get();
  }
  ring->Schedule(a.generation, [a, ring, ctx, done, body] {
    Status s = ring->Connect(a);
    if (s.ok()) s = body(ring);
    if (!s.ok()) ctx->SetStatus(s);
    done();
  });
}

// Every rank learns every rank's int64 metadata (and checks they run the same op).
Status Meta(Ring* ring, const ShmArgs& a, std::vector<int64> mine, int width,
            std::vector<int64>* all) {
  mine.resize(width + 1);
  mine[width] = static_cast<int64>(std::hash<string>()(a.what));
  all->assign((width + 1) * a.size, 0);
  std::copy(mine.begin(), mine.end(), all->begin() + a.rank * (width + 1));
  std::vector<int64> lens(a.size, (width + 1) * 8);
  TF_RETURN_IF_ERROR(ring->AllGather(a, lens, reinterpret_cast<char*>(all->data())));
  for (int k = 0; k < a.size; ++k)
    if ((*all)[k * (width + 1) + width] != mine[width])
      return InvalidArgument("EPL ", a.what, " (group '", a.group, "'): rank ", k,
                             " runs a different collective");
  return Status::OK();
}

// Every rank checks that all ranks run this collective on as many elements.
Status SameCount(Ring* ring, const ShmArgs& a, int64 count) {
  std::vector<int64> meta;
  TF_RETURN_IF_ERROR(Meta(ring, a, {count}, 1, &meta));
  for (int k = 0; k < a.size; ++k)
    if (meta[k * 2] != count)
      return InvalidArgument("EPL ", a.what, " (group '", a.group, "'): rank ", k, " has ",
                             meta[k * 2], " elements, rank ", a.rank, " has ", count);
  return Status::OK();
}

}  // namespace

void TcpAllReduce(const ShmArgs& a, ReduceOp op, OpKernelContext* ctx,
                  AsyncOpKernel::DoneCallback done) {
  Run(a, ctx, std::move(done), [a, op, ctx](Ring* ring) -> Status {
    const Tensor& in = ctx->input(0);
    TF_RETURN_IF_ERROR(SameCount(ring, a, in.NumElements()));
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, in.shape(), &out));
    return ring->AllReduce(a, in.dtype(), op, in.tensor_data().data(),
                           const_cast<char*>(out->tensor_data().data()), in.NumElements());
  });
}

void TcpAllReduceN(const ShmArgs& a, ReduceOp op, OpKernelContext* ctx,
                   AsyncOpKernel::DoneCallback done) {
  Run(a, ctx, std::move(done), [a, op, ctx](Ring* ring) -> Status {
    const int n = ctx->num_inputs();
    const DataType dtype = ctx->input(0).dtype();
    const int64 es = tensorflow::DataTypeSize(dtype);
    int64 total = 0;
    for (int i = 0; i < n; ++i) total += ctx->input(i).NumElements();
    TF_RETURN_IF_ERROR(SameCount(ring, a, total));
    Tensor packed;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(dtype, TensorShape({total}), &packed));
    char* p = const_cast<char*>(packed.tensor_data().data());
    for (int i = 0, o = 0; i < n; ++i) {
      std::memcpy(p + o, ctx->input(i).tensor_data().data(), ctx->input(i).TotalBytes());
      o += ctx->input(i).TotalBytes();
    }
    TF_RETURN_IF_ERROR(ring->AllReduce(a, dtype, op, p, p, total));
    for (int i = 0; i < n; ++i) {
      Tensor* out = nullptr;
      TF_RETURN_IF_ERROR(ctx->allocate_output(i, ctx->input(i).shape(), &out));
      std::memcpy(const_cast<char*>(out->tensor_data().data()), p, out->TotalBytes());
      p += out->NumElements() * es;
    }
    return Status::OK();
  });
}

// Reduce-scatter and reduce: a ring all-reduce, then this rank keeps its part.
void TcpReduceScatter(const ShmArgs& a, ReduceOp op, OpKernelContext* ctx,
                      AsyncOpKernel::DoneCallback done) {
  Run(a, ctx, std::move(done), [a, op, ctx](Ring* ring) -> Status {
    const Tensor& in = ctx->input(0);
    if (in.dims() == 0) return InvalidArgument("reduce_scatter needs rank >= 1");
    TF_RETURN_IF_ERROR(SameCount(ring, a, in.NumElements()));
    Tensor full;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(in.dtype(), in.shape(), &full));
    char* f = const_cast<char*>(full.tensor_data().data());
    TF_RETURN_IF_ERROR(ring->AllReduce(a, in.dtype(), op, in.tensor_data().data(), f,
                                       in.NumElements()));
    const int64 rows = in.dim_size(0), base = rows / a.size, extra = rows % a.size;
    const int64 count = base + (a.rank < extra ? 1 : 0);
    const int64 start = a.rank * base + std::min<int64>(a.rank, extra);
    const int64 row_bytes = rows ? in.TotalBytes() / rows : 0;
    TensorShape shape = in.shape();
    shape.set_dim(0, count);
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, shape, &out));
    std::memcpy(const_cast<char*>(out->tensor_data().data()), f + start * row_bytes,
                count * row_bytes);
    return Status::OK();
  });
}

void TcpReduce(const ShmArgs& a, int root, ReduceOp op, OpKernelContext* ctx,
               AsyncOpKernel::DoneCallback done) {
  Run(a, ctx, std::move(done), [a, root, op, ctx](Ring* ring) -> Status {
    const Tensor& in = ctx->input(0);
    TF_RETURN_IF_ERROR(SameCount(ring, a, in.NumElements()));
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, in.shape(), &out));
    char* dst = const_cast<char*>(out->tensor_data().data());
    TF_RETURN_IF_ERROR(ring->AllReduce(a, in.dtype(), op, in.tensor_data().data(), dst,
                                       in.NumElements()));
    if (a.rank != root) std::memset(dst, 0, out->TotalBytes());
    return Status::OK();
  });
}

// All-to-all: every rank's input and split sizes travel around the ring (all-gather);
// each rank keeps the rows addressed to it.  Simple, and fine for the sizes MoE sends.
void TcpAllToAll(const ShmArgs& a, OpKernelContext* ctx, AsyncOpKernel::DoneCallback done) {
  Run(a, ctx, std::move(done), [a, ctx](Ring* ring) -> Status {
    const Tensor& in = ctx->input(0);
    const Tensor& splits = ctx->input(1);
    if (in.dims() == 0) return InvalidArgument("all_to_all needs rank >= 1");
    const int n = a.size;
    const int64 rows = in.dim_size(0);
    std::vector<int64> counts(n);
    if (splits.NumElements() == 0) {
      if (rows % n)
        return InvalidArgument("EPL all_to_all: rank ", a.rank, " has ", rows,
                               " rows, which do not split evenly over ", n,
                               " ranks; pass explicit split sizes.");
      for (auto& c : counts) c = rows / n;
    } else {
      if (splits.NumElements() != n)
        return InvalidArgument("EPL all_to_all: ", splits.NumElements(), " split sizes for ",
                               n, " ranks");
      int64 total = 0;
      for (int k = 0; k < n; ++k) total += (counts[k] = splits.vec<int64>()(k));
      if (total != rows)
        return InvalidArgument("EPL all_to_all: split sizes add up to ", total,
                               " but the input has ", rows, " rows");
    }
    std::vector<int64> meta;
    TF_RETURN_IF_ERROR(Meta(ring, a, counts, n, &meta));
    int64 inner = tensorflow::DataTypeSize(in.dtype());
    for (int d = 1; d < in.dims(); ++d) inner *= in.dim_size(d);
    std::vector<int64> lens(n, 0), offs(n + 1, 0);
    for (int k = 0; k < n; ++k) {
      for (int j = 0; j < n; ++j) lens[k] += meta[k * (n + 1) + j] * inner;
      offs[k + 1] = offs[k] + lens[k];
    }
    std::vector<char> everything(offs[n]);
    std::memcpy(everything.data() + offs[a.rank], in.tensor_data().data(), lens[a.rank]);
    TF_RETURN_IF_ERROR(ring->AllGather(a, lens, everything.data()));
    int64 out_rows = 0;
    for (int k = 0; k < n; ++k) out_rows += meta[k * (n + 1) + a.rank];
    TensorShape shape = in.shape();
    shape.set_dim(0, out_rows);
    Tensor* out = nullptr;
    Tensor* recv = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, shape, &out));
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, TensorShape({n}), &recv));
    char* dst = const_cast<char*>(out->tensor_data().data());
    for (int k = 0; k < n; ++k) {
      int64 skip = 0;
      for (int j = 0; j < a.rank; ++j) skip += meta[k * (n + 1) + j];
      const int64 take = meta[k * (n + 1) + a.rank];
      std::memcpy(dst, everything.data() + offs[k] + skip * inner, take * inner);
      dst += take * inner;
      recv->vec<int64>()(k) = take;
    }
    return Status::OK();
  });
}

void TcpAllGather(const ShmArgs& a, OpKernelContext* ctx, AsyncOpKernel::DoneCallback done) {
  Run(a, ctx, std::move(done), [a, ctx](Ring* ring) -> Status {
    const Tensor& in = ctx->input(0);
    if (in.dims() == 0) return InvalidArgument("all_gather needs rank >= 1");
    std::vector<int64> meta;
    TF_RETURN_IF_ERROR(Meta(ring, a, {in.dim_size(0)}, 1, &meta));
    int64 rows = 0;
    std::vector<int64> lens(a.size);
    for (int k = 0; k < a.size; ++k) rows += meta[k * 2];
    int64 inner = tensorflow::DataTypeSize(in.dtype());
    for (int d = 1; d < in.dims(); ++d) inner *= in.dim_size(d);
    for (int k = 0; k < a.size; ++k) lens[k] = meta[k * 2] * inner;
    TensorShape shape = in.shape();
    shape.set_dim(0, rows);
    Tensor* out = nullptr;
    Tensor* sizes = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, shape, &out));
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, TensorShape({a.size}), &sizes));
    int64 off = 0;
    for (int k = 0; k < a.size; ++k) {
      sizes->vec<int64>()(k) = meta[k * 2];
      if (k < a.rank) off += lens[k];
    }
    char* dst = const_cast<char*>(out->tensor_data().data());
    std::memcpy(dst + off, in.tensor_data().data(), lens[a.rank]);
    return ring->AllGather(a, lens, dst);
  });
}

void TcpBroadcast(const ShmArgs& a, int root, OpKernelContext* ctx,
                  AsyncOpKernel::DoneCallback done) {
  Run(a, ctx, std::move(done), [a, root, ctx](Ring* ring) -> Status {
    const Tensor& in = ctx->input(0);
    std::vector<int64> meta;
    TF_RETURN_IF_ERROR(Meta(ring, a, {in.NumElements()}, 1, &meta));
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, in.shape(), &out));
    // All-gather with only the root contributing bytes.
    std::vector<int64> lens(a.size, 0);
    lens[root] = in.TotalBytes();
    char* dst = const_cast<char*>(out->tensor_data().data());
    if (a.rank == root) std::memcpy(dst, in.tensor_data().data(), in.TotalBytes());
    return ring->AllGather(a, lens, dst);
  });
}

}  // namespace epl
