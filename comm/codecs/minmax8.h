#pragma once
/// 8-bit min-max quantisation (Bagua's ByteGrad codec): a float32 buffer is cut into blocks of
/// `block` elements (the last may be shorter); each block is stored as its minimum and maximum
/// (two float32) and one byte per element, q = round((x - min) / (max - min) * 255). A constant
/// block (max == min) decodes exactly. The error of a decoded element is at most
/// (max - min) / 510 of its block.
///
/// Encoded layout, `minmax8_bytes(n, block)` bytes: all blocks' {min, max} pairs first (float32,
/// so the header stays aligned), then the n code bytes.
#include <cstddef>
#include <cstdint>

namespace troupe::comm {

/// Bytes of the encoding of n elements in blocks of `block` (block >= 1).
size_t minmax8_bytes(size_t n, size_t block);
/// Encodes src[0, n) into out (minmax8_bytes(n, block) bytes). Non-finite inputs are not
/// supported (the caller checks for overflow before).
void minmax8_encode(const float* src, size_t n, size_t block, uint8_t* out);
/// dst[i] = decoded element i.
void minmax8_decode(const uint8_t* in, size_t n, size_t block, float* dst);
/// dst[i] += decoded element i (dequantise and reduce in one pass).
void minmax8_decode_add(const uint8_t* in, size_t n, size_t block, float* dst);

}  // namespace troupe::comm
