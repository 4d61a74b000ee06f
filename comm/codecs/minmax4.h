#pragma once
/// 4-bit min-max quantisation: a float32 buffer is cut into blocks of `block` elements (even; the
/// last block may be shorter); each block is stored as its minimum and maximum (two float32) and
/// one 4-bit code per element, q = round((x - min) / (max - min) * 15), rounded to nearest. Two
/// codes share a byte: element i is in byte i / 2, the low nibble for even i. A constant block
/// (max == min) decodes exactly. The error of a decoded element is at most (max - min) / 30 of
/// its block (plus float rounding).
///
/// Encoded layout, `minmax4_bytes(n, block)` bytes: all blocks' {min, max} pairs first (float32,
/// so the header stays aligned), then the ceil(n / 2) code bytes; the high nibble of the last
/// byte is 0 when n is odd. An even block keeps every block's codes on a byte boundary.
#include <cstddef>
#include <cstdint>

namespace troupe::comm {

/// Bytes of the encoding of n elements in blocks of `block` (block >= 2, even).
size_t minmax4_bytes(size_t n, size_t block);
/// Encodes src[0, n) into out (minmax4_bytes(n, block) bytes). Non-finite inputs are not
/// supported.
void minmax4_encode(const float* src, size_t n, size_t block, uint8_t* out);
/// dst[i] = decoded element i.
void minmax4_decode(const uint8_t* in, size_t n, size_t block, float* dst);
/// dst[i] += decoded element i (dequantise and reduce in fp32 in one pass).
void minmax4_decode_add(const uint8_t* in, size_t n, size_t block, float* dst);

}  // namespace troupe::comm
