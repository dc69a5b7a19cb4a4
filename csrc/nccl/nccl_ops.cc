// GPU kernels of EPL's collectives over NCCL (in-process ranks = GPUs of one worker).
//
// Compiled only when csrc/build.py finds cuda_runtime.h and nccl.h and TensorFlow is a
// CUDA build (EPL_WITH_NCCL).  The ranks meet in the same rendezvous as the CPU
// kernels; the last to arrive enqueues every rank's NCCL call inside one
// ncclGroupStart/End on each rank's TensorFlow compute stream, so consumers on
// that stream are ordered after the collective.  Launches of different groups are
// serialized by one mutex, so every GPU sees collectives in the same order (no
// cross-group deadlock on the device).
#if EPL_WITH_NCCL

// The GPU part of tf_compat.h (stream, device and BLAS across the TensorFlow lines).
#define EPL_TF_COMPAT_GPU 1

#include <cuda_runtime.h>
#include <nccl.h>

#include <map>
#include <mutex>
#include <vector>

#include "../collectives.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/lib/core/errors.h"
#include "tensorflow/core/lib/strings/strcat.h"
#include "../tf_compat.h"

// ncclAvg arrived in NCCL 2.10; before it (or with EPL_NCCL_SUM_THEN_SCALE, which the
// compile check uses to build that path too) a mean is a sum, then a scale on the
// stream.
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= 21000 && !defined(EPL_NCCL_SUM_THEN_SCALE)
#define EPL_NCCL_HAS_AVG 1
#else
#define EPL_NCCL_HAS_AVG 0
#endif

namespace epl {

using tensorflow::DEVICE_GPU;
using tensorflow::OpKernelConstruction;
using tensorflow::errors::Internal;
using tensorflow::errors::InvalidArgument;
using tensorflow::strings::StrCat;

namespace {

std::mutex g_launch_mu;

Status NcclStatus(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return OkStatus();
  return Internal("NCCL ", what, " failed: ", ncclGetErrorString(r));
}

ncclDataType_t NcclType(DataType t) {
  switch (t) {
    case tensorflow::DT_HALF: return ncclHalf;
    case tensorflow::DT_FLOAT: return ncclFloat;
    case tensorflow::DT_DOUBLE: return ncclDouble;
    case tensorflow::DT_INT32: return ncclInt32;
    default: return ncclInt64;
  }
}

// The NCCL reduction for `op`; *scale is true when a mean must be finished by
// ScaleOutput (NCCL without ncclAvg).
Status NcclOp(ReduceOp op, ncclRedOp_t* out, bool* scale) {
  *scale = false;
  switch (op) {
    case ReduceOp::kMax: *out = ncclMax; return OkStatus();
    case ReduceOp::kMin: *out = ncclMin; return OkStatus();
    case ReduceOp::kSum: *out = ncclSum; return OkStatus();
    case ReduceOp::kMean:
#if EPL_NCCL_HAS_AVG
      *out = ncclAvg;
#else
      *out = ncclSum;
      *scale = true;
#endif
      return OkStatus();
  }
  return OkStatus();
}

// x *= 1/n on the kernel's stream, after the sum (the mean without ncclAvg): BLAS scal
// of TensorFlow's stream executor, for float and double.
Status ScaleOutput(OpKernelContext* ctx, Tensor* t, int n) {
  if (t->NumElements() == 0) return OkStatus();
  auto* stream = GpuStream(ctx);
  void* data = const_cast<char*>(t->tensor_data().data());
  bool enqueued = false;
  switch (t->dtype()) {
    case tensorflow::DT_FLOAT:
      enqueued = GpuBlasScal<float>(stream, t->NumElements(), 1.0f / n, data);
      break;
    case tensorflow::DT_DOUBLE:
      enqueued = GpuBlasScal<double>(stream, t->NumElements(), 1.0 / n, data);
      break;
    default:
      return tensorflow::errors::Unimplemented(
          "EPL mean of ", tensorflow::DataTypeString(t->dtype()), " on GPU needs NCCL >= 2.10 "
          "(ncclAvg; this build has NCCL ", NCCL_MAJOR, ".", NCCL_MINOR, "): reduce with sum "
          "and divide, or update NCCL.");
  }
  if (!enqueued || !stream->ok())
    return Internal("EPL: scaling the mean on the GPU stream failed (no BLAS for the "
                    "stream, or cuBLAS refused the scal)");
  return OkStatus();
}

// The op's TensorFlow compute stream, as CUDA sees it.
cudaStream_t StreamOf(OpKernelContext* ctx) {
  return static_cast<cudaStream_t>(GpuStreamHandle(ctx));
}

// One NCCL communicator per ordered list of GPUs, created once.
Status Comms(const std::vector<Arrival>& all, std::vector<ncclComm_t>** out) {
  static std::mutex mu;
  static auto* cache = new std::map<std::vector<int>, std::vector<ncclComm_t>>();
  std::vector<int> gpus;
  for (const auto& a : all) gpus.push_back(GpuDeviceOrdinal(a.ctx));
  std::lock_guard<std::mutex> lock(mu);
  auto& comms = (*cache)[gpus];
  if (comms.empty()) {
    comms.resize(gpus.size());
    TF_RETURN_IF_ERROR(NcclStatus(
        ncclCommInitAll(comms.data(), static_cast<int>(gpus.size()), gpus.data()),
        "ncclCommInitAll"));
  }
  *out = &comms;
  return OkStatus();
}

// An NCCL collective: the ranks (GPUs of this process) meet in the rendezvous every
// EPL kernel uses; the last to arrive launches them all.
class NcclKernel : public RendezvousKernel {
 public:
  using RendezvousKernel::RendezvousKernel;

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    Meet(ctx, std::move(done), [this](std::vector<Arrival>* all) {
      std::vector<ncclComm_t>* comms = nullptr;
      Status s = Comms(*all, &comms);
      if (s.ok()) {
        std::lock_guard<std::mutex> lock(g_launch_mu);
        s = Launch(all, *comms);
      }
      for (auto& x : *all) {
        if (!s.ok()) x.ctx->SetStatus(s);
        x.done();
      }
    });
  }

