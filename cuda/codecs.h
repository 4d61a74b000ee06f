#pragma once
/// Gradient codec kernels on the GPU: the CUDA twins of comm/codecs/ (half.h, minmax.h, sign.h,
/// sparse.h), the element-wise error-feedback updates of comm/compression/, and
/// flattening a bucket's tensors into one buffer.
///
/// Each encoding is byte-identical to its CPU twin's, so a GPU rank and a CPU rank can exchange
/// messages; decoded values are bit-identical too (NaN payloads of sums aside). Where a kernel
/// cannot match, its comment says so. docs/algorithms.md ("CUDA kernels") lists the pairs.
///
/// Like cuda/reduce.h: a plain C++ header with no CUDA types; every buffer is device memory,
/// streams travel as void* (a cudaStream_t, nullptr for the default stream), and calls only
/// enqueue work and return (scratch memory, where needed, comes from the stream-ordered pool,
/// cudaMallocAsync). A bad argument throws std::invalid_argument naming it and its value before
/// any CUDA work; a CUDA failure throws std::runtime_error naming the call.
#include <cstddef>
#include <cstdint>

namespace troupe::cuda {

// ---- float16 / bfloat16 (comm/codecs/half.h) -------------------------------------------------

/// dst[i] = float16(src[i] * scale) for i < n, rounded to nearest even; beyond half's range,
/// inf. A NaN encodes as the processor's F16C does (sign and upper payload kept).
void encode_half(const float* src, size_t n, float scale, uint16_t* dst, void* stream);
/// dst[i] = float(src[i]) * scale for i < n.
void decode_half(const uint16_t* src, size_t n, float scale, float* dst, void* stream);
/// dst[i] = bfloat16(src[i] * scale) for i < n, rounded to nearest even.
void encode_bfloat16(const float* src, size_t n, float scale, uint16_t* dst, void* stream);
/// dst[i] = float(src[i]) * scale for i < n.
void decode_bfloat16(const uint16_t* src, size_t n, float scale, float* dst, void* stream);

// ---- min-max blocks, 4- or 8-bit codes (comm/codecs/minmax.h) -------------------------------

/// The width of a min-max code, with comm::MinMaxBits's values (cuda/ includes nothing of comm/).
enum class MinMaxBits : uint8_t { four = 4, eight = 8 };

/// Bytes of the encoding of n elements in blocks of `block`: comm::minmax_bytes. block >= 1, and
/// even with 4-bit codes (every block's codes start on a byte); every min-max function refuses
/// another block, or a width other than 4 or 8, naming it.
size_t minmax_bytes(MinMaxBits bits, size_t n, size_t block);
/// Encodes src[0, n) into out (minmax_bytes(bits, n, block) bytes, any alignment): every block's
/// {min, max} as float32, then the codes, one byte per element at 8 bits; at 4 bits two a byte,
/// element i in byte i / 2, the low nibble for even i, and the high nibble of the last byte 0 when
/// n is odd. The header's zeros carry the sign the CPU's reduction order gives them, so the bytes
/// match comm::minmax_encode's exactly. Non-finite inputs are not supported (as on the CPU).
void minmax_encode(MinMaxBits bits, const float* src, size_t n, size_t block, uint8_t* out,
                   void* stream);
/// dst[i] = decoded element i.
void minmax_decode(MinMaxBits bits, const uint8_t* in, size_t n, size_t block, float* dst,
                   void* stream);
/// dst[i] += decoded element i.
void minmax_decode_add(MinMaxBits bits, const uint8_t* in, size_t n, size_t block, float* dst,
                       void* stream);

// ---- signs (comm/codecs/sign.h) --------------------------------------------------------------

/// Bytes that hold n sign bits: comm::sign_bytes.
inline size_t sign_bytes(size_t n) { return (n + 7) / 8; }

/// The factor of a sign kernel: `factor`, times the float at `device` when that is not null.
/// The device float is how a scale that mean_abs() wrote, or that arrived in a message, is used
/// without a round trip through the host: Scale{message + i, step_scale} is the CPU's
/// `s = message scale; s *= step_scale`.
struct Scale {
  Scale(float f = 1.0f) : factor(f) {}  // implicit: a plain float is a Scale
  Scale(const float* d, float f = 1.0f) : device(d), factor(f) {}
  const float* device = nullptr;
  float factor = 1.0f;
};

/// bits[i / 8] bit (i % 8) = src[i] < 0, for i < n; the unused high bits of the last byte are 0.
void sign_pack(const float* src, size_t n, uint8_t* bits, void* stream);
/// dst[i] = (bit i set ? -s : s) for i < n.
void sign_unpack(const uint8_t* bits, size_t n, Scale s, float* dst, void* stream);
/// dst[i] += (bit i set ? -s : s) for i < n.
void sign_unpack_add(const uint8_t* bits, size_t n, Scale s, float* dst, void* stream);
/// *result (one float of device memory) = the mean of |src[i]| over i < n, 0 for n == 0, summed
/// in exactly comm::mean_abs's order (sixteen float lanes per 1024 elements; the chunks' double
/// sums added by a tree of groups of 64, each group by one thread), so the scale is bit-identical.
void mean_abs(const float* src, size_t n, float* result, void* stream);
/// data[i] = sign(data[i]) in {-1, 0, +1}; NaN gives 0.
void sign_in_place(float* data, size_t n, void* stream);

// ---- sparsification (comm/codecs/sparse.h) ---------------------------------------------------

/// The indices of the k elements of largest |src[i]| (k <= n <= 2^32), ascending, ties broken
/// towards the lower index, NaN above infinity: the same array as comm::top_k. A radix select on
/// (|x| bits, inverted index), which has no ties, then one order-keeping compaction (CUB).
void top_k(const float* src, size_t n, size_t k, uint32_t* indices, void* stream);
/// values[j] = src[indices[j]] for j < k (indices must lie inside src).
void gather(const float* src, const uint32_t* indices, size_t k, float* values, void* stream);
/// dst[indices[j]] += scale * values[j] for j < k. With distinct indices (as top_k, random-k and
/// block give) every sum is the CPU's; repeated indices all accumulate, but in no fixed order.
void scatter_add(const uint32_t* indices, const float* values, size_t k, float scale, float* dst,
                 void* stream);

// ---- error feedback (comm/compression/) ------------------------------------------------------
// The corrected gradient x = g + e is cuda::reduce(x, x, e, n, DType::float32, Op::sum, stream).

/// Sign compression's memory: error[i] = x[i] - s sign(x[i]), with sign(x) = -1 for x < 0 and
/// +1 otherwise (the bit sign_pack sent). error may be x.
void sign_error_feedback(const float* x, size_t n, Scale s, float* error, void* stream);
/// Sparsification's memory: error = x, then error[indices[j]] = 0 for j < k (the coordinates
/// sent). error may be x.
void sparse_error_feedback(const float* x, size_t n, const uint32_t* indices, size_t k,
                           float* error, void* stream);

// ---- flatten / unflatten ---------------------------------------------------------------------

/// One tensor of a bucket: `count` elements at `data` (device memory), stored at element
/// `offset` of the flat buffer.
struct TensorSpan {
  void* data = nullptr;
  size_t count = 0;
  size_t offset = 0;
};

/// Copies every tensor into its place in `flat` (flat_count elements of element_bytes, 1, 2, 4
/// or 8), in one kernel launch; the spans are copied to the device for it. Elements of flat
/// outside every span are left as they are.
void flatten(const TensorSpan* tensors, size_t num_tensors, size_t element_bytes, void* flat,
             size_t flat_count, void* stream);
/// The reverse: copies each tensor's place in `flat` back into the tensor.
void unflatten(const void* flat, size_t flat_count, const TensorSpan* tensors, size_t num_tensors,
               size_t element_bytes, void* stream);

}  // namespace troupe::cuda
