#include "elastic/thread_ranks.h"

#include <future>

namespace troupe {

RuntimeOptions thread_rank_options(int rank, int world, int port,
                                   std::shared_ptr<comm::InprocFabric> fabric) {
  RuntimeOptions options;
  RankInfo info;
  info.rank = rank;
  info.world_size = world;
  info.local_rank = rank;
  info.local_world_size = world > 0 ? world : 1;
  info.master_port = port;
  info.source = "threads";
  options.rank_info = info;
  options.transport = "inproc";
  options.fabric = std::move(fabric);
  options.scheduler_threads = 1;
  return options;
}

std::vector<std::string> run_thread_ranks(const std::vector<RuntimeOptions>& ranks,
                                          const std::function<void(int, Runtime&)>& body) {
  std::vector<std::future<std::string>> threads;
  for (size_t i = 0; i < ranks.size(); ++i)
    threads.push_back(std::async(std::launch::async, [&, i] {
      try {
        Runtime runtime(ranks[i]);
        if (body) body(static_cast<int>(i), runtime);
        return std::string();
      } catch (const std::exception& e) {
        return std::string(e.what());
      }
    }));
  std::vector<std::string> errors;
  for (auto& thread : threads) errors.push_back(thread.get());
  return errors;
}

}  // namespace troupe
