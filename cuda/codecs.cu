#include "cuda/codecs.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <thrust/iterator/counting_iterator.h>
#include <cub/device/device_select.cuh>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/check.h"
#include "cuda/minmax_codes.h"

// Bit-identity with the CPU twins: every float operation below names its rounding (__fadd_rn,
// __fmul_rn, ...), which nvcc never fuses into a multiply-add, because GCC builds comm/codecs
// without FMA; and every reduction runs in the CPU's order, or in one whose result does not
// depend on the order.

namespace troupe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr size_t kMaxBlocks = 4096;

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

/// Blocks for a grid-stride loop over `work` items, one per thread.
unsigned grid_for(size_t work) {
  return static_cast<unsigned>(std::clamp<size_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

[[noreturn]] void bad_argument(const char* function, const std::string& what) {
  throw std::invalid_argument(std::string("troupe::cuda::") + function + ": " + what);
}

std::string pointer_text(const void* p) {
  char text[32];
  std::snprintf(text, sizeof(text), "%p", p);
  return text;
}

/// Checks that `p`, holding `count` elements, is a usable device pointer: not null unless count is
/// 0, and aligned to its element type.
void require_buffer(const char* function, const char* name, const void* p, size_t count,
                    const char* count_name, size_t alignment) {
  if (count == 0) return;
  if (p == nullptr)
    bad_argument(function, std::string(name) + " is null with " + count_name + " " +
                               std::to_string(count) + " (expected a device buffer)");
  if (reinterpret_cast<uintptr_t>(p) % alignment != 0)
    bad_argument(function, std::string(name) + " " + pointer_text(p) + " is not " +
                               std::to_string(alignment) + "-byte aligned (expected a buffer of " +
                               std::to_string(alignment) + "-byte elements)");
}

void require_block(const char* function, size_t block) {
  if (block == 0) bad_argument(function, "block 0 (expected >= 1)");
}

void check_launch() { TROUPE_CUDA_CHECK(cudaGetLastError()); }

/// Device memory for one call's scratch, from the stream-ordered pool; freed in stream order, so
/// the kernels enqueued before the destructor still see it.
class Scratch {
 public:
  Scratch(size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0) TROUPE_CUDA_CHECK(cudaMallocAsync(&data_, bytes, stream_));
  }
  ~Scratch() {
    if (data_ != nullptr) cudaFreeAsync(data_, stream_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <class T>
  T* at(size_t byte_offset = 0) const {
    return reinterpret_cast<T*>(static_cast<unsigned char*>(data_) + byte_offset);
  }

 private:
  cudaStream_t stream_;
  void* data_ = nullptr;
};

__device__ inline size_t thread_first() {
  return blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
}
__device__ inline size_t grid_stride() { return static_cast<size_t>(gridDim.x) * blockDim.x; }

// ---- float16 / bfloat16 ----------------------------------------------------------------------

__device__ inline float quiet(float x) { return __uint_as_float(__float_as_uint(x) | 0x400000u); }

/// a * b with x86's NaN results, which the GPU's canonical NaN would not give: a NaN operand comes
/// out quietened (a's when both are), an invalid product (0 * inf) is the default NaN 0xffc00000.
__device__ inline float mul_x86(float a, float b) {
  if (isnan(a)) return quiet(a);
  if (isnan(b)) return quiet(b);
  const float p = __fmul_rn(a, b);
  return isnan(p) ? __uint_as_float(0xffc00000u) : p;
}

/// float -> float16, round to nearest even; a NaN keeps its sign and the upper bits of its payload,
/// as F16C's vcvtps2ph does (the GPU's conversion would give its canonical NaN).
__device__ inline uint16_t to_half(float x) {
  const uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u | ((u & 0x7fffffu) >> 13));
  return __half_as_ushort(__float2half_rn(x));
}

/// float16 -> float, exact; a NaN keeps its payload, as comm::half_to_float does.
__device__ inline float from_half(uint16_t h) {
  if ((h & 0x7fffu) > 0x7c00u)
    return __uint_as_float((static_cast<uint32_t>(h & 0x8000u) << 16) | 0x7f800000u |
                           (static_cast<uint32_t>(h & 0x3ffu) << 13));
  return __half2float(__ushort_as_half(h));
}

/// comm's float -> bfloat16: round to nearest even, a NaN kept quiet.
__device__ inline uint16_t to_bfloat16(float x) {
  const uint32_t u = __float_as_uint(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

__device__ inline float from_bfloat16(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

template <bool kBfloat16>
__device__ inline uint32_t encode_one(float x, float scale) {
  const float y = mul_x86(x, scale);
  return kBfloat16 ? to_bfloat16(y) : to_half(y);
}
template <bool kBfloat16>
__device__ inline float decode_one(uint32_t h, float scale) {
  const auto bits = static_cast<uint16_t>(h);
  return mul_x86(kBfloat16 ? from_bfloat16(bits) : from_half(bits), scale);
}

template <bool kBfloat16>
__global__ void encode_half_kernel(const float* src, size_t n, float scale, uint16_t* dst) {
  for (size_t i = thread_first(); i < n; i += grid_stride())
    dst[i] = static_cast<uint16_t>(encode_one<kBfloat16>(src[i], scale));
}

/// The same conversion four elements a thread, in 16-byte loads and 8-byte stores (element 0 in
/// the low half of the first word): for the bulk of buffers aligned to them.
template <bool kBfloat16>
__global__ void encode_half4_kernel(const float4* src, size_t quads, float scale, uint2* dst) {
  for (size_t q = thread_first(); q < quads; q += grid_stride()) {
    const float4 x = src[q];
    dst[q] =
        make_uint2(encode_one<kBfloat16>(x.x, scale) | encode_one<kBfloat16>(x.y, scale) << 16,
                   encode_one<kBfloat16>(x.z, scale) | encode_one<kBfloat16>(x.w, scale) << 16);
  }
}

template <bool kBfloat16>
__global__ void decode_half_kernel(const uint16_t* src, size_t n, float scale, float* dst) {
  for (size_t i = thread_first(); i < n; i += grid_stride())
    dst[i] = decode_one<kBfloat16>(src[i], scale);
}

template <bool kBfloat16>
__global__ void decode_half4_kernel(const uint2* src, size_t quads, float scale, float4* dst) {
  for (size_t q = thread_first(); q < quads; q += grid_stride()) {
    const uint2 h = src[q];
    dst[q] =
        make_float4(decode_one<kBfloat16>(h.x, scale), decode_one<kBfloat16>(h.x >> 16, scale),
                    decode_one<kBfloat16>(h.y, scale), decode_one<kBfloat16>(h.y >> 16, scale));
  }
}

/// Whole groups of four elements that the vector kernels take (0 when `wide` and `narrow`, the
/// float and 16-bit buffers, are not aligned to 16 and 8 bytes); the rest is the scalar kernel's.
size_t quads_of(const void* wide, const void* narrow, size_t n) {
  const bool aligned =
      reinterpret_cast<uintptr_t>(wide) % 16 == 0 && reinterpret_cast<uintptr_t>(narrow) % 8 == 0;
  return aligned ? n / 4 : 0;
}

template <bool kBfloat16>
void encode_16(const char* function, const float* src, size_t n, float scale, uint16_t* dst,
               void* stream) {
  require_buffer(function, "src", src, n, "n", 4);
  require_buffer(function, "dst", dst, n, "n", 2);
  if (n == 0) return;
  const size_t quads = quads_of(src, dst, n);
  if (quads)
    encode_half4_kernel<kBfloat16><<<grid_for(quads), kThreads, 0, as_stream(stream)>>>(
        reinterpret_cast<const float4*>(src), quads, scale, reinterpret_cast<uint2*>(dst));
  if (4 * quads < n)
    encode_half_kernel<kBfloat16><<<grid_for(n - 4 * quads), kThreads, 0, as_stream(stream)>>>(
        src + 4 * quads, n - 4 * quads, scale, dst + 4 * quads);
  check_launch();
}

template <bool kBfloat16>
void decode_16(const char* function, const uint16_t* src, size_t n, float scale, float* dst,
               void* stream) {
  require_buffer(function, "src", src, n, "n", 2);
  require_buffer(function, "dst", dst, n, "n", 4);
  if (n == 0) return;
  const size_t quads = quads_of(dst, src, n);
  if (quads)
    decode_half4_kernel<kBfloat16><<<grid_for(quads), kThreads, 0, as_stream(stream)>>>(
        reinterpret_cast<const uint2*>(src), quads, scale, reinterpret_cast<float4*>(dst));
  if (4 * quads < n)
    decode_half_kernel<kBfloat16><<<grid_for(n - 4 * quads), kThreads, 0, as_stream(stream)>>>(
        src + 4 * quads, n - 4 * quads, scale, dst + 4 * quads);
  check_launch();
}

// ---- min-max blocks, 4- and 8-bit codes --------------------------------------------------------
//
// A block is handled by a group of threads (a warp for small blocks, the CTA from kCtaBlock
// elements up): the group finds the block's min and max, keeping among equal values the one of
// lowest priority in the CPU's search (minmax_codes.h), then each thread computes code bytes
// u = rank, rank + group, ... The search is the same at both widths; Codes<bits> is the packing.

using minmax::better;
using minmax::Codes;
using minmax::Pick;

__device__ inline Pick shuffle_down(Pick p, int delta) {
  return {__shfl_down_sync(0xffffffffu, p.value, delta),
          __shfl_down_sync(0xffffffffu, static_cast<unsigned long long>(p.priority), delta)};
}
__device__ inline Pick shuffle_from(Pick p, int lane) {
  return {__shfl_sync(0xffffffffu, p.value, lane),
          __shfl_sync(0xffffffffu, static_cast<unsigned long long>(p.priority), lane)};
}

/// Threads that share one min-max block: a warp (kGroup 32, for small blocks) or the whole CTA.
template <int kGroup>
struct Group {
  static constexpr int kPerCta = kThreads / kGroup;
  __device__ static unsigned rank() { return threadIdx.x % kGroup; }
  __device__ static size_t first_block() {
    return blockIdx.x * static_cast<size_t>(kPerCta) + threadIdx.x / kGroup;
  }
  __device__ static size_t block_stride() { return static_cast<size_t>(gridDim.x) * kPerCta; }
};

/// Combines every thread's candidates of the group; all of its threads get the result.
template <int kGroup>
__device__ void reduce_range(Pick& lo, Pick& hi) {
  for (int delta = kWarp / 2; delta > 0; delta /= 2) {
    lo = better<false>(lo, shuffle_down(lo, delta));
    hi = better<true>(hi, shuffle_down(hi, delta));
  }
  if constexpr (kGroup == kWarp) {
    lo = shuffle_from(lo, 0);
    hi = shuffle_from(hi, 0);
  } else {
    constexpr int kWarps = kGroup / kWarp;
    __shared__ Pick lows[kWarps], highs[kWarps];
    const int warp = threadIdx.x / kWarp;
    if (threadIdx.x % kWarp == 0) {
      lows[warp] = lo;
      highs[warp] = hi;
    }
    __syncthreads();
    lo = lows[0];
    hi = highs[0];
    for (int w = 1; w < kWarps; ++w) {
      lo = better<false>(lo, lows[w]);
      hi = better<true>(hi, highs[w]);
    }
    __syncthreads();  // before the next block overwrites them
  }
}

/// The min and max of x[0, len) as the CPU picks them, given to every thread of the group.
template <int kGroup>
__device__ void block_range(const float* x, size_t len, float& lo_value, float& hi_value) {
  const float inf = __uint_as_float(0x7f800000u);
  Pick lo{inf, ~uint64_t{0}}, hi{-inf, ~uint64_t{0}};
  for (size_t j = Group<kGroup>::rank(); j < len; j += kGroup) minmax::offer(x[j], j, len, lo, hi);
  reduce_range<kGroup>(lo, hi);
  lo_value = lo.value;
  hi_value = hi.value;
}

// Header floats are read and written a byte at a time: the encoding may start at any address.
__device__ inline void store_float(uint8_t* p, float x) {
  const uint32_t u = __float_as_uint(x);
  for (int b = 0; b < 4; ++b) p[b] = static_cast<uint8_t>(u >> (8 * b));
}
__device__ inline float load_float(const uint8_t* p) {
  uint32_t u = 0;
  for (int b = 0; b < 4; ++b) u |= static_cast<uint32_t>(p[b]) << (8 * b);
  return __uint_as_float(u);
}

template <class C, int kGroup>
__global__ void minmax_encode_kernel(const float* src, size_t n, size_t block, size_t blocks,
                                     uint8_t* out) {
  using G = Group<kGroup>;
  uint8_t* codes = out + blocks * 2 * sizeof(float);
  for (size_t b = G::first_block(); b < blocks; b += G::block_stride()) {
    const size_t begin = b * block;
    const size_t len = min(block, n - begin);
    const float* x = src + begin;
    float lo, hi;
    block_range<kGroup>(x, len, lo, hi);
    if (G::rank() == 0) {
      store_float(out + b * 2 * sizeof(float), lo);
      store_float(out + b * 2 * sizeof(float) + sizeof(float), hi);
    }
    const float inv = minmax::inverse_step<C::kMaxCode>(lo, hi);
    // block is a multiple of kCodesPerByte (checked), so every block's codes start on a byte.
    uint8_t* q = codes + begin / C::kCodesPerByte;
    const size_t bytes = minmax::code_bytes<C>(len);
    for (size_t u = G::rank(); u < bytes; u += kGroup) q[u] = C::encode_byte(x, len, u, lo, inv);
  }
}

template <class C, int kGroup, bool kAdd>
__global__ void minmax_decode_kernel(const uint8_t* in, size_t n, size_t block, size_t blocks,
                                     float* dst) {
  using G = Group<kGroup>;
  const uint8_t* codes = in + blocks * 2 * sizeof(float);
  for (size_t b = G::first_block(); b < blocks; b += G::block_stride()) {
    const size_t begin = b * block;
    const size_t len = min(block, n - begin);
    const float lo = load_float(in + b * 2 * sizeof(float));
    const float hi = load_float(in + b * 2 * sizeof(float) + sizeof(float));
    const float step = minmax::step<C::kMaxCode>(lo, hi);
    const uint8_t* q = codes + begin / C::kCodesPerByte;
    const size_t bytes = minmax::code_bytes<C>(len);
    for (size_t u = G::rank(); u < bytes; u += kGroup)
      C::template decode_byte<kAdd>(q[u], len, u, lo, step, dst + begin);
  }
}

// From this block size on, a whole CTA shares a block; below it, a warp.
constexpr size_t kCtaBlock = 2048;

/// Launches `kernel<kGroup>` with enough groups for every block.
template <int kGroup, class Kernel, class... Args>
void launch_groups(Kernel kernel, size_t blocks, void* stream, Args... args) {
  const size_t ctas = (blocks + Group<kGroup>::kPerCta - 1) / Group<kGroup>::kPerCta;
  const auto grid = static_cast<unsigned>(std::clamp<size_t>(ctas, 1, size_t{1} << 16));
  kernel<<<grid, kThreads, 0, as_stream(stream)>>>(args...);
  check_launch();
}

/// Calls use(Codes<4>{}) or use(Codes<8>{}); any other width is refused naming it.
template <class Use>
auto with_codes(const char* function, MinMaxBits bits, Use&& use) {
  switch (bits) {
    case MinMaxBits::four:
      return use(Codes<4>{});
    case MinMaxBits::eight:
      return use(Codes<8>{});
  }
  bad_argument(function, "bits " + std::to_string(static_cast<int>(bits)) + " (expected 4 or 8)");
}

/// block >= 1, and a whole number of code bytes: even with 4-bit codes.
template <class C>
void require_minmax_block(const char* function, size_t block) {
  require_block(function, block);
  if (block % C::kCodesPerByte != 0)
    bad_argument(function, "block " + std::to_string(block) + " with " +
                               std::to_string(8 / C::kCodesPerByte) +
                               "-bit codes (expected a multiple of " +
                               std::to_string(C::kCodesPerByte) + ")");
}

template <bool kAdd>
void minmax_decode_any(const char* function, MinMaxBits bits, const uint8_t* in, size_t n,
                       size_t block, float* dst, void* stream) {
  with_codes(function, bits, [&](auto codes) {
    using C = decltype(codes);
    require_minmax_block<C>(function, block);
    require_buffer(function, "in", in, n, "n", 1);
    require_buffer(function, "dst", dst, n, "n", 4);
    if (n == 0) return;
    const size_t blocks = (n + block - 1) / block;
    if (block >= kCtaBlock)
      launch_groups<kThreads>(minmax_decode_kernel<C, kThreads, kAdd>, blocks, stream, in, n, block,
                              blocks, dst);
    else
      launch_groups<kWarp>(minmax_decode_kernel<C, kWarp, kAdd>, blocks, stream, in, n, block,
                           blocks, dst);
  });
}

// ---- signs -----------------------------------------------------------------------------------

__device__ inline float abs_bits(float x) {
  return __uint_as_float(__float_as_uint(x) & 0x7fffffffu);
}

__device__ inline float scale_value(const Scale& s) {
  return s.device != nullptr ? __fmul_rn(*s.device, s.factor) : s.factor;
}

/// A warp packs 32 elements into 4 bytes: its ballot is the little-endian word of their bits.
__global__ void sign_pack_kernel(const float* src, size_t n, uint8_t* bits) {
  const unsigned lane = threadIdx.x % kWarp;
  const size_t bytes = (n + 7) / 8;
  const size_t warps = static_cast<size_t>(gridDim.x) * (kThreads / kWarp);
  for (size_t w = blockIdx.x * static_cast<size_t>(kThreads / kWarp) + threadIdx.x / kWarp;
       w * kWarp < n; w += warps) {
    const size_t i = w * kWarp + lane;
    const unsigned word = __ballot_sync(0xffffffffu, i < n && src[i] < 0.0f);
    if (lane < 4 && 4 * w + lane < bytes)
      bits[4 * w + lane] = static_cast<uint8_t>(word >> (8 * lane));
  }
}

template <bool kAdd>
__global__ void sign_unpack_kernel(const uint8_t* bits, size_t n, Scale s, float* dst) {
  const float scale = scale_value(s);
  for (size_t i = thread_first(); i < n; i += grid_stride()) {
    const float v = (bits[i / 8] >> (i % 8)) & 1u ? -scale : scale;
    dst[i] = kAdd ? __fadd_rn(dst[i], v) : v;
  }
}

/// One byte of bits, eight elements, a thread: two 16-byte stores (and loads, adding), for the
/// bulk of a 16-byte aligned dst.
template <bool kAdd>
__device__ inline float4 unpack4(unsigned byte, int shift, float scale, float4 old) {
  const float a = (byte >> shift) & 1u ? -scale : scale;
  const float b = (byte >> (shift + 1)) & 1u ? -scale : scale;
  const float c = (byte >> (shift + 2)) & 1u ? -scale : scale;
  const float d = (byte >> (shift + 3)) & 1u ? -scale : scale;
  if (!kAdd) return make_float4(a, b, c, d);
  return make_float4(__fadd_rn(old.x, a), __fadd_rn(old.y, b), __fadd_rn(old.z, c),
                     __fadd_rn(old.w, d));
}

template <bool kAdd>
__global__ void sign_unpack8_kernel(const uint8_t* bits, size_t bytes, Scale s, float4* dst) {
  const float scale = scale_value(s);
  for (size_t b = thread_first(); b < bytes; b += grid_stride()) {
    const unsigned byte = bits[b];
    float4 lo{}, hi{};
    if (kAdd) {
      lo = dst[2 * b];
      hi = dst[2 * b + 1];
    }
    dst[2 * b] = unpack4<kAdd>(byte, 0, scale, lo);
    dst[2 * b + 1] = unpack4<kAdd>(byte, 4, scale, hi);
  }
}

template <bool kAdd>
void sign_unpack_any(const char* function, const uint8_t* bits, size_t n, Scale s, float* dst,
                     void* stream) {
  require_buffer(function, "bits", bits, n, "n", 1);
  require_buffer(function, "dst", dst, n, "n", 4);
  require_buffer(function, "s.device", s.device, s.device ? 1 : 0, "count", 4);
  if (n == 0) return;
  const size_t bytes = reinterpret_cast<uintptr_t>(dst) % 16 == 0 ? n / 8 : 0;
  if (bytes)
    sign_unpack8_kernel<kAdd><<<grid_for(bytes), kThreads, 0, as_stream(stream)>>>(
        bits, bytes, s, reinterpret_cast<float4*>(dst));
  if (8 * bytes < n)
    sign_unpack_kernel<kAdd><<<grid_for(n - 8 * bytes), kThreads, 0, as_stream(stream)>>>(
        bits + bytes, n - 8 * bytes, s, dst + 8 * bytes);
  check_launch();
}

constexpr size_t kMeanChunk = 1024;  // comm::mean_abs's chunk: 16 lanes of 64 additions
constexpr size_t kMeanGroup = 64;    // comm::mean_abs's tree over the chunks' sums

/// One chunk per 16 lanes: lane L sums |x| of elements L, L + 16, ... in order, as the CPU's lane
/// L does; then s[c] = (a[c] + b[c]) + (c[c] + d[c]) and the chunk's double sum, as the CPU does.
__global__ void mean_abs_chunks_kernel(const float* src, size_t chunks, double* sums) {
  const unsigned column = threadIdx.x % 16;
  const size_t warps = static_cast<size_t>(gridDim.x) * (kThreads / kWarp);
  for (size_t w = blockIdx.x * static_cast<size_t>(kThreads / kWarp) + threadIdx.x / kWarp;
       2 * w < chunks; w += warps) {
    const size_t chunk = 2 * w + (threadIdx.x % kWarp) / 16;
    const bool valid = chunk < chunks;
    float acc = 0.0f;
    if (valid) {
      const float* x = src + chunk * kMeanChunk + column;
      for (size_t t = 0; t < kMeanChunk / 16; ++t) acc = __fadd_rn(acc, abs_bits(x[16 * t]));
    }
    const float b = __shfl_down_sync(0xffffffffu, acc, 4, 16);
    const float c = __shfl_down_sync(0xffffffffu, acc, 8, 16);
    const float d = __shfl_down_sync(0xffffffffu, acc, 12, 16);
    const float s = __fadd_rn(__fadd_rn(acc, b), __fadd_rn(c, d));  // s[column], column < 4
    const float s1 = __shfl_down_sync(0xffffffffu, s, 1, 16);
    const float s2 = __shfl_down_sync(0xffffffffu, s, 2, 16);
    const float s3 = __shfl_down_sync(0xffffffffu, s, 3, 16);
    if (valid && column == 0)
      sums[chunk] =
          __dadd_rn(static_cast<double>(__fadd_rn(s, s1)), static_cast<double>(__fadd_rn(s2, s3)));
  }
}

/// One level of the CPU's tree over the chunks' sums: out[g] = in[64 g] + ... + in[64 g + 63]
/// (the last group possibly short), added in order by one thread.
__global__ void mean_abs_group_kernel(const double* in, size_t m, double* out) {
  const size_t groups = (m + kMeanGroup - 1) / kMeanGroup;
  for (size_t g = thread_first(); g < groups; g += grid_stride()) {
    const size_t end = min(m, (g + 1) * kMeanGroup);
    double sum = 0.0;
    for (size_t j = g * kMeanGroup; j < end; ++j) sum = __dadd_rn(sum, in[j]);
    out[g] = sum;
  }
}

/// The tree's one value (none without a whole chunk), then the tail in float, and the mean.
__global__ void mean_abs_finish_kernel(const double* sum, bool have_sum, const float* tail,
                                       size_t tail_count, size_t n, float* result) {
  double total = have_sum ? *sum : 0.0;
  float rest = 0.0f;
  for (size_t i = 0; i < tail_count; ++i) rest = __fadd_rn(rest, abs_bits(tail[i]));
  total = __dadd_rn(total, static_cast<double>(rest));
  *result = __double2float_rn(__ddiv_rn(total, static_cast<double>(n)));
}

__global__ void sign_in_place_kernel(float* data, size_t n) {
  for (size_t i = thread_first(); i < n; i += grid_stride()) {
    const float x = data[i];
    data[i] = x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
  }
}

/// The CPU's e = (-s) * (+-1) + x: +s where x < 0, -s elsewhere, plus x.
__global__ void sign_error_feedback_kernel(const float* x, size_t n, Scale s, float* error) {
  const float scale = scale_value(s);
  for (size_t i = thread_first(); i < n; i += grid_stride()) {
    const float v = x[i];
    error[i] = __fadd_rn(v, v < 0.0f ? scale : -scale);
  }
}

// ---- sparsification --------------------------------------------------------------------------
//
// top_k ranks elements by a 63-bit composite, |x|'s bits above the inverted index: larger |x|
// first (NaN above infinity, +0 equal to -0, as the CPU's abs_key), then the lower index. It has
// no ties, so the k-th largest composite C is unique and the CPU's answer is exactly
// {i : composite(i) >= C}, which an order-keeping compaction writes in ascending order. C is
// found eight bits at a time from the top (a radix select); the selection state stays on the
// device, so no pass waits for the host.

__device__ inline uint64_t composite(float x, uint32_t i) {
  return static_cast<uint64_t>(__float_as_uint(x) & 0x7fffffffu) << 32 | (0xffffffffu - i);
}

struct SelectState {
  unsigned long long histogram[256];  // this pass's digit counts among the matching elements
  unsigned long long prefix;          // C's bits decided so far (the rest 0)
  unsigned long long remaining;       // C's rank among the elements matching prefix, from 1
  int done;                           // every element matching prefix is selected: C = prefix
  long long selected;                 // the compaction's count (k)
};

constexpr int kSelectPasses = 8;

__device__ inline int select_shift(int pass) { return 56 - 8 * pass; }

__global__ void select_init_kernel(SelectState* s, size_t k) {
  for (int d = threadIdx.x; d < 256; d += blockDim.x) s->histogram[d] = 0;
  if (threadIdx.x == 0) {
    s->prefix = 0;
    s->remaining = k;
    s->done = 0;
    s->selected = 0;
  }
}

/// Counts the digit of this pass among the elements whose higher digits are the prefix. A warp
/// adds equal digits together (__match_any_sync), as magnitudes crowd into few bins.
__global__ void select_histogram_kernel(const float* src, size_t n, int pass, SelectState* s) {
  if (s->done) return;
  __shared__ unsigned bins[256];
  for (int d = threadIdx.x; d < 256; d += blockDim.x) bins[d] = 0;
  __syncthreads();
  const int shift = select_shift(pass);
  const uint64_t prefix = s->prefix;
  const unsigned lane = threadIdx.x % kWarp;
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  for (size_t base = blockIdx.x * static_cast<size_t>(kThreads) + threadIdx.x - lane; base < n;
       base += stride) {
    const size_t i = base + lane;
    unsigned digit = 256;  // none
    if (i < n) {
      const uint64_t c = composite(src[i], static_cast<uint32_t>(i));
      if (pass == 0 || c >> (shift + 8) == prefix >> (shift + 8))
        digit = static_cast<unsigned>(c >> shift) & 0xffu;
    }
    const unsigned peers = __match_any_sync(0xffffffffu, digit);
    if (digit < 256 && lane == static_cast<unsigned>(__ffs(peers) - 1))
      atomicAdd(&bins[digit], static_cast<unsigned>(__popc(peers)));
  }
  __syncthreads();
  for (int d = threadIdx.x; d < 256; d += blockDim.x)
    if (bins[d] != 0) atomicAdd(&s->histogram[d], static_cast<unsigned long long>(bins[d]));
}

/// One thread: the digit of C, from the largest down; clears the histogram for the next pass.
__global__ void select_choose_kernel(int pass, SelectState* s) {
  if (s->done) return;
  unsigned long long above = 0;
  for (int d = 255; d >= 0; --d) {
    const unsigned long long h = s->histogram[d];
    if (above + h >= s->remaining) {
      s->prefix |= static_cast<unsigned long long>(d) << select_shift(pass);
      s->remaining -= above;
      s->done = h == s->remaining;
      break;
    }
    above += h;
  }
  for (int d = 0; d < 256; ++d) s->histogram[d] = 0;
}

struct AtLeastThreshold {
  const float* src;
  const SelectState* state;
  __device__ bool operator()(uint32_t i) const { return composite(src[i], i) >= state->prefix; }
};

__global__ void iota_kernel(uint32_t* indices, size_t n) {
  for (size_t i = thread_first(); i < n; i += grid_stride()) indices[i] = static_cast<uint32_t>(i);
}

__global__ void gather_kernel(const float* src, const uint32_t* indices, size_t k, float* values) {
  for (size_t j = thread_first(); j < k; j += grid_stride()) values[j] = src[indices[j]];
}

/// *p += v, rounded like the CPU's add (IEEE, subnormals kept, which float atomicAdd to global
/// memory does not promise), atomically so that repeated indices all count.
__device__ inline void add_exact(float* p, float v) {
  auto* word = reinterpret_cast<unsigned*>(p);
  unsigned old = *word, assumed;
  do {
    assumed = old;
    old = atomicCAS(word, assumed, __float_as_uint(__fadd_rn(__uint_as_float(assumed), v)));
  } while (old != assumed);
}

__global__ void scatter_add_kernel(const uint32_t* indices, const float* values, size_t k,
                                   float scale, float* dst) {
  for (size_t j = thread_first(); j < k; j += grid_stride())
    add_exact(dst + indices[j], __fmul_rn(scale, values[j]));
}

__global__ void zero_at_kernel(const uint32_t* indices, size_t k, float* dst) {
  for (size_t j = thread_first(); j < k; j += grid_stride()) dst[indices[j]] = 0.0f;
}

// ---- flatten / unflatten ---------------------------------------------------------------------

constexpr size_t kCopyChunk = 16384;  // bytes one CTA copies

/// A non-empty tensor as the copy kernel sees it: its bytes, where they go in the flat buffer,
/// and the first of its chunks in the launch.
struct CopyEntry {
  unsigned char* tensor;
  size_t bytes;
  size_t flat_offset;
  size_t first_chunk;
};

template <class W>
__device__ void copy_words(unsigned char* dst, const unsigned char* src, size_t bytes) {
  const size_t words = bytes / sizeof(W);
  auto* d = reinterpret_cast<W*>(dst);
  const auto* s = reinterpret_cast<const W*>(src);
  for (size_t i = threadIdx.x; i < words; i += blockDim.x) d[i] = s[i];
  for (size_t i = words * sizeof(W) + threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
}

/// Copies with the widest word both addresses are aligned to.
__device__ void copy_bytes(unsigned char* dst, const unsigned char* src, size_t bytes) {
  const auto both = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  if (both % 16 == 0)
    copy_words<uint4>(dst, src, bytes);
  else if (both % 8 == 0)
    copy_words<uint2>(dst, src, bytes);
  else if (both % 4 == 0)
    copy_words<uint32_t>(dst, src, bytes);
  else if (both % 2 == 0)
    copy_words<uint16_t>(dst, src, bytes);
  else
    copy_words<unsigned char>(dst, src, bytes);
}

/// One CTA per chunk of 16 KiB; its tensor is found by binary search over the entries.
template <bool kToFlat>
__global__ void flatten_kernel(const CopyEntry* entries, size_t count, size_t chunks,
                               unsigned char* flat) {
  for (size_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    size_t lo = 0, hi = count;  // the last entry whose first_chunk <= chunk
    while (hi - lo > 1) {
      const size_t mid = (lo + hi) / 2;
      if (entries[mid].first_chunk <= chunk)
        lo = mid;
      else
        hi = mid;
    }
    const CopyEntry e = entries[lo];
    const size_t begin = (chunk - e.first_chunk) * kCopyChunk;
    const size_t bytes = min(kCopyChunk, e.bytes - begin);
    unsigned char* tensor = e.tensor + begin;
    unsigned char* place = flat + e.flat_offset + begin;
    if (kToFlat)
      copy_bytes(place, tensor, bytes);
    else
      copy_bytes(tensor, place, bytes);
  }
}

template <bool kToFlat>
void flatten_any(const char* function, const TensorSpan* tensors, size_t num_tensors,
                 size_t element_bytes, const void* flat, size_t flat_count, void* stream) {
  if (element_bytes != 1 && element_bytes != 2 && element_bytes != 4 && element_bytes != 8)
    bad_argument(function,
                 "element_bytes " + std::to_string(element_bytes) + " (expected 1, 2, 4 or 8)");
  if (tensors == nullptr && num_tensors > 0)
    bad_argument(function, "tensors is null with num_tensors " + std::to_string(num_tensors) +
                               " (expected a host array of TensorSpan)");
  std::vector<CopyEntry> entries;
  size_t chunks = 0;
  for (size_t i = 0; i < num_tensors; ++i) {
    const TensorSpan& t = tensors[i];
    const std::string which = "tensor " + std::to_string(i) + ": ";
    if (t.count == 0) continue;
    if (t.data == nullptr)
      bad_argument(function, which + "data is null with count " + std::to_string(t.count) +
                                 " (expected a device buffer)");
    if (t.offset > flat_count || t.count > flat_count - t.offset)
      bad_argument(function, which + "elements [" + std::to_string(t.offset) + ", " +
                                 std::to_string(t.offset + t.count) +
                                 ") of the flat buffer, which holds " + std::to_string(flat_count) +
                                 " (expected offset + count <= " + "flat_count)");
    const size_t bytes = t.count * element_bytes;
    entries.push_back(
        {static_cast<unsigned char*>(t.data), bytes, t.offset * element_bytes, chunks});
    chunks += (bytes + kCopyChunk - 1) / kCopyChunk;
  }
  if (entries.empty()) return;
  require_buffer(function, "flat", flat, flat_count, "flat_count", 1);
  // The spans travel to the device in stream order; a copy from pageable memory is staged before
  // cudaMemcpyAsync returns, so `entries` may go when this function does.
  Scratch table(entries.size() * sizeof(CopyEntry), as_stream(stream));
  TROUPE_CUDA_CHECK(cudaMemcpyAsync(table.at<CopyEntry>(), entries.data(),
                                    entries.size() * sizeof(CopyEntry), cudaMemcpyHostToDevice,
                                    as_stream(stream)));
  const auto grid =
      static_cast<unsigned>(std::min<size_t>(chunks, std::numeric_limits<int32_t>::max()));
  flatten_kernel<kToFlat><<<grid, kThreads, 0, as_stream(stream)>>>(
      table.at<CopyEntry>(), entries.size(), chunks,
      static_cast<unsigned char*>(const_cast<void*>(flat)));
  check_launch();
}

}  // namespace

// ---- the public functions --------------------------------------------------------------------

void encode_half(const float* src, size_t n, float scale, uint16_t* dst, void* stream) {
  encode_16<false>("encode_half", src, n, scale, dst, stream);
}
void decode_half(const uint16_t* src, size_t n, float scale, float* dst, void* stream) {
  decode_16<false>("decode_half", src, n, scale, dst, stream);
}
void encode_bfloat16(const float* src, size_t n, float scale, uint16_t* dst, void* stream) {
  encode_16<true>("encode_bfloat16", src, n, scale, dst, stream);
}
void decode_bfloat16(const uint16_t* src, size_t n, float scale, float* dst, void* stream) {
  decode_16<true>("decode_bfloat16", src, n, scale, dst, stream);
}

size_t minmax_bytes(MinMaxBits bits, size_t n, size_t block) {
  const char* function = "minmax_bytes";
  return with_codes(function, bits, [&](auto codes) {
    using C = decltype(codes);
    require_minmax_block<C>(function, block);
    return (n + block - 1) / block * 2 * sizeof(float) + minmax::code_bytes<C>(n);
  });
}

void minmax_encode(MinMaxBits bits, const float* src, size_t n, size_t block, uint8_t* out,
                   void* stream) {
  const char* function = "minmax_encode";
  with_codes(function, bits, [&](auto codes) {
    using C = decltype(codes);
    require_minmax_block<C>(function, block);
    require_buffer(function, "src", src, n, "n", 4);
    require_buffer(function, "out", out, n, "n", 1);
    if (n == 0) return;
    const size_t blocks = (n + block - 1) / block;
    if (block >= kCtaBlock)
      launch_groups<kThreads>(minmax_encode_kernel<C, kThreads>, blocks, stream, src, n, block,
                              blocks, out);
    else
      launch_groups<kWarp>(minmax_encode_kernel<C, kWarp>, blocks, stream, src, n, block, blocks,
                           out);
  });
}

void minmax_decode(MinMaxBits bits, const uint8_t* in, size_t n, size_t block, float* dst,
                   void* stream) {
  minmax_decode_any<false>("minmax_decode", bits, in, n, block, dst, stream);
}
void minmax_decode_add(MinMaxBits bits, const uint8_t* in, size_t n, size_t block, float* dst,
                       void* stream) {
  minmax_decode_any<true>("minmax_decode_add", bits, in, n, block, dst, stream);
}

void sign_pack(const float* src, size_t n, uint8_t* bits, void* stream) {
  require_buffer("sign_pack", "src", src, n, "n", 4);
  require_buffer("sign_pack", "bits", bits, n, "n", 1);
  if (n == 0) return;
  sign_pack_kernel<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(src, n, bits);
  check_launch();
}

void sign_unpack(const uint8_t* bits, size_t n, Scale s, float* dst, void* stream) {
  sign_unpack_any<false>("sign_unpack", bits, n, s, dst, stream);
}
void sign_unpack_add(const uint8_t* bits, size_t n, Scale s, float* dst, void* stream) {
  sign_unpack_any<true>("sign_unpack_add", bits, n, s, dst, stream);
}

void mean_abs(const float* src, size_t n, float* result, void* stream) {
  require_buffer("mean_abs", "src", src, n, "n", 4);
  require_buffer("mean_abs", "result", result, 1, "count", 4);
  if (n == 0) {
    TROUPE_CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(float), as_stream(stream)));
    return;
  }
  const size_t chunks = n / kMeanChunk;
  // The chunks' sums, then each level of the tree after them (every level at most 1/64 of the
  // one before: 2 chunks' room in all).
  Scratch sums((2 * chunks + 1) * sizeof(double), as_stream(stream));
  double* level = sums.at<double>();
  if (chunks > 0) {
    const size_t chunk_pairs = (chunks + 1) / 2;  // one warp each
    const auto grid = static_cast<unsigned>(std::clamp<size_t>(
        (chunk_pairs + kThreads / kWarp - 1) / (kThreads / kWarp), 1, kMaxBlocks));
    mean_abs_chunks_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(src, chunks, level);
    check_launch();
  }
  for (size_t m = chunks; m > 1; m = (m + kMeanGroup - 1) / kMeanGroup) {
    double* next = level + m;
    const size_t groups = (m + kMeanGroup - 1) / kMeanGroup;
    mean_abs_group_kernel<<<grid_for(groups), kThreads, 0, as_stream(stream)>>>(level, m, next);
    check_launch();
    level = next;
  }
  mean_abs_finish_kernel<<<1, 1, 0, as_stream(stream)>>>(
      level, chunks > 0, src + chunks * kMeanChunk, n - chunks * kMeanChunk, n, result);
  check_launch();
}

void sign_in_place(float* data, size_t n, void* stream) {
  require_buffer("sign_in_place", "data", data, n, "n", 4);
  if (n == 0) return;
  sign_in_place_kernel<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(data, n);
  check_launch();
}

void top_k(const float* src, size_t n, size_t k, uint32_t* indices, void* stream) {
  const char* function = "top_k";
  if (k > n)
    bad_argument(function,
                 "k " + std::to_string(k) + " > n " + std::to_string(n) + " (expected k <= n)");
  if (n > (size_t{1} << 32))
    bad_argument(function, "n " + std::to_string(n) + " (expected <= 2^32: indices are uint32)");
  require_buffer(function, "src", src, n, "n", 4);
  require_buffer(function, "indices", indices, k, "k", 4);
  if (k == 0) return;
  const cudaStream_t s = as_stream(stream);
  if (k == n) {
    iota_kernel<<<grid_for(n), kThreads, 0, s>>>(indices, n);
    check_launch();
    return;
  }
  const thrust::counting_iterator<uint32_t> all(0);
  size_t cub_bytes = 0;
  TROUPE_CUDA_CHECK(cub::DeviceSelect::If(nullptr, cub_bytes, all, indices,
                                          static_cast<long long*>(nullptr), static_cast<int64_t>(n),
                                          AtLeastThreshold{}, s));
  const size_t state_bytes = (sizeof(SelectState) + 255) / 256 * 256;
  Scratch scratch(state_bytes + cub_bytes, s);
  auto* state = scratch.at<SelectState>();
  select_init_kernel<<<1, kThreads, 0, s>>>(state, k);
  check_launch();
  const unsigned grid =
      static_cast<unsigned>(std::clamp<size_t>((n + 16 * kThreads - 1) / (16 * kThreads), 1, 1024));
  for (int pass = 0; pass < kSelectPasses; ++pass) {
    select_histogram_kernel<<<grid, kThreads, 0, s>>>(src, n, pass, state);
    check_launch();
    select_choose_kernel<<<1, 1, 0, s>>>(pass, state);
    check_launch();
  }
  TROUPE_CUDA_CHECK(cub::DeviceSelect::If(scratch.at<void>(state_bytes), cub_bytes, all, indices,
                                          &state->selected, static_cast<int64_t>(n),
                                          AtLeastThreshold{src, state}, s));
}

void gather(const float* src, const uint32_t* indices, size_t k, float* values, void* stream) {
  require_buffer("gather", "src", src, k, "k", 4);
  require_buffer("gather", "indices", indices, k, "k", 4);
  require_buffer("gather", "values", values, k, "k", 4);
  if (k == 0) return;
  gather_kernel<<<grid_for(k), kThreads, 0, as_stream(stream)>>>(src, indices, k, values);
  check_launch();
}

void scatter_add(const uint32_t* indices, const float* values, size_t k, float scale, float* dst,
                 void* stream) {
  require_buffer("scatter_add", "indices", indices, k, "k", 4);
  require_buffer("scatter_add", "values", values, k, "k", 4);
  require_buffer("scatter_add", "dst", dst, k, "k", 4);
  if (k == 0) return;
  scatter_add_kernel<<<grid_for(k), kThreads, 0, as_stream(stream)>>>(indices, values, k, scale,
                                                                      dst);
  check_launch();
}

void sign_error_feedback(const float* x, size_t n, Scale s, float* error, void* stream) {
  const char* function = "sign_error_feedback";
  require_buffer(function, "x", x, n, "n", 4);
  require_buffer(function, "error", error, n, "n", 4);
  require_buffer(function, "s.device", s.device, s.device ? 1 : 0, "count", 4);
  if (n == 0) return;
  sign_error_feedback_kernel<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(x, n, s, error);
  check_launch();
}

void sparse_error_feedback(const float* x, size_t n, const uint32_t* indices, size_t k,
                           float* error, void* stream) {
  const char* function = "sparse_error_feedback";
  if (k > n)
    bad_argument(function,
                 "k " + std::to_string(k) + " > n " + std::to_string(n) + " (expected k <= n)");
  require_buffer(function, "x", x, n, "n", 4);
  require_buffer(function, "error", error, n, "n", 4);
  require_buffer(function, "indices", indices, k, "k", 4);
  if (n == 0) return;
  if (error != x)
    TROUPE_CUDA_CHECK(
        cudaMemcpyAsync(error, x, n * sizeof(float), cudaMemcpyDeviceToDevice, as_stream(stream)));
  if (k == 0) return;
  zero_at_kernel<<<grid_for(k), kThreads, 0, as_stream(stream)>>>(indices, k, error);
  check_launch();
}

void flatten(const TensorSpan* tensors, size_t num_tensors, size_t element_bytes, void* flat,
             size_t flat_count, void* stream) {
  flatten_any<true>("flatten", tensors, num_tensors, element_bytes, flat, flat_count, stream);
}

void unflatten(const void* flat, size_t flat_count, const TensorSpan* tensors, size_t num_tensors,
               size_t element_bytes, void* stream) {
  flatten_any<false>("unflatten", tensors, num_tensors, element_bytes, flat, flat_count, stream);
}

}  // namespace troupe::cuda