 protected:
  // Allocates every rank's outputs and enqueues the NCCL calls (inside a group).
  virtual Status Launch(std::vector<Arrival>* all, const std::vector<ncclComm_t>& comms) = 0;
};

// A kernel with a reduce_op attr.
class NcclReducing : public NcclKernel {
 public:
  explicit NcclReducing(OpKernelConstruction* c) : NcclKernel(c) {
    string name;
    ReduceOp op;
    OP_REQUIRES_OK(c, GetReduceOp(c, &name, &op));
    OP_REQUIRES_OK(c, NcclOp(op, &op_, &scale_));
  }

 protected:
  ncclRedOp_t op_;
  bool scale_ = false;
};

// All-reduce of every input (EplAllReduce: one; EplAllReduceN: a fused list).
class NcclAllReduce : public NcclReducing {
 public:
  using NcclReducing::NcclReducing;

 protected:
  string Describe() const override { return "nccl_all_reduce"; }
  Status Launch(std::vector<Arrival>* all, const std::vector<ncclComm_t>& comms) override {
    const int n_in = static_cast<int>((*all)[0].inputs.size());
    std::vector<std::vector<Tensor*>> outs(all->size(), std::vector<Tensor*>(n_in));
    for (size_t r = 0; r < all->size(); ++r) {
      for (int i = 0; i < n_in; ++i) {
        const Tensor& in = (*all)[r].inputs[i];
        if (in.shape() != (*all)[0].inputs[i].shape())
          return InvalidArgument("EPL nccl all_reduce: tensor ", i, " differs across ranks");
        TF_RETURN_IF_ERROR((*all)[r].ctx->allocate_output(i, in.shape(), &outs[r][i]));
      }
    }
    TF_RETURN_IF_ERROR(NcclStatus(ncclGroupStart(), "ncclGroupStart"));
    for (size_t r = 0; r < all->size(); ++r) {
      for (int i = 0; i < n_in; ++i) {
        const Tensor& in = (*all)[r].inputs[i];
        ncclAllReduce(in.tensor_data().data(),
                      const_cast<char*>(outs[r][i]->tensor_data().data()), in.NumElements(),
                      NcclType(dtype_), op_, comms[r], StreamOf((*all)[r].ctx));
      }
    }
    TF_RETURN_IF_ERROR(NcclStatus(ncclGroupEnd(), "ncclGroupEnd"));
    if (scale_)
      for (size_t r = 0; r < all->size(); ++r)
        for (int i = 0; i < n_in; ++i)
          TF_RETURN_IF_ERROR(ScaleOutput((*all)[r].ctx, outs[r][i], size_));
    return OkStatus();
  }
};

// EplReduce: the reduction on the root, zeros on the other ranks.
class NcclReduce : public NcclReducing {
 public:
  explicit NcclReduce(OpKernelConstruction* c) : NcclReducing(c) {
    OP_REQUIRES_OK(c, c->GetAttr("root", &root_));
  }

