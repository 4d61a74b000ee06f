#pragma once
/// Element-wise reduction kernels on the GPU: the arithmetic of collectives on CUDA buffers.
///
/// A plain C++ header with no CUDA types, so host code includes it without nvcc; streams travel
/// as void* (a cudaStream_t, nullptr for the default stream). Calls only enqueue work on the
/// stream and return; synchronise the stream before reading the result on the host.
#include <cstddef>

namespace troupe::cuda {

/// Element type of a device buffer. float16 is IEEE half, bfloat16 is brain float.
enum class DType : int { float32, float64, float16, bfloat16, int32, int64 };

/// Element-wise operator. avg reduces like sum; divide() applies the denominator once at the end.
enum class Op : int { sum, avg, min, max };

/// dst[i] = a[i] op b[i] for i < count, enqueued on `stream` (a cudaStream_t passed as void*).
/// dst may be the same buffer as a or b (not a partial overlap). Rounding is that of the CPU:
/// float16 and bfloat16 round to nearest even, integer sums wrap around, and min/max keep a
/// when the two compare equal or unordered (a NaN in b is dropped, a NaN in a is kept).
/// count 0 does nothing. Throws std::invalid_argument for a bad argument and
/// std::runtime_error naming the CUDA call when CUDA fails.
void reduce(void* dst, const void* a, const void* b, size_t count, DType t, Op op, void* stream);

/// data[i] /= divisor for i < count, enqueued on `stream` (integer types truncate toward zero,
/// float types round like the CPU). divisor must be >= 1.
void divide(void* data, size_t count, DType t, int divisor, void* stream);

/// True when a CUDA device is usable in this process; false (never a throw) without a driver
/// or a device.
bool device_available();

}  // namespace troupe::cuda
