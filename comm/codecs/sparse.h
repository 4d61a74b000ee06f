#pragma once
/// Sparsification codecs: choosing k of n coordinates, and moving values by index.
///
/// Indices are uint32 (never floats: float32 cannot name every index above 2^24).
#include <cstddef>
#include <cstdint>

namespace troupe::comm {

/// The indices of the k elements of largest |src[i]|, in ascending index order (ties broken
/// towards the lower index). k <= n. O(n) on average (selection, not a full sort).
void top_k(const float* src, size_t n, size_t k, uint32_t* indices);
/// k distinct indices drawn uniformly from [0, n), in ascending order, from a generator seeded
/// with `seed` alone: every rank that passes the same seed gets the same indices. k <= n.
void random_k(uint64_t seed, size_t n, size_t k, uint32_t* indices);
/// values[j] = src[indices[j]] for j < k.
void gather(const float* src, const uint32_t* indices, size_t k, float* values);
/// dst[indices[j]] += scale * values[j] for j < k (repeated indices accumulate).
void scatter_add(const uint32_t* indices, const float* values, size_t k, float scale, float* dst);

}  // namespace troupe::comm
