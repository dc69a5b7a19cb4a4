// What differs between the TensorFlow lines' C++ headers, behind EPL names, so that the
// kernels compile unchanged against TensorFlow 1.15 (C++11) and 2.x (C++17, where
// tensorflow::Status is absl::Status: no Status::OK(), no error_message(), codes are
// absl::StatusCode).  csrc/build.py defines EPL_TF_MAJOR / EPL_TF_MINOR / EPL_TF_VERSION
// (major * 100 + minor) from the installed TensorFlow; this is the one place that
// branches on them.
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