 protected:
  string Describe() const override { return "nccl_reduce"; }
  Status Launch(std::vector<Arrival>* all, const std::vector<ncclComm_t>& comms) override {
    std::vector<Tensor*> outs(all->size());
    for (size_t r = 0; r < all->size(); ++r) {
      const Tensor& in = (*all)[r].inputs[0];
      if (in.shape() != (*all)[0].inputs[0].shape())
        return InvalidArgument("EPL nccl reduce: rank ", r, " has a different shape");
      TF_RETURN_IF_ERROR((*all)[r].ctx->allocate_output(0, in.shape(), &outs[r]));
      if (static_cast<int>(r) != root_ && outs[r]->TotalBytes())
        cudaMemsetAsync(const_cast<char*>(outs[r]->tensor_data().data()), 0,
                        outs[r]->TotalBytes(), StreamOf((*all)[r].ctx));
    }
    TF_RETURN_IF_ERROR(NcclStatus(ncclGroupStart(), "ncclGroupStart"));
    for (size_t r = 0; r < all->size(); ++r) {
      const Tensor& in = (*all)[r].inputs[0];
      ncclReduce(in.tensor_data().data(), const_cast<char*>(outs[r]->tensor_data().data()),
                 in.NumElements(), NcclType(dtype_), op_, root_, comms[r],
                 StreamOf((*all)[r].ctx));
    }
    TF_RETURN_IF_ERROR(NcclStatus(ncclGroupEnd(), "ncclGroupEnd"));
    if (scale_) return ScaleOutput((*all)[root_].ctx, outs[root_], size_);
    return OkStatus();
  }

 private:
  int root_ = 0;
};

// EplReduceScatter: rank r gets its rows (split like numpy.array_split) of the
// reduction.  Equal blocks are one ncclReduceScatter; unequal ones a reduce per block
// to its owner (NCCL's reduce-scatter needs equal counts).
class NcclReduceScatter : public NcclReducing {
 public:
  using NcclReducing::NcclReducing;

