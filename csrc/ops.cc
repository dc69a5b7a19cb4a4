// EPL collective ops: registrations and kernels.
//
// Every op has attrs group (shared by the ranks of one collective), rank,
// size, timeout_seconds and transport: "inprocess" (ranks are devices of this
// process: rendezvous, zero-copy outputs), "shm" (ranks are processes of one
// host: shm.cc) or "tcp" (processes of several hosts: tcp.cc).  The two
// cross-process transports share one body per op (crossproc.cc).
#include <algorithm>
#include <cstring>

#include "collectives.h"
#include "crossproc.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/lib/core/errors.h"
#include "tensorflow/core/lib/strings/strcat.h"

namespace epl {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernelConstruction;
using tensorflow::errors::InvalidArgument;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;
using tensorflow::strings::StrCat;

#define EPL_COMMON_ATTRS                                   \
  Attr("T: {half, float, double, int32, int64}")           \
      .Attr("group: string")                               \
      .Attr("rank: int >= 0")                              \
      .Attr("size: int >= 1")                              \
      .Attr("timeout_seconds: int = 600")                  \
      .Attr("transport: {'inprocess', 'shm', 'tcp'} = 'inprocess'")

static Status FirstDimUnknown(InferenceContext* c) {
  ShapeHandle in = c->input(0);
  if (!c->RankKnown(in)) {
    c->set_output(0, c->UnknownShape());
    return OkStatus();
  }
  if (c->Rank(in) == 0) return InvalidArgument("EPL collective input must have rank >= 1");
  ShapeHandle out;
  TF_RETURN_IF_ERROR(c->ReplaceDim(in, 0, c->UnknownDim(), &out));
  c->set_output(0, out);
  return OkStatus();
}

REGISTER_OP("EplAllReduce")
    .Input("input: T")
    .Output("output: T")
    .Attr("reduce_op: {'sum', 'mean', 'max', 'min'}")
    .EPL_COMMON_ATTRS
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape);

REGISTER_OP("EplAllReduceN")
    .Input("inputs: N * T")
    .Output("outputs: N * T")
    .Attr("N: int >= 1")
    .Attr("reduce_op: {'sum', 'mean', 'max', 'min'}")
    .EPL_COMMON_ATTRS
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return OkStatus();
    })
    .Doc("Fused all-reduce of N tensors: one collective for the whole list.");

REGISTER_OP("EplAllGather")
    .Input("input: T")
    .Output("output: T")
    .Output("sizes: int64")
    .EPL_COMMON_ATTRS
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(FirstDimUnknown(c));
      int size;
      TF_RETURN_IF_ERROR(c->GetAttr("size", &size));
      c->set_output(1, c->Vector(size));
      return OkStatus();
    });

REGISTER_OP("EplReduceScatter")
    .Input("input: T")
    .Output("output: T")
    .Attr("reduce_op: {'sum', 'mean', 'max', 'min'}")
    .EPL_COMMON_ATTRS
    .SetIsStateful()
    .SetShapeFn(FirstDimUnknown);

REGISTER_OP("EplBroadcast")
    .Input("input: T")
    .Output("output: T")
    .Attr("root: int >= 0")
    .EPL_COMMON_ATTRS
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape);

REGISTER_OP("EplReduce")
    .Input("input: T")
    .Output("output: T")
    .Attr("root: int >= 0")
    .Attr("reduce_op: {'sum', 'mean', 'max', 'min'}")
    .EPL_COMMON_ATTRS
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape);

REGISTER_OP("EplAllToAll")
    .Input("input: T")
    .Input("split_sizes: int64")
    .Output("output: T")
    .Output("recv_sizes: int64")
    .EPL_COMMON_ATTRS
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(FirstDimUnknown(c));
      int size;
      TF_RETURN_IF_ERROR(c->GetAttr("size", &size));
      c->set_output(1, c->Vector(size));
      return OkStatus();
    });

