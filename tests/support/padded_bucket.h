#pragma once
// Test support: a bucket of tensors with alignment gaps between them, as the compression tests
// lay one out; the gaps hold a stale value that must never leak into a tensor.
#include <cstddef>
#include <vector>

#include "comm/compression/reduction.h"

namespace troupe::test {

/// The stale value the tests put in a bucket's gaps: large enough to ruin any tensor it leaks into.
constexpr float kStalePadding = 1e30f;

/// Whether element i of the bucket lies in one of `tensors` (and not in a gap).
inline bool in_tensor(const std::vector<comm::TensorSlot>& tensors, size_t i) {
  for (auto& t : tensors)
    if (i >= t.offset && i < t.offset + t.count) return true;
  return false;
}

}  // namespace troupe::test
