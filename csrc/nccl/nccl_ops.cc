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

#include <cuda_runtime.h>
#include <nccl.h>

#include <map>
#include <mutex>
#include <vector>

#include "../collectives.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/lib/core/errors.h"
#include "tensorflow/core/lib/strings/strcat.h"
#include "tensorflow/stream_executor/gpu/gpu_stream.h"
#include "tensorflow/stream_executor/stream.h"

namespace epl {

using tensorflow::DEVICE_GPU;
using tensorflow::OpKernelConstruction;
using tensorflow::errors::Internal;
using tensorflow::errors::InvalidArgument;
using tensorflow::strings::StrCat;

namespace {

std::mutex g_launch_mu;

Status NcclStatus(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return Status::OK();
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

Status NcclOp(ReduceOp op, ncclRedOp_t* out) {
  switch (op) {
    case ReduceOp::kMax: *out = ncclMax; return Status::OK();
    case ReduceOp::kMin: *out = ncclMin; return Status::OK();
    case ReduceOp::kSum: *out = ncclSum; return Status::OK();
    case ReduceOp::kMean:
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= 21000
      *out = ncclAvg;
      return Status::OK();
#else
      return tensorflow::errors::Unimplemented(
          "EPL all_reduce(mean) on GPU needs NCCL >= 2.10 (ncclAvg); use sum.");
#endif
  }
  return Status::OK();
}

int GpuId(OpKernelContext* ctx) {
  return ctx->device()->tensorflow_gpu_device_info()->gpu_id;
}

cudaStream_t StreamOf(OpKernelContext* ctx) {
  return stream_executor::gpu::AsGpuStreamValue(ctx->op_device_context()->stream());
}

// One NCCL communicator per ordered list of GPUs, created once.
Status Comms(const std::vector<Arrival>& all, std::vector<ncclComm_t>** out) {
  static std::mutex mu;
  static auto* cache = new std::map<std::vector<int>, std::vector<ncclComm_t>>();
  std::vector<int> gpus;
  for (const auto& a : all) gpus.push_back(GpuId(a.ctx));
  std::lock_guard<std::mutex> lock(mu);
  auto& comms = (*cache)[gpus];
  if (comms.empty()) {
    comms.resize(gpus.size());
    TF_RETURN_IF_ERROR(NcclStatus(
        ncclCommInitAll(comms.data(), static_cast<int>(gpus.size()), gpus.data()),
        "ncclCommInitAll"));
  }
  *out = &comms;
  return Status::OK();
}

class NcclKernel : public AsyncOpKernel {
 public:
  explicit NcclKernel(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("group", &group_));
    OP_REQUIRES_OK(c, c->GetAttr("rank", &rank_));
    OP_REQUIRES_OK(c, c->GetAttr("size", &size_));
    OP_REQUIRES_OK(c, c->GetAttr("timeout_seconds", &timeout_));
    OP_REQUIRES_OK(c, c->GetAttr("T", &dtype_));
  }
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    Arrival a;
    a.rank = rank_;
    a.ctx = ctx;
    a.done = std::move(done);
    for (int i = 0; i < ctx->num_inputs(); ++i) a.inputs.push_back(ctx->input(i));
    InProcessRendezvous::Get()->Arrive(
        StrCat(group_, "#", generation_.fetch_add(1)), size_, timeout_, Describe(),
        std::move(a), [this](std::vector<Arrival>* all) {
          Status s;
          std::vector<ncclComm_t>* comms = nullptr;
          s = Comms(*all, &comms);
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
  virtual string Describe() const = 0;
  // Allocates every rank's outputs and enqueues the NCCL calls (inside a group).
  virtual Status Launch(std::vector<Arrival>* all, const std::vector<ncclComm_t>& comms) = 0;

  string group_;
  int rank_ = 0, size_ = 1, timeout_ = 600;
  DataType dtype_;
  std::atomic<int64> generation_{0};
};

// All-reduce of every input (EplAllReduce: one; EplAllReduceN: a fused list).
class NcclAllReduce : public NcclKernel {
 public:
  explicit NcclAllReduce(OpKernelConstruction* c) : NcclKernel(c) {
    string name;
    ReduceOp op;
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &name));
    OP_REQUIRES_OK(c, ParseReduceOp(name, &op));
    OP_REQUIRES_OK(c, NcclOp(op, &op_));
  }

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
    return NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
  }

 private:
  ncclRedOp_t op_;
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
    // Equal splits only on GPU (split sizes live in host memory on the CPU path).
    const int n = size_;
    std::vector<Tensor*> outs(n);
    for (int r = 0; r < n; ++r) {
      const Tensor& in = (*all)[r].inputs[0];
      if (in.dim_size(0) % n)
        return InvalidArgument("EPL nccl all_to_all needs rows divisible by ", n);
      TF_RETURN_IF_ERROR((*all)[r].ctx->allocate_output(0, in.shape(), &outs[r]));
      Tensor* recv = nullptr;
      tensorflow::AllocatorAttributes host;
      host.set_on_host(true);
      TF_RETURN_IF_ERROR((*all)[r].ctx->allocate_output(1, tensorflow::TensorShape({n}), &recv,
                                                        host));
      for (int k = 0; k < n; ++k) recv->vec<int64>()(k) = in.dim_size(0) / n;
    }
    TF_RETURN_IF_ERROR(NcclStatus(ncclGroupStart(), "ncclGroupStart"));
    for (int r = 0; r < n; ++r) {
      const Tensor& in = (*all)[r].inputs[0];
      const int64 part = in.TotalBytes() / n;
      for (int peer = 0; peer < n; ++peer) {
        ncclSend(in.tensor_data().data() + peer * part, part, ncclChar, peer, comms[r],
                 StreamOf((*all)[r].ctx));
        ncclRecv(const_cast<char*>(outs[r]->tensor_data().data()) + peer * part, part, ncclChar,
                 peer, comms[r], StreamOf((*all)[r].ctx));
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
REGISTER_KERNEL_BUILDER(Name("EplAllToAll")
                            .Device(DEVICE_GPU)
                            .HostMemory("split_sizes")
                            .HostMemory("recv_sizes"),
                        NcclAllToAll);

}  // namespace epl

#endif  // EPL_WITH_NCCL
