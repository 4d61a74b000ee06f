#pragma once
/// Element-wise reduction kernels on the CPU: the arithmetic of every collective.
///
/// Loops are written once per (type, op) with no per-element dispatch; float types vectorise, and
/// an AVX2/F16C build of each loop is chosen at run time where the processor has it.
#include <cstddef>

#include "comm/types.h"

namespace troupe::comm {

/// dst[i] = a[i] op b[i] for i < count. dst may be the same buffer as a or b (not a partial
/// overlap). ReduceOp::avg reduces like sum; divide() applies the denominator once at the end.
void reduce(void* dst, const void* a, const void* b, size_t count, DataType type, ReduceOp op);

/// out1[i] = out2[i] = a[i] op b[i] for i < count, then divided by `divisor` for ReduceOp::avg:
/// bit for bit reduce(), divide() and a copy, in one pass over memory instead of four (the sum of
/// two ranks' shares written back to both). out1 and out2 may be a and b, in either order; no
/// partial overlaps. divisor must be >= 1.
void reduce_to_two(void* out1, void* out2, const void* a, const void* b, size_t count,
                   DataType type, ReduceOp op, int divisor);

/// Copies `bytes` bytes from src to dst (no overlap), as memcpy does, with vector loads and stores
/// for all but the smallest sizes. glibc's memcpy copies sizes from a few KiB to half a MiB with
/// `rep movsb` on processors with fast short rep-mov (FSRM), and on AMD Zen 3 that runs at a
/// fifteenth of its speed when dst - src is a small positive distance modulo 4 KiB (1.7 against
/// 30 GB/s at 16 bytes, measured on this project's machines; glibc 2.36), which is what a
/// malloc'ed buffer (16 bytes past a page) against a page-aligned shared-memory slot gives. The
/// loops that move data between ranks copy through this instead.
void copy(void* dst, const void* src, size_t bytes);

/// Copies like copy(), but from kStreamCopyBytes on with non-temporal stores for all but the
/// unaligned ends: the destination's cache lines are written to memory without being read first
/// (no read for ownership) and without evicting this core's working set. For buffers larger than
/// the caches that another core reads next (a gradient copied into its shared-memory bucket):
/// about a third less memory traffic than copy(). Ends with a store fence, so that a later
/// release store (a flag that publishes the bytes) cannot be seen before them.
void stream_copy(void* dst, const void* src, size_t bytes);
/// Below this, stream_copy() is copy(): the destination is likelier read from the caches.
constexpr size_t kStreamCopyBytes = size_t{1} << 20;

/// data[i] /= divisor for i < count (integer types truncate toward zero). divisor must be >= 1.
void divide(void* data, size_t count, DataType type, int divisor);

/// data[i] *= factor for i < count (integer types: rounded toward zero).
void scale(void* data, size_t count, DataType type, double factor);

/// IEEE half <-> float conversions, exposed for tests and codecs (round to nearest even).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bfloat16_to_float(uint16_t b);
uint16_t float_to_bfloat16(float f);

}  // namespace troupe::comm