 protected:
  string Describe() const override { return "nccl_reduce_scatter"; }
  Status Launch(std::vector<Arrival>* all, const std::vector<ncclComm_t>& comms) override {
    const Tensor& in0 = (*all)[0].inputs[0];
    if (in0.dims() == 0) return InvalidArgument("reduce_scatter needs rank >= 1");
    const int64 rows = in0.dim_size(0), base = rows / size_, extra = rows % size_;
    const int64 row_elems = rows ? in0.NumElements() / rows : 0;
    std::vector<Tensor*> outs(all->size());
    std::vector<int64> first(size_ + 1, 0);
    for (int r = 0; r < size_; ++r) {
      const Tensor& in = (*all)[r].inputs[0];
      if (in.shape() != in0.shape())
        return InvalidArgument("EPL nccl reduce_scatter: rank ", r, " has a different shape");
      const int64 count = base + (r < extra ? 1 : 0);
      first[r + 1] = first[r] + count * row_elems;
      TensorShape shape = in0.shape();
      shape.set_dim(0, count);
      TF_RETURN_IF_ERROR((*all)[r].ctx->allocate_output(0, shape, &outs[r]));
    }
    const int64 es = tensorflow::DataTypeSize(dtype_);
    TF_RETURN_IF_ERROR(NcclStatus(ncclGroupStart(), "ncclGroupStart"));
    for (int r = 0; r < size_; ++r) {
      const char* src = (*all)[r].inputs[0].tensor_data().data();
      char* dst = const_cast<char*>(outs[r]->tensor_data().data());
      if (extra == 0) {
        ncclReduceScatter(src, dst, base * row_elems, NcclType(dtype_), op_, comms[r],
                          StreamOf((*all)[r].ctx));
        continue;
      }
      for (int owner = 0; owner < size_; ++owner)
        ncclReduce(src + first[owner] * es, owner == r ? dst : nullptr,
                   first[owner + 1] - first[owner], NcclType(dtype_), op_, owner, comms[r],
                   StreamOf((*all)[r].ctx));
    }
    TF_RETURN_IF_ERROR(NcclStatus(ncclGroupEnd(), "ncclGroupEnd"));
    if (scale_)
      for (int r = 0; r < size_; ++r)
        TF_RETURN_IF_ERROR(ScaleOutput((*all)[r].ctx, outs[r], size_));
    return OkStatus();
  }
};

class NcclAllGather : public NcclKernel {
 public:
  using NcclKernel::NcclKernel;

 protected:
  string Describe() const override { return "nccl_all_gather"; }
  Status Launch(std::vector<Arrival>* all, const std::vector<ncclComm_t>& comms) override {
    // NCCL's all-gather needs equal sizes: unequal first dimensions go rank by rank
    // as broadcasts into the concatenated output.
    int64 rows = 0;
    std::vector<int64> offsets;
    for (auto& a : *all) {
      offsets.push_back(rows);
      rows += a.inputs[0].dim_size(0);
    }
    std::vector<Tensor*> outs(all->size());
    for (size_t r = 0; r < all->size(); ++r) {
      tensorflow::TensorShape shape = (*all)[0].inputs[0].shape();
      shape.set_dim(0, rows);
      TF_RETURN_IF_ERROR((*all)[r].ctx->allocate_output(0, shape, &outs[r]));
      Tensor* sizes = nullptr;
      tensorflow::AllocatorAttributes host;
      host.set_on_host(true);
      TF_RETURN_IF_ERROR((*all)[r].ctx->allocate_output(1, tensorflow::TensorShape({size_}),
                                                        &sizes, host));
      for (int k = 0; k < size_; ++k) sizes->vec<int64>()(k) = (*all)[k].inputs[0].dim_size(0);
    }
    const int64 row_bytes = rows ? outs[0]->TotalBytes() / rows : 0;
    TF_RETURN_IF_ERROR(NcclStatus(ncclGroupStart(), "ncclGroupStart"));
    for (int root = 0; root < size_; ++root) {
      const Tensor& src = (*all)[root].inputs[0];
      for (int r = 0; r < size_; ++r) {
        char* dst = const_cast<char*>(outs[r]->tensor_data().data()) + offsets[root] * row_bytes;
        ncclBroadcast(r == root ? src.tensor_data().data() : nullptr, dst, src.TotalBytes(),
                      ncclChar, root, comms[r], StreamOf((*all)[r].ctx));
      }
    }
    return NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
  }
};

class NcclBroadcast : public NcclKernel {
 public:
  explicit NcclBroadcast(OpKernelConstruction* c) : NcclKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("root", &root_));
  }

 protected:
  string Describe() const override { return "nccl_broadcast"; }
  Status Launch(std::vector<Arrival>* all, const std::vector<ncclComm_t>& comms) override {
    std::vector<Tensor*> outs(all->size());
    for (size_t r = 0; r < all->size(); ++r)
      TF_RETURN_IF_ERROR((*all)[r].ctx->allocate_output(0, (*all)[r].inputs[0].shape(), &outs[r]));
    TF_RETURN_IF_ERROR(NcclStatus(ncclGroupStart(), "ncclGroupStart"));
    for (size_t r = 0; r < all->size(); ++r)
      ncclBroadcast((*all)[root_].inputs[0].tensor_data().data(),
                    const_cast<char*>(outs[r]->tensor_data().data()),
                    (*all)[r].inputs[0].TotalBytes(), ncclChar, root_, comms[r],
                    StreamOf((*all)[r].ctx));
    return NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
  }

 private:
  int root_ = 0;
};

