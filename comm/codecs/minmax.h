#pragma once
/// Min-max quantisation with 4- or 8-bit codes (the 8-bit one is Bagua's ByteGrad codec): a
/// float32 buffer is cut into blocks of `block` elements (the last may be shorter); each block is
/// stored as its minimum and maximum (two float32) and one code per element,
/// q = round((x - min) / (max - min) * (2^bits - 1)), rounded to nearest. A constant block
/// (max == min) decodes exactly. The error of a decoded element is at most
/// (max - min) / (2 (2^bits - 1)) of its block: / 510 with 8 bits, / 30 with 4 (plus float
/// rounding).
///
/// Encoded layout, `minmax_bytes(bits, n, block)` bytes: all blocks' {min, max} pairs first
/// (float32, so the header stays aligned), then the codes: one byte per element with 8 bits; with
/// 4 bits two codes a byte, element i in byte i / 2, the low nibble for even i, the high nibble of
/// the last byte 0 when n is odd (an even block keeps every block's codes on a byte boundary).
#include <cstddef>
#include <cstdint>

namespace troupe::comm {

/// The width of a min-max code.
enum class MinMaxBits : uint8_t { four = 4, eight = 8 };

/// Bytes of the encoding of n elements in blocks of `block` (block >= 1; with 4 bits >= 2 and
/// even). Every function here throws comm::Error naming `bits` when it is neither 4 nor 8.
size_t minmax_bytes(MinMaxBits bits, size_t n, size_t block);
/// Encodes src[0, n) into out (minmax_bytes(bits, n, block) bytes). Non-finite inputs are not
/// supported (the caller checks for overflow before).
void minmax_encode(MinMaxBits bits, const float* src, size_t n, size_t block, uint8_t* out);
/// dst[i] = decoded element i.
void minmax_decode(MinMaxBits bits, const uint8_t* in, size_t n, size_t block, float* dst);
/// dst[i] += decoded element i (dequantise and reduce in fp32 in one pass).
void minmax_decode_add(MinMaxBits bits, const uint8_t* in, size_t n, size_t block, float* dst);

}  // namespace troupe::comm
