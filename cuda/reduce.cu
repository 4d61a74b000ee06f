#include "cuda/reduce.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/check.h"

namespace troupe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;
constexpr size_t kVectorBytes = 16;

/// The arithmetic type of a storage type: half and bfloat16 compute in float, which rounds
/// exactly like a native half operation (float has more than 2p + 2 bits for +, /, min, max).
template <class T>
struct Arith {
  using Compute = T;
  __device__ static Compute load(T x) { return x; }
  __device__ static T store(Compute x) { return x; }
};
template <>
struct Arith<__half> {
  using Compute = float;
  __device__ static float load(__half x) { return __half2float(x); }
  __device__ static __half store(float x) { return __float2half_rn(x); }
};
template <>
struct Arith<__nv_bfloat16> {
  using Compute = float;
  __device__ static float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};

__device__ inline float add(float x, float y) { return x + y; }
__device__ inline double add(double x, double y) { return x + y; }
// Integer sums wrap around instead of overflowing (signed overflow is undefined).
__device__ inline int32_t add(int32_t x, int32_t y) {
  return static_cast<int32_t>(static_cast<uint32_t>(x) + static_cast<uint32_t>(y));
}
__device__ inline int64_t add(int64_t x, int64_t y) {
  return static_cast<int64_t>(static_cast<uint64_t>(x) + static_cast<uint64_t>(y));
}

// Binary functors read a and b; a unary one (kBinary false) reads only a.
struct SumFn {
  static constexpr bool kBinary = true;
  template <class C>
  __device__ C operator()(C x, C y) const {
    return add(x, y);
  }
};
struct MinFn {
  static constexpr bool kBinary = true;
  template <class C>
  __device__ C operator()(C x, C y) const {
    return y < x ? y : x;
  }
};
struct MaxFn {
  static constexpr bool kBinary = true;
  template <class C>
  __device__ C operator()(C x, C y) const {
    return x < y ? y : x;
  }
};
/// x / divisor in the arithmetic type; integer division truncates toward zero.
template <class C>
struct DivideFn {
  static constexpr bool kBinary = false;
  C divisor;
  __device__ C operator()(C x, C) const { return x / divisor; }
};

/// 16 bytes of T, loaded and stored as one vector instruction.
template <class T>
struct alignas(kVectorBytes) Vector {
  static constexpr int size = kVectorBytes / sizeof(T);
  T v[size];
};

/// How a range of `count` elements divides into a scalar head, whole 16-byte vectors and a
/// scalar tail. Every pointer must sit at the same offset within 16 bytes for vectors to be
/// used; otherwise the whole range is scalar.
struct Split {
  size_t head = 0;     // elements before the first aligned vector
  size_t vectors = 0;  // whole vectors after the head
};

template <class T>
Split split(size_t count, const void* dst, const void* a, const void* b) {
  const auto offset = reinterpret_cast<uintptr_t>(dst) % kVectorBytes;
  if (offset % sizeof(T) != 0 || reinterpret_cast<uintptr_t>(a) % kVectorBytes != offset ||
      reinterpret_cast<uintptr_t>(b) % kVectorBytes != offset)
    return {count, 0};
  const size_t head = offset == 0 ? 0 : (kVectorBytes - offset) / sizeof(T);
  if (head >= count) return {count, 0};
  return {head, (count - head) / Vector<T>::size};
}

/// dst[i] = f(a[i], b[i]) for i < count: grid-stride over whole vectors, then over the scalar
/// head and tail. A unary f gets a[i] twice and b is not read.
template <class T, class F>
__global__ void elementwise_kernel(T* dst, const T* a, const T* b, size_t count, Split s, F f) {
  using A = Arith<T>;
  using V = Vector<T>;
  const size_t first = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;

  auto* dst_v = reinterpret_cast<V*>(dst + s.head);
  const auto* a_v = reinterpret_cast<const V*>(a + s.head);
  const auto* b_v = reinterpret_cast<const V*>(b + s.head);
  for (size_t i = first; i < s.vectors; i += stride) {
    const V x = a_v[i];
    V y;
    if constexpr (F::kBinary)
      y = b_v[i];
    else
      y = x;
    V r;
#pragma unroll
    for (int k = 0; k < V::size; ++k) r.v[k] = A::store(f(A::load(x.v[k]), A::load(y.v[k])));
    dst_v[i] = r;
  }

  const size_t vector_elements = s.vectors * V::size;
  const size_t scalars = count - vector_elements;
  for (size_t j = first; j < scalars; j += stride) {
    const size_t i = j < s.head ? j : j + vector_elements;
    const auto x = A::load(a[i]);
    if constexpr (F::kBinary)
      dst[i] = A::store(f(x, A::load(b[i])));
    else
      dst[i] = A::store(f(x, x));
  }
}

