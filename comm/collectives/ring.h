#pragma once
// Shared arithmetic of the ring collectives (allreduce, reduce-scatter, allgather(v)). Private to
// comm/collectives.
#include <algorithm>
#include <vector>

#include "comm/collectives/collectives.h"

namespace troupe::comm::ring {

inline int mod(int a, int n) { return ((a % n) + n) % n; }

/// Blocks of a buffer (element ranges, one per rank), each cut into `chunks` pieces. Chunk c of
/// every block travels the ring together; chunks are dealt round-robin to `lanes` lanes, and a lane
/// runs its chunks one after the other. So at most `lanes` chunks are in flight, each lane reuses
/// its scratch (which stays in cache), and each rank's block stays contiguous.
struct Layout {
  std::vector<Range> blocks;
  int chunks = 1;
  int lanes = 1;

  /// Cuts blocks into chunks of about options.chunk_bytes, so that chunks * steps_per_chunk tags
  /// fit in 16 bits.
  void plan(size_t elem, int steps_per_chunk, const CollectiveOptions& o) {
    size_t largest = 0;
    for (auto& b : blocks) largest = std::max(largest, b.size());
    const size_t bytes = largest * elem;
    const size_t chunk = o.chunk_bytes ? o.chunk_bytes : kChunkBytesOneHost;
    size_t n = (bytes + chunk - 1) / chunk;
    const size_t tag_limit = 65535 / static_cast<size_t>(std::max(steps_per_chunk, 1));
    n = std::clamp<size_t>(n, 1, std::max<size_t>(tag_limit, 1));
    n = std::min(n, std::max<size_t>(largest, 1));
    chunks = static_cast<int>(n);
    lanes = std::clamp(o.max_lanes, 1, chunks);
  }
  Range chunk(int block, int c) const {
    const Range& b = blocks[static_cast<size_t>(block)];
    Range r = block_range(b.size(), chunks, c);
    return Range{b.begin + r.begin, b.begin + r.end};
  }
  /// Largest chunk, in elements, that lane `lane` handles.
  size_t max_chunk(int lane) const {
    size_t m = 0;
    for (int c = lane; c < chunks; c += lanes)
      for (int i = 0; i < static_cast<int>(blocks.size()); ++i) m = std::max(m, chunk(i, c).size());
    return m;
  }
};

/// Appends the W-1 ring allgather steps of chunk `c` to `steps`: rank r starts with block r of
/// `base` filled and ends with every block filled. Tags: sub_base + k.
inline void append_allgather(std::vector<Step>& steps, Group g, char* base, size_t elem,
                             const Layout& layout, int c, int sub_base) {
  const int W = g.world_size, r = g.rank;
  const int left = mod(r - 1, W), right = mod(r + 1, W);
  for (int k = 0; k < W - 1; ++k) {
    Range s = layout.chunk(mod(r - k, W), c), d = layout.chunk(mod(r - k - 1, W), c);
    Step step;
    step.ops.push_back(Op{Op::Kind::send, right, base + s.begin * elem, s.size() * elem,
                          static_cast<uint16_t>(sub_base + k)});
    step.ops.push_back(Op{Op::Kind::recv, left, base + d.begin * elem, d.size() * elem,
                          static_cast<uint16_t>(sub_base + k)});
    steps.push_back(std::move(step));
  }
}

}  // namespace troupe::comm::ring
