#pragma once
// Shared arithmetic of the ring collectives (allreduce, reduce-scatter, allgather(v)). Private to
// comm/collectives.
#include <algorithm>
#include <vector>

#include "comm/collectives/collectives.h"

namespace troupe::comm::ring {

inline int mod(int a, int n) { return ((a % n) + n) % n; }

/// Lanes for blocks of at most `max_block_bytes`, so that lanes * steps_per_lane tags fit 16 bits.
inline int lane_count(size_t max_block_bytes, int steps_per_lane, const CollectiveOptions& o) {
  size_t lanes = (max_block_bytes + o.chunk_bytes - 1) / std::max<size_t>(o.chunk_bytes, 1);
  lanes = std::clamp<size_t>(lanes, 1, static_cast<size_t>(std::max(o.max_lanes, 1)));
  const size_t tag_limit = 65535 / static_cast<size_t>(std::max(steps_per_lane, 1));
  return static_cast<int>(std::max<size_t>(1, std::min(lanes, tag_limit)));
}

/// Blocks of a buffer (element ranges, one per rank), each cut into `lanes` chunks; lane l handles
/// chunk l of every block, so each rank's block stays contiguous.
struct Layout {
  std::vector<Range> blocks;
  int lanes = 1;
  Range chunk(int block, int lane) const {
    const Range& b = blocks[static_cast<size_t>(block)];
    Range c = block_range(b.size(), lanes, lane);
    return Range{b.begin + c.begin, b.begin + c.end};
  }
  size_t max_chunk(int lane) const {
    size_t m = 0;
    for (int i = 0; i < static_cast<int>(blocks.size()); ++i) m = std::max(m, chunk(i, lane).size());
    return m;
  }
};

/// Appends the W-1 ring allgather steps of `lane` to `steps`: rank r starts with block r of `base`
/// filled and ends with every block filled. Tags: sub_base + k.
inline void append_allgather(std::vector<Step>& steps, Group g, char* base, size_t elem,
                             const Layout& layout, int lane, int sub_base) {
  const int W = g.world_size, r = g.rank;
  const int left = mod(r - 1, W), right = mod(r + 1, W);
  for (int k = 0; k < W - 1; ++k) {
    Range s = layout.chunk(mod(r - k, W), lane), d = layout.chunk(mod(r - k - 1, W), lane);
    Step step;
    step.ops.push_back(Op{Op::Kind::send, right, base + s.begin * elem, s.size() * elem,
                          static_cast<uint16_t>(sub_base + k)});
    step.ops.push_back(Op{Op::Kind::recv, left, base + d.begin * elem, d.size() * elem,
                          static_cast<uint16_t>(sub_base + k)});
    steps.push_back(std::move(step));
  }
}

}  // namespace troupe::comm::ring
