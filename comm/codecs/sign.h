#pragma once
/// Sign (1-bit) codecs: one bit per element, packed eight to a byte, least significant bit first;
/// a set bit means the element is negative (zero counts as positive).
#include <cstddef>
#include <cstdint>

namespace troupe::comm {

/// Bytes that hold n sign bits.
inline size_t sign_bytes(size_t n) { return (n + 7) / 8; }
/// bits[i / 8] bit (i % 8) = src[i] < 0, for i < n; the unused high bits of the last byte are 0.
void sign_pack(const float* src, size_t n, uint8_t* bits);
/// dst[i] += (bit i set ? -scale : scale) for i < n.
void sign_unpack_add(const uint8_t* bits, size_t n, float scale, float* dst);
/// dst[i] = (bit i set ? -scale : scale) for i < n.
void sign_unpack(const uint8_t* bits, size_t n, float scale, float* dst);
/// The mean of |src[i]| over i < n (0 for n == 0): the scale of scaled-sign compression. Its
/// order of additions is part of its definition (cuda::mean_abs gives the same bits): each whole
/// chunk of kMeanAbsChunk elements is summed in sixteen float lanes (lane L takes elements L,
/// L + 16, ... in order; then s[k] = (lane k + lane 4+k) + (lane 8+k + lane 12+k) and the chunk's
/// sum is double(s[0] + s[1]) + double(s[2] + s[3])); the chunks' double sums are added by a tree
/// of kMeanAbsGroup-wide groups (each group's values in order, the last group possibly short,
/// level after level until one value is left); the tail's |x| is summed in float in order and
/// added in double; the total is divided by n in double and rounded to float. The tree (rather
/// than one chain over every chunk) lets a GPU add the chunks' sums in parallel.
float mean_abs(const float* src, size_t n);
constexpr size_t kMeanAbsChunk = 1024;
constexpr size_t kMeanAbsGroup = 64;
/// data[i] = sign(data[i]) (-1, 0 or +1): the result of a majority vote from summed signs.
void sign_in_place(float* data, size_t n);

}  // namespace troupe::comm