template <class T, class F>
void launch(T* dst, const T* a, const T* b, size_t count, F f, void* stream) {
  const Split s = split<T>(count, dst, a, b);
  const size_t scalars = count - s.vectors * Vector<T>::size;
  const size_t work = std::max(s.vectors, scalars);
  const int blocks =
      static_cast<int>(std::clamp<size_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
  elementwise_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(dst, a, b, count,
                                                                                 s, f);
  TROUPE_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void reduce_as(void* dst, const void* a, const void* b, size_t count, Op op, void* stream) {
  auto* d = static_cast<T*>(dst);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  switch (op) {
    case Op::sum:
    case Op::avg:
      return launch(d, x, y, count, SumFn{}, stream);
    case Op::min:
      return launch(d, x, y, count, MinFn{}, stream);
    case Op::max:
      return launch(d, x, y, count, MaxFn{}, stream);
  }
  throw std::invalid_argument("troupe::cuda::reduce: op " + std::to_string(static_cast<int>(op)) +
                              " is not a troupe::cuda::Op (expected sum, avg, min or max)");
}

template <class T>
void divide_as(void* data, size_t count, int divisor, void* stream) {
  using C = typename Arith<T>::Compute;
  auto* d = static_cast<T*>(data);
  launch(d, d, d, count, DivideFn<C>{static_cast<C>(divisor)}, stream);
}

[[noreturn]] void throw_bad_dtype(const char* function, DType t) {
  throw std::invalid_argument(std::string("troupe::cuda::") + function + ": dtype " +
                              std::to_string(static_cast<int>(t)) +
                              " is not a troupe::cuda::DType (expected float32, float64, "
                              "float16, bfloat16, int32 or int64)");
}

}  // namespace

void reduce(void* dst, const void* a, const void* b, size_t count, DType t, Op op, void* stream) {
  if (count == 0) return;
  if (dst == nullptr || a == nullptr || b == nullptr)
    throw std::invalid_argument("troupe::cuda::reduce: null buffer with count " +
                                std::to_string(count) + " (expected device pointers dst, a, b)");
  switch (t) {
    case DType::float32:
      return reduce_as<float>(dst, a, b, count, op, stream);
    case DType::float64:
      return reduce_as<double>(dst, a, b, count, op, stream);
    case DType::float16:
      return reduce_as<__half>(dst, a, b, count, op, stream);
    case DType::bfloat16:
      return reduce_as<__nv_bfloat16>(dst, a, b, count, op, stream);
    case DType::int32:
      return reduce_as<int32_t>(dst, a, b, count, op, stream);
    case DType::int64:
      return reduce_as<int64_t>(dst, a, b, count, op, stream);
  }
  throw_bad_dtype("reduce", t);
}

void divide(void* data, size_t count, DType t, int divisor, void* stream) {
  if (divisor < 1)
    throw std::invalid_argument("troupe::cuda::divide: divisor " + std::to_string(divisor) +
                                " (expected >= 1)");
  if (count == 0) return;
  if (data == nullptr)
    throw std::invalid_argument("troupe::cuda::divide: null buffer with count " +
                                std::to_string(count) + " (expected a device pointer)");
  switch (t) {
    case DType::float32:
      return divide_as<float>(data, count, divisor, stream);
    case DType::float64:
      return divide_as<double>(data, count, divisor, stream);
    case DType::float16:
      return divide_as<__half>(data, count, divisor, stream);
    case DType::bfloat16:
      return divide_as<__nv_bfloat16>(data, count, divisor, stream);
    case DType::int32:
      return divide_as<int32_t>(data, count, divisor, stream);
    case DType::int64:
      return divide_as<int64_t>(data, count, divisor, stream);
  }
  throw_bad_dtype("divide", t);
}

bool device_available() {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear the error so later calls do not report it
    return false;
  }
  return devices > 0;
}

}  // namespace troupe::cuda
