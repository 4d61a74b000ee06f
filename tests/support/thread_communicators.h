#pragma once
// Test support: ranks as threads of this process, each with a Communicator over one shared
// InprocFabric (no Runtime, no rendezvous).
#include <chrono>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "comm/collectives/communicator.h"
#include "comm/transport/inproc/transport.h"

namespace troupe::test {

/// Runs fn(communicator) on `world` threads; returns what each threw ("" when nothing).
inline std::vector<std::string> run_communicators(
    int world, const comm::CollectiveOptions& options,
    const std::function<void(comm::Communicator&)>& fn) {
  comm::InprocFabric fabric(world);
  std::vector<std::future<std::string>> results;
  for (int r = 0; r < world; ++r)
    results.push_back(std::async(std::launch::async, [&, r] {
      comm::Communicator c(fabric.transport(r), options, std::chrono::seconds(30));
      try {
        fn(c);
        return std::string();
      } catch (const std::exception& e) {
        return std::string(e.what());
      }
    }));
  std::vector<std::string> out;
  for (auto& f : results) out.push_back(f.get());
  return out;
}

}  // namespace troupe::test