namespace {

int64 RowBytes(const Tensor& t) {
  if (t.dims() == 0 || t.dim_size(0) == 0) {
    int64 inner = 1;
    for (int d = 1; d < t.dims(); ++d) inner *= t.dim_size(d);
    return inner * tensorflow::DataTypeSize(t.dtype());
  }
  return t.TotalBytes() / t.dim_size(0);
}

TensorShape WithFirstDim(const TensorShape& s, int64 rows) {
  TensorShape out = s;
  out.set_dim(0, rows);
  return out;
}

Status SameInnerShape(const std::vector<Arrival>& all, const char* what) {
  const Tensor& a = all[0].inputs[0];
  for (size_t r = 1; r < all.size(); ++r) {
    const Tensor& b = all[r].inputs[0];
    bool ok = a.dims() == b.dims() && a.dims() >= 1;
    for (int d = 1; ok && d < a.dims(); ++d) ok = a.dim_size(d) == b.dim_size(d);
    if (!ok)
      return InvalidArgument("EPL ", what, ": rank ", r, " has shape ", b.shape().DebugString(),
                             " but rank 0 has ", a.shape().DebugString(),
                             "; all dimensions but the first must match.");
  }
  return OkStatus();
}

Status SameShape(const std::vector<Arrival>& all, const char* what) {
  for (size_t r = 1; r < all.size(); ++r)
    if (all[r].inputs[0].shape() != all[0].inputs[0].shape())
      return InvalidArgument("EPL ", what, ": rank ", r, " has shape ",
                             all[r].inputs[0].shape().DebugString(), " but rank 0 has ",
                             all[0].inputs[0].shape().DebugString(), "; shapes must match.");
  return OkStatus();
}

void FinishAll(std::vector<Arrival>* all, const Status& s) {
  for (auto& a : *all) {
    if (!s.ok()) a.ctx->SetStatus(s);
    a.done();
  }
}

// Rows of rank r when `rows` are split over `n` ranks like numpy.array_split.
void SplitRows(int64 rows, int n, int r, int64* start, int64* count) {
  const int64 base = rows / n, extra = rows % n;
  *count = base + (r < extra ? 1 : 0);
  *start = r * base + std::min<int64>(r, extra);
}

// A Link that notes when the first exchange of a run's metadata returned: every op body
// starts with one (crossproc.cc), so before it this rank waited (in the group's queue,
// then for its peers), after it the bytes move.  Used only while tracing.
class TimedLink : public Link {
 public:
  explicit TimedLink(Link* inner) : inner_(inner) {}
  int64 ready_us = 0;

  Status ExchangeMeta(const CrossArgs& a, const std::vector<int64>& mine,
                      std::vector<std::vector<int64>>* all) override {
    Status s = inner_->ExchangeMeta(a, mine, all);
    if (!ready_us) ready_us = TraceNowMicros();
    return s;
  }
  Status AllReduce(const CrossArgs& a, DataType dtype, ReduceOp op, const char* in, char* out,
                   int64 count) override {
    return inner_->AllReduce(a, dtype, op, in, out, count);
  }
  Status Exchange(const CrossArgs& a, const char* mine, const std::vector<int64>& lens,
                  const Consumer& consume) override {
    return inner_->Exchange(a, mine, lens, consume);
  }
  Status AllReduceSpans(const CrossArgs& a, DataType dtype, ReduceOp op,
                        const std::vector<Span>& spans) override {
    return inner_->AllReduceSpans(a, dtype, op, spans);
  }
  Status ReduceScatter(const CrossArgs& a, DataType dtype, ReduceOp op, const char* in,
                       char* out, const std::vector<int64>& block) override {
    return inner_->ReduceScatter(a, dtype, op, in, out, block);
  }
  Status AllToAll(const CrossArgs& a, const std::vector<const char*>& send,
                  const std::vector<char*>& recv,
                  const std::vector<std::vector<int64>>& bytes) override {
    return inner_->AllToAll(a, send, recv, bytes);
  }

