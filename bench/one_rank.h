#pragma once
// Benchmark support: the options of a Runtime of one rank over the inproc transport, with one
// scheduler thread, for benchmarks that time one rank's own work.
#include <memory>

#include "comm/transport/inproc/transport.h"
#include "elastic/launch.h"
#include "rank/runtime.h"

namespace troupe::bench {

inline RuntimeOptions one_rank_options() {
  RuntimeOptions o;
  RankInfo info;
  info.rank = 0;
  info.world_size = 1;
  info.master_port = pick_free_port();
  info.source = "explicit";
  o.rank_info = info;
  o.transport = "inproc";
  o.fabric = std::make_shared<comm::InprocFabric>(1);
  o.scheduler_threads = 1;
  return o;
}

}  // namespace troupe::bench
