#include <cstring>

#include "comm/collectives/collectives.h"
#include "comm/collectives/ring.h"
#include "comm/reduce.h"

namespace troupe::comm {

using ring::mod;

Schedule reduce_scatter_schedule(Group g, const void* in, void* out, size_t count, DataType type,
                                 ReduceOp op, const CollectiveOptions& options) {
  Schedule s;
  s.name = "reduce_scatter(ring)";
  const int W = g.world_size, r = g.rank;
  const size_t elem = element_size(type);
  const char* src = static_cast<const char*>(in);
  char* dst_base = static_cast<char*>(out);
  if (W == 1) {
    if (count && in != out) s.finally = [=] { comm::copy(out, in, count * elem); };
    return s;
  }
  if (count == 0) return s;

  ring::Layout layout;
  for (int i = 0; i < W; ++i) layout.blocks.push_back(block_range(count, W, i));
  layout.plan(elem, W - 1, options);
  const int left = mod(r - 1, W), right = mod(r + 1, W);
  const size_t mine = layout.blocks[static_cast<size_t>(r)].begin;

  for (int lane = 0; lane < layout.lanes; ++lane) {
    const size_t chunk_bytes = layout.max_chunk(lane) * elem;
    char* tmp = s.allocate(chunk_bytes);
    // The partial sum travels the ring in two alternating buffers: one is being sent while the
    // next partial is written to the other. The input is never modified.
    char* acc[2] = {s.allocate(chunk_bytes), s.allocate(chunk_bytes)};
    std::vector<Step> steps;
    for (int c = lane; c < layout.chunks; c += layout.lanes) {
      for (int k = 0; k < W - 1; ++k) {
        Range sent = layout.chunk(mod(r - k - 1, W), c);
        Range got = layout.chunk(mod(r - k - 2, W), c);
        const auto sub = static_cast<uint16_t>(c * (W - 1) + k);
        const char* send_buf = k == 0 ? src + sent.begin * elem : acc[(k - 1) % 2];
        Step step;
        step.ops.push_back(
            Op{Op::Kind::send, right, const_cast<char*>(send_buf), sent.size() * elem, sub});
        step.ops.push_back(Op{Op::Kind::recv, left, tmp, got.size() * elem, sub});
        const bool last = k == W - 2;
        char* dst = last ? dst_base + (got.begin - mine) * elem : acc[k % 2];
        step.then = [=] {
          reduce(dst, src + got.begin * elem, tmp, got.size(), type, op);
          if (last && op == ReduceOp::avg) divide(dst, got.size(), type, W);
        };
        steps.push_back(std::move(step));
      }
    }
    s.lanes.push_back(std::move(steps));
  }
  return s;
}

}  // namespace troupe::comm