 private:
  Link* inner_;
};

// A CPU collective: ranks of this process meet in the rendezvous (transport
// "inprocess"); ranks in other processes go through the group's link.
class CollectiveKernel : public RendezvousKernel {
 public:
  explicit CollectiveKernel(OpKernelConstruction* c) : RendezvousKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("transport", &transport_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    if (transport_ != "inprocess") {
      // Runs of a group are ordered by the group's queue in this process, so a second
      // session (new kernels) continues where the first one stopped.
      if (TraceOn()) {
        const int64 start = TraceNowMicros(), bytes = CollectiveBytes(ctx, dtype_);
        const string node = name();
        RunCross(transport_, Args(), ctx, std::move(done),
                 [this, ctx, start, bytes, node](Link* link) {
                   TimedLink timed(link);
                   Status s = CrossBody(&timed, ctx);
                   const int64 end = TraceNowMicros();
                   TraceAdd(node, Describe(), group_, transport_, rank_, size_, bytes, start,
                            timed.ready_us ? timed.ready_us : end, end);
                   return s;
                 });
        return;
      }
      RunCross(transport_, Args(), ctx, std::move(done),
               [this, ctx](Link* link) { return CrossBody(link, ctx); });
      return;
    }
    Meet(ctx, std::move(done), [this](std::vector<Arrival>* all) { Complete(all); });
  }

 protected:
  // Called once per run, by the last rank to arrive; (*all)[r] is rank r.
  virtual void Complete(std::vector<Arrival>* all) = 0;
  // One run between processes, over the group's link (crossproc.h).
  virtual Status CrossBody(Link* link, OpKernelContext* ctx) = 0;
  CrossArgs Args() const {
    CrossArgs a;
    a.group = group_;
    a.rank = rank_;
    a.size = size_;
    a.timeout_seconds = timeout_;
    a.what = Describe();
    return a;
  }

  string transport_;
};

// A collective with a reduce_op attr (sum, mean, max, min).
class ReducingKernel : public CollectiveKernel {
 public:
  explicit ReducingKernel(OpKernelConstruction* c) : CollectiveKernel(c) {
    OP_REQUIRES_OK(c, GetReduceOp(c, &op_name_, &op_));
  }

 protected:
  string op_name_;
  ReduceOp op_;
};

class AllReduceOp : public ReducingKernel {
 public:
  using ReducingKernel::ReducingKernel;

