#pragma once
/// Half-precision codecs: float32 buffers cast to IEEE float16 or bfloat16 and back, with a scale
/// applied on the way (fp16 compression divides before reducing, against overflow).
///
/// Rounding is to nearest even; float16 saturates nothing: values beyond its range become inf,
/// as a cast does. Loops are vectorised (F16C where the processor has it).
#include <cstddef>
#include <cstdint>

namespace troupe::comm {

/// dst[i] = float16(src[i] * scale) for i < n.
void encode_half(const float* src, size_t n, float scale, uint16_t* dst);
/// dst[i] = float(src[i]) * scale for i < n.
void decode_half(const uint16_t* src, size_t n, float scale, float* dst);
/// dst[i] = bfloat16(src[i] * scale) for i < n.
void encode_bfloat16(const float* src, size_t n, float scale, uint16_t* dst);
/// dst[i] = float(src[i]) * scale for i < n.
void decode_bfloat16(const uint16_t* src, size_t n, float scale, float* dst);

}  // namespace troupe::comm
