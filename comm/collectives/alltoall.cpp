#include "comm/collectives/collectives.h"
#include "comm/reduce.h"

namespace troupe::comm {

Schedule alltoall_schedule(Group g, const void* in, void* out, size_t count_per_rank,
                           DataType type) {
  Schedule s;
  s.name = "alltoall(pairwise)";
  const size_t block = count_per_rank * element_size(type);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const int r = g.rank;
  // Every exchange is posted at once; the transport moves them concurrently.
  Step step;
  for (int k = 1; k < g.world_size; ++k) {
    const int to = (r + k) % g.world_size;
    const int from = (r - k + g.world_size) % g.world_size;
    step.ops.push_back(Op{Op::Kind::send, to, const_cast<char*>(src + block * to), block, 0});
    step.ops.push_back(Op{Op::Kind::recv, from, dst + block * from, block, 0});
  }
  if (block && src != dst) step.then = [=] { comm::copy(dst + block * r, src + block * r, block); };
  s.lanes.push_back({std::move(step)});
  return s;
}

}  // namespace troupe::comm
