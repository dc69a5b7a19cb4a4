// The reduction kernels of ReduceRange, included twice by collectives.cc: once for the
// build's portable target (x86-64-v2) and once under `#pragma GCC target("avx2")`, chosen
// at run time by what the CPU has (one library for every x86-64 a cluster has; the sum
// loops vectorize 8 floats wide where AVX2 exists).  No include guard on purpose; it
// includes nothing itself (collectives.cc includes what it needs first).

template <typename T> struct Wide { using type = T; };
template <> struct Wide<Eigen::half> { using type = float; };

struct SumF { template <typename T> T operator()(T a, T b) const { return a + b; } };
struct MaxF { template <typename T> T operator()(T a, T b) const { return a > b ? a : b; } };
struct MinF { template <typename T> T operator()(T a, T b) const { return a < b ? a : b; } };

// Reduce block by block so the output block stays in L1 while every input is
// streamed once; up to four inputs per pass so the loop vectorizes.
template <typename T, typename F>
void ReduceTyped(const std::vector<const void*>& ins, void* out_v, int64 begin, int64 end,
                 F f, bool mean) {
  using W = typename Wide<T>::type;
  const int n = static_cast<int>(ins.size());
  T* out = static_cast<T*>(out_v);   // (may alias ins[0]: not __restrict)
  const int64 kBlock = 4096;
  for (int64 b = begin; b < end; b += kBlock) {
    const int64 e = std::min(end, b + kBlock);
    const T* a0 = static_cast<const T*>(ins[0]);
    int k = 1;
    if (n == 1) {
      if (out != a0) std::memcpy(out + b, a0 + b, (e - b) * sizeof(T));
    } else if (n >= 4) {
      const T* a1 = static_cast<const T*>(ins[1]);
      const T* a2 = static_cast<const T*>(ins[2]);
      const T* a3 = static_cast<const T*>(ins[3]);
      for (int64 i = b; i < e; ++i)
        out[i] = T(f(f(W(a0[i]), W(a1[i])), f(W(a2[i]), W(a3[i]))));
      k = 4;
    } else {
      const T* a1 = static_cast<const T*>(ins[1]);
      for (int64 i = b; i < e; ++i) out[i] = T(f(W(a0[i]), W(a1[i])));
      k = 2;
    }
    for (; k + 1 < n; k += 2) {
      const T* x = static_cast<const T*>(ins[k]);
      const T* y = static_cast<const T*>(ins[k + 1]);
      for (int64 i = b; i < e; ++i) out[i] = T(f(W(out[i]), f(W(x[i]), W(y[i]))));
    }
    for (; k < n; ++k) {
      const T* x = static_cast<const T*>(ins[k]);
      for (int64 i = b; i < e; ++i) out[i] = T(f(W(out[i]), W(x[i])));
    }
    if (mean) {
      const W d = static_cast<W>(n);
      for (int64 i = b; i < e; ++i) out[i] = T(W(out[i]) / d);
    }
  }
}

template <typename T>
void ReduceDispatch(ReduceOp op, const std::vector<const void*>& ins, void* out, int64 begin,
                    int64 end) {
  switch (op) {
    case ReduceOp::kSum: ReduceTyped<T>(ins, out, begin, end, SumF(), false); break;
    case ReduceOp::kMean: ReduceTyped<T>(ins, out, begin, end, SumF(), true); break;
    case ReduceOp::kMax: ReduceTyped<T>(ins, out, begin, end, MaxF(), false); break;
    case ReduceOp::kMin: ReduceTyped<T>(ins, out, begin, end, MinF(), false); break;
  }
}

void ReduceRangeImpl(DataType dtype, ReduceOp op, const std::vector<const void*>& ins, void* out,
                 int64 begin, int64 end) {
  switch (dtype) {
    case tensorflow::DT_HALF: ReduceDispatch<Eigen::half>(op, ins, out, begin, end); break;
    case tensorflow::DT_FLOAT: ReduceDispatch<float>(op, ins, out, begin, end); break;
    case tensorflow::DT_DOUBLE: ReduceDispatch<double>(op, ins, out, begin, end); break;
    case tensorflow::DT_INT32: ReduceDispatch<tensorflow::int32>(op, ins, out, begin, end); break;
    case tensorflow::DT_INT64: ReduceDispatch<tensorflow::int64>(op, ins, out, begin, end); break;
    default: break;  // the op registrations admit only the types above
  }
}
