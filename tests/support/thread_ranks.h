#pragma once
// Test support: the options of a Runtime whose rank is a thread of this test process, sharing an
// InprocFabric with the other ranks and reaching rank 0's directory on a local port.
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "elastic/launch.h"
#include "rank/runtime.h"

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
  // Thread ranks of two test processes (ctest -j) may pick the same free port; a job id of this
  // process and port keeps one job's rank out of the other's rendezvous, where it would be
  // refused by name instead of silently joining.
  info.job_id = "thread-ranks-" + std::to_string(::getpid()) + "-" + std::to_string(port);
  o.rank_info = info;
  o.transport = "inproc";
  o.fabric = fabric;
  o.scheduler_threads = 1;
  o.rendezvous_timeout = timeout;
  o.collective_timeout = timeout;
  return o;
}

/// Starts one Runtime per entry of `options` on its own thread and runs body(index, runtime) on
/// those that start. Returns what each thread threw ("" when nothing).
inline std::vector<std::string> run_ranks(const std::vector<RuntimeOptions>& options,
                                          const std::function<void(int, Runtime&)>& body) {
  std::vector<std::future<std::string>> futures;
  for (size_t i = 0; i < options.size(); ++i)
    futures.push_back(std::async(std::launch::async, [&, i] {
      try {
        Runtime rt(options[i]);
        if (body) body(static_cast<int>(i), rt);
        return std::string();
      } catch (const std::exception& e) {
        return std::string(e.what());
      }
    }));
  std::vector<std::string> errors;
  for (auto& f : futures) errors.push_back(f.get());
  return errors;
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