 protected:
  string Describe() const override {
    return StrCat("all_reduce(", op_name_, ", ", tensorflow::DataTypeString(dtype_), ")");
  }
  void Complete(std::vector<Arrival>* all) override {
    if (all->size() == 1) {   // one rank: its tensor is the reduction (no copy)
      (*all)[0].ctx->set_output(0, (*all)[0].inputs[0]);
      FinishAll(all, OkStatus());
      return;
    }
    Status s = SameShape(*all, "all_reduce");
    Tensor out;
    OpKernelContext* ctx = all->back().ctx;
    const Tensor& in0 = (*all)[0].inputs[0];
    if (s.ok()) s = AllocateShared(ctx, group_, in0.dtype(), in0.shape(), &out);
    if (s.ok()) {
      std::vector<const void*> ins;
      for (auto& a : *all) ins.push_back(a.inputs[0].tensor_data().data());
      void* dst = const_cast<char*>(out.tensor_data().data());
      ParallelFor(ctx, in0.NumElements(), 4 * static_cast<int64>(all->size()),
                  [&](int64 b, int64 e) { ReduceRange(in0.dtype(), op_, ins, dst, b, e); });
      for (auto& a : *all) a.ctx->set_output(0, out);
    }
    FinishAll(all, s);
  }
  Status CrossBody(Link* link, OpKernelContext* ctx) override {
    return CrossAllReduce(link, Args(), op_, ctx);
  }
};

// Fused all-reduce: the list is reduced as one virtual buffer, with no
// concat/split ops in the graph.
class AllReduceNOp : public ReducingKernel {
 public:
  explicit AllReduceNOp(OpKernelConstruction* c) : ReducingKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("N", &n_));
  }

 protected:
  string Describe() const override {
    return StrCat("all_reduce_n(", n_, ", ", op_name_, ", ", tensorflow::DataTypeString(dtype_),
                  ")");
  }
  void Complete(std::vector<Arrival>* all) override {
    if (all->size() == 1) {   // one rank (a replica alone): its tensors are the reduction
      for (int i = 0; i < n_; ++i) (*all)[0].ctx->set_output(i, (*all)[0].inputs[i]);
      FinishAll(all, OkStatus());
      return;
    }
    Status s;
    for (size_t r = 1; s.ok() && r < all->size(); ++r)
      for (int i = 0; s.ok() && i < n_; ++i)
        if ((*all)[r].inputs[i].shape() != (*all)[0].inputs[i].shape())
          s = InvalidArgument("EPL all_reduce_n: tensor ", i, " of rank ", r, " has shape ",
                              (*all)[r].inputs[i].shape().DebugString(), " but rank 0 has ",
                              (*all)[0].inputs[i].shape().DebugString());
    OpKernelContext* ctx = all->back().ctx;
    std::vector<Tensor> outs(n_);
    std::vector<int64> offsets(n_ + 1, 0);
    for (int i = 0; s.ok() && i < n_; ++i) {
      const Tensor& t = (*all)[0].inputs[i];
      s = AllocateShared(ctx, StrCat(group_, "/", i), dtype_, t.shape(), &outs[i]);
      offsets[i + 1] = offsets[i] + t.NumElements();
    }
    if (s.ok()) {
      // One parallel loop over the concatenation of all tensors.
      const int64 es = tensorflow::DataTypeSize(dtype_);
      ParallelFor(ctx, offsets[n_], 4 * static_cast<int64>(all->size()), [&](int64 b, int64 e) {
        ForEachPiece(offsets, b, e, [&](int i, int64 lo, int64 hi) {
          std::vector<const void*> ins;
          for (auto& a : *all) ins.push_back(a.inputs[i].tensor_data().data() + lo * es);
          ReduceRange(dtype_, op_, ins, const_cast<char*>(outs[i].tensor_data().data()) + lo * es,
                      0, hi - lo);
        });
      });
      for (auto& a : *all)
        for (int i = 0; i < n_; ++i) a.ctx->set_output(i, outs[i]);
    }
    FinishAll(all, s);
  }
  Status CrossBody(Link* link, OpKernelContext* ctx) override {
    return CrossAllReduceN(link, Args(), op_, ctx);
  }

 private:
  int n_ = 1;
};

class AllGatherOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;

 protected:
  string Describe() const override {
    return StrCat("all_gather(", tensorflow::DataTypeString(dtype_), ")");
  }
  void Complete(std::vector<Arrival>* all) override {
    Status s = SameInnerShape(*all, "all_gather");
    OpKernelContext* ctx = all->back().ctx;
    Tensor out, sizes;
    int64 rows = 0;
    if (s.ok()) {
      for (auto& a : *all) rows += a.inputs[0].dim_size(0);
      s = AllocateShared(ctx, group_, dtype_, WithFirstDim((*all)[0].inputs[0].shape(), rows),
                         &out);
    }
    if (s.ok()) s = ctx->allocate_temp(tensorflow::DT_INT64, TensorShape({size_}), &sizes);
    if (s.ok()) {
      char* dst = const_cast<char*>(out.tensor_data().data());
      for (auto& a : *all) {
        const auto src = a.inputs[0].tensor_data();
        ParallelCopy(ctx, dst, src.data(), src.size());
        dst += src.size();
      }
      auto sz = sizes.vec<int64>();
      for (int r = 0; r < size_; ++r) sz(r) = (*all)[r].inputs[0].dim_size(0);
      for (auto& a : *all) {
        a.ctx->set_output(0, out);
        a.ctx->set_output(1, sizes);
      }
    }
    FinishAll(all, s);
  }
  Status CrossBody(Link* link, OpKernelContext* ctx) override {
    return CrossAllGather(link, Args(), ctx);
  }
};

class ReduceScatterOp : public ReducingKernel {
 public:
  using ReducingKernel::ReducingKernel;

