#pragma once
// Test support: the options of a Runtime whose rank is a thread of this test process, sharing an
// InprocFabric with the other ranks and reaching rank 0's directory on a local port.
#include <chrono>
#include <memory>

#include "runtime/runtime.h"

namespace troupe::test {

inline RuntimeOptions thread_rank(int rank, int world, int port,
                                  const std::shared_ptr<comm::InprocFabric>& fabric,
                                  std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  RuntimeOptions o;
  RankInfo info;
  info.rank = rank;
  info.world_size = world;
  info.local_world_size = world > 0 ? world : 1;
  info.master_port = port;
  info.source = "explicit";
  o.rank_info = info;
  o.transport = "inproc";
  o.fabric = fabric;
  o.scheduler_threads = 1;
  o.rendezvous_timeout = timeout;
  o.collective_timeout = timeout;
  return o;
}

}  // namespace troupe::test
