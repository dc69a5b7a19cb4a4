// EplBuildInfo: which communication backends this library was built with.
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/shape_inference.h"

#ifndef EPL_BACKENDS
#define EPL_BACKENDS "cpu"
#endif

namespace epl {
using namespace tensorflow;  // NOLINT

REGISTER_OP("EplBuildInfo")
    .Output("backends: string")
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc("Comma-separated communication backends compiled into libepl_ops.so.");

class EplBuildInfoOp : public OpKernel {
 public:
  explicit EplBuildInfoOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<tstring>()() = EPL_BACKENDS;
  }
};
REGISTER_KERNEL_BUILDER(Name("EplBuildInfo").Device(DEVICE_CPU), EplBuildInfoOp);

}  // namespace epl
