#pragma once
// Test support: the options of a Runtime whose rank is a thread of this test process, sharing an
// InprocFabric with the other ranks and reaching rank 0's directory on a local port.
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "comm/transport/inproc/transport.h"
#include "elastic/launch.h"
#include "elastic/thread_ranks.h"
#include "rank/runtime.h"

namespace troupe::test {

inline RuntimeOptions thread_rank(int rank, int world, int port,
                                  const std::shared_ptr<comm::InprocFabric>& fabric,
                                  std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  RuntimeOptions o = thread_rank_options(rank, world, port, fabric);
  // Thread ranks of two test processes (ctest -j) may pick the same free port; a job id of this
  // process and port keeps one job's rank out of the other's rendezvous, where it would be
  // refused by name instead of silently joining.
  o.rank_info->job_id = "thread-ranks-" + std::to_string(::getpid()) + "-" + std::to_string(port);
  o.rendezvous_timeout = timeout;
  o.collective_timeout = timeout;
  return o;
}

/// Starts one Runtime per entry of `options` on its own thread and runs body(index, runtime) on
/// those that start. Returns what each thread threw ("" when nothing).
inline std::vector<std::string> run_ranks(const std::vector<RuntimeOptions>& options,
                                          const std::function<void(int, Runtime&)>& body) {
  return run_thread_ranks(options, body);
}

/// Runs body(rank, runtime) on `world` thread ranks of one in-process job (a fresh fabric and
/// rendezvous port); with `hosts`, rank r registers as if on host hosts[r]. Returns what each
/// rank threw ("" when nothing).
inline std::vector<std::string> run_threads(int world,
                                            const std::function<void(int, Runtime&)>& body,
                                            const std::vector<std::string>& hosts = {}) {
  auto fabric = std::make_shared<comm::InprocFabric>(world);
  const int port = pick_free_port();
  std::vector<RuntimeOptions> options;
  for (int r = 0; r < world; ++r) {
    options.push_back(thread_rank(r, world, port, fabric));
    if (!hosts.empty()) options.back().host = hosts[static_cast<size_t>(r)];
  }
  return run_ranks(options, body);
}

}  // namespace troupe::test