 protected:
  string Describe() const override {
    return StrCat("reduce_scatter(", op_name_, ", ", tensorflow::DataTypeString(dtype_), ")");
  }
  void Complete(std::vector<Arrival>* all) override {
    Status s = SameShape(*all, "reduce_scatter");
    const Tensor& in0 = (*all)[0].inputs[0];
    if (s.ok() && in0.dims() == 0) s = InvalidArgument("reduce_scatter needs rank >= 1");
    std::vector<const void*> ins;
    for (auto& a : *all) ins.push_back(a.inputs[0].tensor_data().data());
    const int64 es = tensorflow::DataTypeSize(dtype_);
    const int64 row_elems = s.ok() ? RowBytes(in0) / es : 0;
    std::vector<Tensor> outs(size_);
    std::vector<int64> first(size_ + 1, 0);   // rank r's elements: [first[r], first[r + 1])
    for (int r = 0; s.ok() && r < size_; ++r) {
      int64 start, count;
      SplitRows(in0.dim_size(0), size_, r, &start, &count);
      s = AllocateShared((*all)[r].ctx, StrCat(group_, "/rs", r), dtype_,
                         WithFirstDim(in0.shape(), count), &outs[r]);
      first[r + 1] = (start + count) * row_elems;
    }
    if (s.ok()) {
      // One parallel loop over the whole tensor: every element goes to its rank's output.
      ParallelFor(all->back().ctx, first[size_], 4 * size_, [&](int64 b, int64 e) {
        ForEachPiece(first, b, e, [&](int r, int64 lo, int64 hi) {
          std::vector<const void*> shifted;
          for (auto p : ins) shifted.push_back(static_cast<const char*>(p) + first[r] * es);
          ReduceRange(dtype_, op_, shifted, const_cast<char*>(outs[r].tensor_data().data()),
                      lo, hi);
        });
      });
      for (int r = 0; r < size_; ++r) (*all)[r].ctx->set_output(0, outs[r]);
    }
    FinishAll(all, s);
  }
  Status CrossBody(Link* link, OpKernelContext* ctx) override {
    return CrossReduceScatter(link, Args(), op_, ctx);
  }
};

class BroadcastOp : public CollectiveKernel {
 public:
  explicit BroadcastOp(OpKernelConstruction* c) : CollectiveKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("root", &root_));
    OP_REQUIRES(c, root_ < size_, InvalidArgument("broadcast root ", root_, " >= size ", size_));
  }

 protected:
  string Describe() const override {
    return StrCat("broadcast(root=", root_, ", ", tensorflow::DataTypeString(dtype_), ")");
  }
  void Complete(std::vector<Arrival>* all) override {
    Status s = SameShape(*all, "broadcast");
    if (s.ok())  // every rank shares the root's (immutable) buffer: no copy
      for (auto& a : *all) a.ctx->set_output(0, (*all)[root_].inputs[0]);
    FinishAll(all, s);
  }
  Status CrossBody(Link* link, OpKernelContext* ctx) override {
    return CrossBroadcast(link, Args(), root_, ctx);
  }

 private:
  int root_ = 0;
};

class ReduceOpKernel : public ReducingKernel {
 public:
  explicit ReduceOpKernel(OpKernelConstruction* c) : ReducingKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("root", &root_));
    OP_REQUIRES(c, root_ < size_, InvalidArgument("reduce root ", root_, " >= size ", size_));
  }

 protected:
  string Describe() const override {
    return StrCat("reduce(root=", root_, ", ", op_name_, ", ",
                  tensorflow::DataTypeString(dtype_), ")");
  }
  void Complete(std::vector<Arrival>* all) override {
    Status s = SameShape(*all, "reduce");
    const Tensor& in0 = (*all)[0].inputs[0];
    Tensor out, zeros;
    OpKernelContext* root_ctx = (*all)[root_].ctx;
    if (s.ok()) s = root_ctx->allocate_temp(dtype_, in0.shape(), &out);
    if (s.ok() && size_ > 1) s = root_ctx->allocate_temp(dtype_, in0.shape(), &zeros);
    if (s.ok()) {
      std::vector<const void*> ins;
      for (auto& a : *all) ins.push_back(a.inputs[0].tensor_data().data());
      void* dst = const_cast<char*>(out.tensor_data().data());
      ParallelFor(root_ctx, in0.NumElements(), 4 * size_,
                  [&](int64 b, int64 e) { ReduceRange(dtype_, op_, ins, dst, b, e); });
      if (size_ > 1) std::memset(const_cast<char*>(zeros.tensor_data().data()), 0, zeros.TotalBytes());
      for (int r = 0; r < size_; ++r) (*all)[r].ctx->set_output(0, r == root_ ? out : zeros);
    }
    FinishAll(all, s);
  }
  Status CrossBody(Link* link, OpKernelContext* ctx) override {
    return CrossReduce(link, Args(), root_, op_, ctx);
  }

 private:
  int root_ = 0;
};

