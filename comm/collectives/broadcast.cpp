#include "comm/collectives/collectives.h"
#include "comm/collectives/ring.h"
#include "comm/status.h"

namespace troupe::comm {

namespace {

// Binomial tree rooted at `root`: ceil(log2 W) rounds of the whole buffer.
Schedule binomial_broadcast(Group g, void* data, size_t bytes, int root) {
  Schedule s;
  s.name = "broadcast(binomial tree)";
  const int W = g.world_size;
  const int vrank = (g.rank - root + W) % W;
  auto real = [&](int v) { return (v + root) % W; };
  std::vector<Step> steps;
  int mask = 1;
  while (mask < W) {
    if (vrank & mask) {
      Step from_parent;
      from_parent.ops.push_back(Op{Op::Kind::recv, real(vrank - mask), data, bytes, 0});
      steps.push_back(std::move(from_parent));
      break;
    }
    mask <<= 1;
  }
  Step to_children;
  for (mask >>= 1; mask > 0; mask >>= 1)
    if (vrank + mask < W)
      to_children.ops.push_back(Op{Op::Kind::send, real(vrank + mask), data, bytes, 0});
  if (!to_children.ops.empty()) steps.push_back(std::move(to_children));
  s.lanes.push_back(std::move(steps));
  return s;
}

// Scatter from the root, then a ring allgather: about 2 * bytes per rank for any W.
Schedule scatter_allgather_broadcast(Group g, void* data, size_t count, size_t elem, int root) {
  Schedule s;
  s.name = "broadcast(scatter + allgather)";
  const int W = g.world_size;
  const int vrank = (g.rank - root + W) % W;
  char* base = static_cast<char*>(data);
  ring::Layout layout;  // blocks in relative-rank order: block v goes to rank (v + root) % W
  for (int v = 0; v < W; ++v) layout.blocks.push_back(block_range(count, W, v));
  std::vector<Step> steps;
  Step scatter;
  if (vrank == 0) {
    for (int v = 1; v < W; ++v) {
      Range b = layout.blocks[static_cast<size_t>(v)];
      scatter.ops.push_back(
          Op{Op::Kind::send, (v + root) % W, base + b.begin * elem, b.size() * elem, 0});
    }
  } else {
    Range b = layout.blocks[static_cast<size_t>(vrank)];
    scatter.ops.push_back(Op{Op::Kind::recv, root, base + b.begin * elem, b.size() * elem, 0});
  }
  steps.push_back(std::move(scatter));
  // The ring in relative ranks has the same neighbours as in real ranks.
  ring::append_allgather(steps, Group{vrank, W}, base, elem, layout, 0, 1);
  for (size_t i = 1; i < steps.size(); ++i)
    for (auto& op : steps[i].ops) op.peer = (op.peer + root) % W;
  s.lanes.push_back(std::move(steps));
  return s;
}

}  // namespace

Schedule broadcast_schedule(Group g, void* data, size_t count, DataType type, int root,
                            const CollectiveOptions& options) {
  if (root < 0 || root >= g.world_size)
    throw Error("broadcast: root " + std::to_string(root) + " is outside [0, " +
                std::to_string(g.world_size) + ")");
  const size_t elem = element_size(type);
  if (g.world_size == 1 || count == 0) {
    Schedule s;
    s.name = "broadcast";
    return s;
  }
  if (count * elem <= options.small_bytes || count < static_cast<size_t>(g.world_size))
    return binomial_broadcast(g, data, count * elem, root);
  return scatter_allgather_broadcast(g, data, count, elem, root);
}

}  // namespace troupe::comm
