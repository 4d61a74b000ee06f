// Hierarchical allreduce: reduce to a leader per host, allreduce among leaders, broadcast per host.
#include <algorithm>
#include <map>
#include <memory>

#include "comm/collectives/collectives.h"
#include "comm/reduce.h"
#include "comm/status.h"

namespace troupe::comm {

namespace {

struct Hosts {
  std::vector<int> local;    // the ranks of this rank's host, ascending (the leader first)
  std::vector<int> leaders;  // every host's leader, ascending
  int leader_index = -1;     // this rank's index in leaders, -1 when it is not a leader
};

Hosts group_by_host(Group g, const std::vector<int>& host_of) {
  if (host_of.size() != static_cast<size_t>(g.world_size))
    throw Error("hierarchical allreduce: " + std::to_string(host_of.size()) +
                " host entries for a world of " + std::to_string(g.world_size) + " ranks");
  Hosts h;
  std::map<int, int> leader_of_host;
  for (int r = 0; r < g.world_size; ++r) {
    leader_of_host.emplace(host_of[static_cast<size_t>(r)], r);  // the first rank seen: the lowest
    if (host_of[static_cast<size_t>(r)] == host_of[static_cast<size_t>(g.rank)])
      h.local.push_back(r);
  }
  for (auto& [host, leader] : leader_of_host) h.leaders.push_back(leader);
  std::sort(h.leaders.begin(), h.leaders.end());
  auto at = std::find(h.leaders.begin(), h.leaders.end(), g.rank);
  if (at != h.leaders.end()) h.leader_index = static_cast<int>(at - h.leaders.begin());
  return h;
}

}  // namespace

std::vector<std::function<Schedule()>> hierarchical_allreduce_stages(
    Group g, const std::vector<int>& host_of, void* data, size_t count, DataType type, ReduceOp op,
    const CollectiveOptions& options) {
  auto hosts = std::make_shared<Hosts>(group_by_host(g, host_of));
  const bool average = op == ReduceOp::avg;
  const ReduceOp combine = average ? ReduceOp::sum : op;
  const size_t bytes = count * element_size(type);
  const int world = g.world_size;
  std::vector<std::function<Schedule()>> stages;
  // (1) Reduce to the host's leader.
  stages.push_back([hosts, data, count, type, combine, bytes] {
    Schedule s;
    s.name = "allreduce(hierarchical: reduce in host)";
    if (hosts->local.size() == 1) return s;
    Lane lane;
    Step step;
    if (hosts->leader_index < 0) {
      step.ops.push_back(Op{Op::Kind::send, hosts->local.front(), data, bytes, 0});
    } else {
      std::vector<char*> inbox;
      for (size_t i = 1; i < hosts->local.size(); ++i) {
        inbox.push_back(s.allocate(bytes));
        step.ops.push_back(Op{Op::Kind::recv, hosts->local[i], inbox.back(), bytes, 0});
      }
      step.then = [inbox, data, count, type, combine] {
        for (char* in : inbox) reduce(data, data, in, count, type, combine);
      };
    }
    lane.push_back(std::move(step));
    s.lanes.push_back(std::move(lane));
    return s;
  });
  // (2) Allreduce among the leaders; the ranks of the leaders' group are mapped to job ranks.
  stages.push_back([hosts, data, count, type, combine, options, average, world] {
    if (hosts->leader_index < 0) {
      Schedule s;
      s.name = "allreduce(hierarchical: across hosts)";
      return s;
    }
    const Group leaders{hosts->leader_index, static_cast<int>(hosts->leaders.size())};
    Schedule s = allreduce_schedule(leaders, data, count, type, combine, options);
    for (auto& lane : s.lanes)
      for (auto& step : lane)
        for (auto& op : step.ops) op.peer = hosts->leaders[static_cast<size_t>(op.peer)];
    s.name = "allreduce(hierarchical: across hosts, " + s.name + ")";
    if (average) {
      auto previous = std::move(s.finally);
      s.finally = [previous, data, count, type, world] {
        if (previous) previous();
        scale(data, count, type, 1.0 / world);
      };
    }
    return s;
  });
  // (3) Broadcast from the host's leader.
  stages.push_back([hosts, data, bytes] {
    Schedule s;
    s.name = "allreduce(hierarchical: broadcast in host)";
    if (hosts->local.size() == 1) return s;
    Lane lane;
    Step step;
    if (hosts->leader_index < 0) {
      step.ops.push_back(Op{Op::Kind::recv, hosts->local.front(), data, bytes, 0});
    } else {
      for (size_t i = 1; i < hosts->local.size(); ++i)
        step.ops.push_back(Op{Op::Kind::send, hosts->local[i], data, bytes, 0});
    }
    lane.push_back(std::move(step));
    s.lanes.push_back(std::move(lane));
    return s;
  });
  return stages;
}

}  // namespace troupe::comm