// Rows rank `src` sends to each rank, from its split_sizes input (empty: equal split).
class AllToAllOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;

 protected:
  string Describe() const override {
    return StrCat("all_to_all(", tensorflow::DataTypeString(dtype_), ")");
  }
  void Complete(std::vector<Arrival>* all) override {
    Status s = SameInnerShape(*all, "all_to_all");
    std::vector<std::vector<int64>> counts(size_);
    for (int src = 0; s.ok() && src < size_; ++src)
      s = SendCounts((*all)[src].inputs[0], (*all)[src].inputs[1], size_, src, &counts[src]);
    std::vector<CopyJob> jobs;
    std::vector<Tensor> outs(size_), recvs(size_);
    for (int dst = 0; s.ok() && dst < size_; ++dst) {
      int64 rows = 0;
      for (int src = 0; src < size_; ++src) rows += counts[src][dst];
      OpKernelContext* ctx = (*all)[dst].ctx;
      s = AllocateShared(ctx, StrCat(group_, "/to", dst), dtype_,
                         WithFirstDim((*all)[0].inputs[0].shape(), rows), &outs[dst]);
      if (s.ok())
        s = ctx->allocate_temp(tensorflow::DT_INT64, TensorShape({size_}), &recvs[dst]);
      if (!s.ok()) break;
      char* p = const_cast<char*>(outs[dst].tensor_data().data());
      for (int src = 0; src < size_; ++src) {
        const Tensor& x = (*all)[src].inputs[0];
        const int64 rb = RowBytes(x);
        int64 offset = 0;
        for (int r = 0; r < dst; ++r) offset += counts[src][r];
        const int64 bytes = counts[src][dst] * rb;
        jobs.push_back(CopyJob{p, x.tensor_data().data() + offset * rb, bytes});
        p += bytes;
        recvs[dst].vec<int64>()(src) = counts[src][dst];
      }
    }
    if (s.ok()) {
      // One parallel loop over every piece: n^2 small copies would each pay a fork-join.
      ParallelCopies(all->back().ctx, jobs);
      for (int dst = 0; dst < size_; ++dst) {
        (*all)[dst].ctx->set_output(0, outs[dst]);
        (*all)[dst].ctx->set_output(1, recvs[dst]);
      }
    }
    FinishAll(all, s);
  }
  Status CrossBody(Link* link, OpKernelContext* ctx) override {
    return CrossAllToAll(link, Args(), ctx);
  }
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("EplAllReduce").Device(DEVICE_CPU), AllReduceOp);
REGISTER_KERNEL_BUILDER(Name("EplAllReduceN").Device(DEVICE_CPU), AllReduceNOp);
REGISTER_KERNEL_BUILDER(Name("EplAllGather").Device(DEVICE_CPU), AllGatherOp);
REGISTER_KERNEL_BUILDER(Name("EplReduceScatter").Device(DEVICE_CPU), ReduceScatterOp);
REGISTER_KERNEL_BUILDER(Name("EplBroadcast").Device(DEVICE_CPU), BroadcastOp);
REGISTER_KERNEL_BUILDER(Name("EplReduce").Device(DEVICE_CPU), ReduceOpKernel);
REGISTER_KERNEL_BUILDER(Name("EplAllToAll").Device(DEVICE_CPU), AllToAllOp);

}  // namespace epl