class NcclAllToAll : public NcclKernel {
 public:
  using NcclKernel::NcclKernel;

 protected:
  string Describe() const override { return "nccl_all_to_all"; }
  Status Launch(std::vector<Arrival>* all, const std::vector<ncclComm_t>& comms) override {
    // counts[src][dst]: rows rank src sends rank dst (equal splits, or the explicit
    // split sizes, which live in host memory).
    const int n = size_;
    std::vector<std::vector<int64>> counts(n);
    for (int src = 0; src < n; ++src) {
      if ((*all)[src].inputs[0].dims() == 0) return InvalidArgument("all_to_all needs rank >= 1");
      TF_RETURN_IF_ERROR(
          SendCounts((*all)[src].inputs[0], (*all)[src].inputs[1], n, src, &counts[src]));
    }
    const Tensor& in0 = (*all)[0].inputs[0];
    const int64 row_bytes = in0.dim_size(0) ? in0.TotalBytes() / in0.dim_size(0)
                                            : tensorflow::DataTypeSize(dtype_);
    std::vector<Tensor*> outs(n);
    for (int r = 0; r < n; ++r) {
      int64 rows = 0;
      for (int src = 0; src < n; ++src) rows += counts[src][r];
      TensorShape shape = (*all)[r].inputs[0].shape();
      shape.set_dim(0, rows);
      TF_RETURN_IF_ERROR((*all)[r].ctx->allocate_output(0, shape, &outs[r]));
      Tensor* recv = nullptr;
      tensorflow::AllocatorAttributes host;
      host.set_on_host(true);
      TF_RETURN_IF_ERROR((*all)[r].ctx->allocate_output(1, tensorflow::TensorShape({n}), &recv,
                                                        host));
      for (int src = 0; src < n; ++src) recv->vec<int64>()(src) = counts[src][r];
    }
    TF_RETURN_IF_ERROR(NcclStatus(ncclGroupStart(), "ncclGroupStart"));
    for (int r = 0; r < n; ++r) {
      const char* in = (*all)[r].inputs[0].tensor_data().data();
      char* out = const_cast<char*>(outs[r]->tensor_data().data());
      int64 send_off = 0, recv_off = 0;
      for (int peer = 0; peer < n; ++peer) {
        const int64 send = counts[r][peer] * row_bytes, recv = counts[peer][r] * row_bytes;
        if (send) ncclSend(in + send_off, send, ncclChar, peer, comms[r], StreamOf((*all)[r].ctx));
        if (recv) ncclRecv(out + recv_off, recv, ncclChar, peer, comms[r], StreamOf((*all)[r].ctx));
        send_off += send;
        recv_off += recv;
      }
    }
    return NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
  }
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("EplAllReduce").Device(DEVICE_GPU), NcclAllReduce);
REGISTER_KERNEL_BUILDER(Name("EplAllReduceN").Device(DEVICE_GPU), NcclAllReduce);
REGISTER_KERNEL_BUILDER(Name("EplAllGather").Device(DEVICE_GPU).HostMemory("sizes"),
                        NcclAllGather);
REGISTER_KERNEL_BUILDER(Name("EplBroadcast").Device(DEVICE_GPU), NcclBroadcast);
REGISTER_KERNEL_BUILDER(Name("EplReduce").Device(DEVICE_GPU), NcclReduce);
REGISTER_KERNEL_BUILDER(Name("EplReduceScatter").Device(DEVICE_GPU), NcclReduceScatter);
REGISTER_KERNEL_BUILDER(Name("EplAllToAll")
                            .Device(DEVICE_GPU)
                            .HostMemory("split_sizes")
                            .HostMemory("recv_sizes"),
                        NcclAllToAll);

}  // namespace epl

#endif  // EPL_WITH_NCCL
