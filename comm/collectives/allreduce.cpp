#include "comm/collectives/collectives.h"
#include "comm/collectives/ring.h"
#include "comm/reduce.h"

namespace troupe::comm {

using ring::mod;

Schedule ring_allreduce_schedule(Group g, void* data, size_t count, DataType type, ReduceOp op,
                                 const CollectiveOptions& options) {
  Schedule s;
  s.name = "allreduce(ring)";
  const int W = g.world_size, r = g.rank;
  const size_t elem = element_size(type);
  char* base = static_cast<char*>(data);
  if (W == 1 || count == 0) return s;  // avg over one rank is the identity

  ring::Layout layout;
  for (int i = 0; i < W; ++i) layout.blocks.push_back(block_range(count, W, i));
  const int steps_per_chunk = 2 * (W - 1);
  layout.plan(elem, steps_per_chunk, options);
  const int left = mod(r - 1, W), right = mod(r + 1, W);

  for (int lane = 0; lane < layout.lanes; ++lane) {
    std::vector<Step> steps;
    char* tmp = s.allocate(layout.max_chunk(lane) * elem);
    for (int c = lane; c < layout.chunks; c += layout.lanes) {
      const int sub0 = c * steps_per_chunk;
      // Reduce-scatter: after step k, block r-k-2 holds the reduction of k+2 ranks; rank r ends
      // owning the full reduction of block r.
      for (int k = 0; k < W - 1; ++k) {
        Range sent = layout.chunk(mod(r - k - 1, W), c);
        Range got = layout.chunk(mod(r - k - 2, W), c);
        const auto sub = static_cast<uint16_t>(sub0 + k);
        Step step;
        step.ops.push_back(
            Op{Op::Kind::send, right, base + sent.begin * elem, sent.size() * elem, sub});
        step.ops.push_back(Op{Op::Kind::recv, left, tmp, got.size() * elem, sub});
        const bool last = k == W - 2;
        step.then = [=] {
          char* dst = base + got.begin * elem;
          reduce(dst, dst, tmp, got.size(), type, op);
          if (last && op == ReduceOp::avg) divide(dst, got.size(), type, W);
        };
        steps.push_back(std::move(step));
      }
      ring::append_allgather(steps, g, base, elem, layout, c, sub0 + W - 1);
    }
    s.lanes.push_back(std::move(steps));
  }
  return s;
}

Schedule recursive_doubling_allreduce_schedule(Group g, void* data, size_t count, DataType type,
                                               ReduceOp op) {
  Schedule s;
  s.name = "allreduce(recursive doubling)";
  const int W = g.world_size, r = g.rank;
  if (W == 1 || count == 0) return s;
  const size_t bytes = count * element_size(type);
  char* tmp = s.allocate(bytes);
  auto reduce_in = [=] { reduce(data, data, tmp, count, type, op); };

  int p = 1;
  while (p * 2 <= W) p *= 2;
  const int rem = W - p;
  std::vector<Step> steps;
  // Fold: of each pair (2i, 2i+1) below 2*rem, the even rank hands its data to the odd one and
  // sits out the doubling rounds.
  int vrank;
  if (r < 2 * rem) {
    Step fold;
    if (r % 2 == 0) {
      fold.ops.push_back(Op{Op::Kind::send, r + 1, data, bytes, 0});
      vrank = -1;
    } else {
      fold.ops.push_back(Op{Op::Kind::recv, r - 1, tmp, bytes, 0});
      fold.then = reduce_in;
      vrank = r / 2;
    }
    steps.push_back(std::move(fold));
  } else {
    vrank = r - rem;
  }
  if (vrank >= 0) {
    int round = 0;
    for (int mask = 1; mask < p; mask <<= 1, ++round) {
      const int vpeer = vrank ^ mask;
      const int peer = vpeer < rem ? vpeer * 2 + 1 : vpeer + rem;
      const auto sub = static_cast<uint16_t>(1 + round);
      Step step;
      step.ops.push_back(Op{Op::Kind::send, peer, data, bytes, sub});
      step.ops.push_back(Op{Op::Kind::recv, peer, tmp, bytes, sub});
      step.then = reduce_in;
      steps.push_back(std::move(step));
    }
  }
  if (r < 2 * rem) {
    Step unfold;
    if (r % 2 == 1)
      unfold.ops.push_back(Op{Op::Kind::send, r - 1, data, bytes, 64});
    else
      unfold.ops.push_back(Op{Op::Kind::recv, r + 1, data, bytes, 64});
    steps.push_back(std::move(unfold));
  }
  s.lanes.push_back(std::move(steps));
  if (op == ReduceOp::avg) s.finally = [=] { divide(data, count, type, W); };
  return s;
}

Schedule allreduce_schedule(Group g, void* data, size_t count, DataType type, ReduceOp op,
                            const CollectiveOptions& options) {
  const size_t bytes = count * element_size(type);
  if (bytes <= options.small_bytes || count < static_cast<size_t>(g.world_size))
    return recursive_doubling_allreduce_schedule(g, data, count, type, op);
  return ring_allreduce_schedule(g, data, count, type, op, options);
}

}  // namespace troupe::comm
