#include "comm/collectives/collectives.h"
#include "comm/collectives/ring.h"
#include "comm/reduce.h"
#include "comm/status.h"

namespace troupe::comm {

Schedule allgatherv_schedule(Group g, const void* in, void* out, const std::vector<size_t>& counts,
                             DataType type, const CollectiveOptions& options) {
  const int W = g.world_size, r = g.rank;
  if (counts.size() != static_cast<size_t>(W))
    throw Error("allgatherv: " + std::to_string(counts.size()) +
                " counts given, expected one per rank (" + std::to_string(W) + ")");
  Schedule s;
  s.name = "allgatherv(ring)";
  const size_t elem = element_size(type);
  char* base = static_cast<char*>(out);

  ring::Layout layout;
  size_t offset = 0;
  for (size_t c : counts) {
    layout.blocks.push_back(Range{offset, offset + c});
    offset += c;
  }
  layout.plan(elem, std::max(W - 1, 1), options);
  const Range own = layout.blocks[static_cast<size_t>(r)];
  const bool in_place = in == base + own.begin * elem;

  for (int lane = 0; lane < layout.lanes; ++lane) {
    std::vector<Step> steps;
    for (int c = lane; c < layout.chunks; c += layout.lanes) {
      Range mine = layout.chunk(r, c);
      if (!in_place && mine.size()) {
        Step copy;  // no operations: runs at once, before the ring starts sending this chunk
        const char* from = static_cast<const char*>(in) + (mine.begin - own.begin) * elem;
        copy.then = [=] { comm::copy(base + mine.begin * elem, from, mine.size() * elem); };
        steps.push_back(std::move(copy));
      }
      ring::append_allgather(steps, g, base, elem, layout, c, c * (W - 1));
    }
    s.lanes.push_back(std::move(steps));
  }
  return s;
}

Schedule allgather_schedule(Group g, const void* in, void* out, size_t count_per_rank,
                            DataType type, const CollectiveOptions& options) {
  Schedule s = allgatherv_schedule(
      g, in, out, std::vector<size_t>(static_cast<size_t>(g.world_size), count_per_rank), type,
      options);
  s.name = "allgather(ring)";
  return s;
}

}  // namespace troupe::comm
