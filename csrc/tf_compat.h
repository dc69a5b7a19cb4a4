// What differs between the TensorFlow lines' C++ headers, behind EPL names, so that the
// kernels compile unchanged against TensorFlow 1.15 (C++11) and 2.x (C++17, where
// tensorflow::Status is absl::Status: no Status::OK(), no error_message(), codes are
// absl::StatusCode).  csrc/build.py defines EPL_TF_MAJOR / EPL_TF_MINOR / EPL_TF_VERSION
// (major * 100 + minor) from the installed TensorFlow; this is the one place that
// branches on them.
//
// The GPU part (what the NCCL kernels need from TensorFlow's stream executor) is compiled
// only where a source defines EPL_TF_COMPAT_GPU before its first include
// (csrc/nccl/nccl_ops.cc), so the CPU sources never parse the stream executor's headers.
// `make gpu-ops-check` compiles it against TensorFlow 1.15 and 2.21 only; the bounds in
// between (209, 216) are where those APIs changed as far as we know, not compile-checked.
#ifndef EPL_CSRC_TF_COMPAT_H_
#define EPL_CSRC_TF_COMPAT_H_

#include <string>

#include "tensorflow/core/lib/core/status.h"

#ifndef EPL_TF_MAJOR
#define EPL_TF_MAJOR 1
#define EPL_TF_MINOR 15
#endif
#ifndef EPL_TF_VERSION
#define EPL_TF_VERSION (EPL_TF_MAJOR * 100 + EPL_TF_MINOR)
#endif

namespace epl {

// The success status.
inline ::tensorflow::Status OkStatus() {
#if EPL_TF_VERSION >= 213
  return ::absl::OkStatus();
#else
  return ::tensorflow::Status::OK();
#endif
}

// A status of the numeric code ``code`` (a tensorflow::error::Code value, as carried
// between processes) with ``message``.
inline ::tensorflow::Status MakeStatus(int code, const std::string& message) {
#if EPL_TF_VERSION >= 213
  return ::absl::Status(static_cast<::absl::StatusCode>(code), message);
#else
  return ::tensorflow::Status(static_cast<::tensorflow::error::Code>(code), message);
#endif
}

// A status's message, as a std::string.
inline std::string StatusMessage(const ::tensorflow::Status& s) {
#if EPL_TF_VERSION >= 213
  return std::string(s.message());
#else
  return s.error_message();
#endif
}

}  // namespace epl

#endif  // EPL_CSRC_TF_COMPAT_H_

// ---- GPU: the NCCL kernels' view of a GPU op's device and stream -----------------------
#if defined(EPL_TF_COMPAT_GPU) && !defined(EPL_CSRC_TF_COMPAT_GPU_H_)
#define EPL_CSRC_TF_COMPAT_GPU_H_

#include <cstdint>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/platform/stream_executor.h"  // se::Stream, on both lines
#if EPL_TF_VERSION < 216
// Before se::Stream::platform_specific_handle() (in 2.21; 2.16 is our estimate of its
// arrival) the CUDA stream is reached through the stream's implementation, declared in
// an internal header that moved with the stream executor (tensorflow/ ->
// tensorflow/compiler/xla/ -> xla/).
#if __has_include("tensorflow/stream_executor/stream_executor_internal.h")
#include "tensorflow/stream_executor/stream_executor_internal.h"
#elif __has_include("tensorflow/compiler/xla/stream_executor/stream_executor_internal.h")
#include "tensorflow/compiler/xla/stream_executor/stream_executor_internal.h"
#else
#include "xla/stream_executor/stream_executor_internal.h"
#endif
#endif

namespace epl {

// A typed view of device memory for the stream executor's BLAS calls: DeviceMemory<T> on
// TF 1.15, DeviceAddress<T> on 2.21 (where DeviceMemory<T> is a deprecated alias of it).
#if EPL_TF_VERSION >= 221
template <typename T>
using GpuMemory = ::stream_executor::DeviceAddress<T>;
using GpuMemoryBase = ::stream_executor::DeviceAddressBase;
#else
template <typename T>
using GpuMemory = ::stream_executor::DeviceMemory<T>;
using GpuMemoryBase = ::stream_executor::DeviceMemoryBase;
#endif

// The stream TensorFlow runs this GPU op's kernels on (its compute stream): NCCL calls
// enqueued there are ordered with the op's producers and consumers.
inline ::stream_executor::Stream* GpuStream(::tensorflow::OpKernelContext* ctx) {
  return ctx->op_device_context()->stream();
}

// That stream's CUDA handle (a cudaStream_t; void* here, so this header needs no CUDA
// header).  TF 1.15's gpu_stream.h is not among its installed headers, hence the
// implementation's accessor there.
inline void* GpuStreamHandle(::tensorflow::OpKernelContext* ctx) {
#if EPL_TF_VERSION >= 216
  return GpuStream(ctx)->platform_specific_handle().stream;
#else
  return GpuStream(ctx)->implementation()->GpuStreamHack();
#endif
}

// The CUDA device ordinal of the GPU this op runs on (TensorFlow's platform GPU id, the
// one NCCL's communicators are created for).  TF 2.9 renamed the device's GPU info.
inline int GpuDeviceOrdinal(::tensorflow::OpKernelContext* ctx) {
#if EPL_TF_VERSION >= 209
  return ctx->device()->tensorflow_accelerator_device_info()->gpu_id;
#else
  return ctx->device()->tensorflow_gpu_device_info()->gpu_id;
#endif
}

// x[0 .. count) *= alpha in place on `stream` with the BLAS TensorFlow loaded for it
// (scal).  Calls BlasSupport directly: Stream::ThenBlasScal, TF 1.15's way, is gone by
// 2.21, and BlasSupport::DoBlasScal(stream, ...) is the same call on both lines.  False
// when there is no BLAS for the stream or the call was refused.
template <typename T>
inline bool GpuBlasScal(::stream_executor::Stream* stream, uint64_t count, T alpha,
                        void* data) {
  auto* blas = stream->parent()->AsBlas();
  if (blas == nullptr) return false;
  GpuMemory<T> x(GpuMemoryBase(data, count * sizeof(T)));
  return blas->DoBlasScal(stream, count, alpha, &x, 1);
}

}  // namespace epl

#endif  // EPL_TF_COMPAT_GPU && !EPL_CSRC_TF_COMPAT_GPU_H_
