#include "comm/collectives/collectives.h"

namespace troupe::comm {

Schedule barrier_schedule(Group g) {
  Schedule s;
  s.name = "barrier(dissemination)";
  const int W = g.world_size;
  std::vector<Step> steps;
  uint16_t round = 0;
  for (int dist = 1; dist < W; dist <<= 1, ++round) {
    // Each round has its own token bytes so that no buffer is written while being sent.
    char* out = s.allocate(1);
    char* in = s.allocate(1);
    *out = 1;
    Step step;
    step.ops.push_back(Op{Op::Kind::send, (g.rank + dist) % W, out, 1, round});
    step.ops.push_back(Op{Op::Kind::recv, (g.rank - dist + W) % W, in, 1, round});
    steps.push_back(std::move(step));
  }
  s.lanes.push_back(std::move(steps));
  return s;
}

}  // namespace troupe::comm
