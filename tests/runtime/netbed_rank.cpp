// troupe_netbed_rank: one rank of a job on the network test bed (scripts/netbed), started by
// tests/runtime/netbed_test.cpp, one host per network namespace. The scenario is argv[1]; the
// exit code says whether it held, and the log lines say what the test checks.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/distributed_module.h"
#include "rank/runtime.h"
#include "tests/support/whole_batch_reference.h"

using namespace troupe;

namespace {

RuntimeOptions options() {
  RuntimeOptions o;
  o.scheduler_threads = 1;
  return o;
}

// Every pair of ranks on different real hosts must go over the network, and every pair on one
// host through shared memory (UCX's choice, per pair); prints each path. Returns the failures.
int check_paths(const Runtime& rt) {
  int failures = 0;
  const auto& paths = rt.peer_paths();
  const auto& hosts = rt.real_hosts();
  for (int r = 0; r < rt.world_size(); ++r) {
    if (r == rt.rank()) continue;
    const std::string& path = paths[static_cast<size_t>(r)];
    const bool same = hosts[static_cast<size_t>(r)] == hosts[static_cast<size_t>(rt.rank())];
    const bool ok =
        same ? path.find("same host, shared memory") == 0
             : path.find("other host") == 0 && path.find(", network:") != std::string::npos;
    std::cout << "rank " << rt.rank() << " to rank " << r << ": " << path << (ok ? "" : " (WRONG)")
              << std::endl;
    failures += ok ? 0 : 1;
  }
  return failures;
}

// A ring allreduce of `mib` MiB: rank r contributes (r + 1) * (i % 13 + 1) at index i, so every
// element of the sum is W (W + 1) / 2 * (i % 13 + 1), exact in float32.
int allreduce(Runtime& rt, size_t mib) {
  const size_t n = (mib << 20) / sizeof(float);
  const int world = rt.world_size();
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>((rt.rank() + 1) * (i % 13 + 1));
  rt.comm().allreduce(v.data(), n, comm::DataType::float32, comm::ReduceOp::sum);
  for (size_t i = 0; i < n; ++i) {
    const float want = static_cast<float>(world * (world + 1) / 2 * (i % 13 + 1));
    if (v[i] != want) {
      std::cerr << "rank " << rt.rank() << ": element " << i << " is " << v[i] << ", expected "
                << want << "\n";
      return 1;
    }
  }
  std::cout << "rank " << rt.rank() << ": allreduce of " << mib << " MiB correct" << std::endl;
  return 0;
}

// A few steps of a DistributedModule, each rank on its shard of a batch: the parameters must end
// as those of one process trained on the whole batch, which every rank computes too.
int ddp(Runtime& rt, bool hierarchical) {
  torch::set_num_threads(1);
  DdpOptions d;
  d.bucket_bytes = 16384;  // several buckets
  d.first_bucket_bytes = 4096;
  d.hierarchical = hierarchical;
  const auto run = test::train_against_whole_batch(rt, d, 32, 256, 8, 4, 5);
  std::cout << "rank " << rt.rank() << " (" << run.gradient_path << "): ddp largest difference "
            << "from one process " << run.largest_difference << std::endl;
  return run.largest_difference < 1e-4 ? 0 : 1;
}

// One rank per host: every peer over the network, an allreduce of argv[2] MiB and a short
// data-parallel job, both checked.
int network(size_t mib) {
  Runtime rt(options());
  int failures = check_paths(rt);
  failures += allreduce(rt, mib);
  failures += ddp(rt, false);
  return failures == 0 ? 0 : 1;
}

// Several ranks per host, all under one host name (TROUPE_HOST_NAME): the ranks must still be
// grouped by their real hosts (netbed: one /dev/shm per host), reach their host's ranks through
// shared memory and the others over the network, keep gradients off the single-host shared-memory
// path, and reduce hierarchically by real host to the right result.
int hosts(int per_host) {
  Runtime rt(options());
  std::vector<int> expected;
  for (int r = 0; r < rt.world_size(); ++r) expected.push_back(r / per_host);
  int failures = 0;
  if (rt.real_hosts() != expected) {
    std::cerr << "rank " << rt.rank() << ": real hosts";
    for (int h : rt.real_hosts()) std::cerr << " " << h;
    std::cerr << " (expected ranks grouped by " << per_host << ")\n";
    ++failures;
  }
  std::cout << "rank " << rt.rank() << " on " << rt.hosts()[static_cast<size_t>(rt.rank())]
            << ": host " << rt.real_hosts()[static_cast<size_t>(rt.rank())] << std::endl;
  failures += check_paths(rt);
  std::vector<float> v(300000, static_cast<float>(rt.rank() + 1));
  rt.comm().hierarchical_allreduce(v.data(), v.size(), comm::DataType::float32, comm::ReduceOp::sum,
                                   rt.real_hosts());
  const int world = rt.world_size();
  for (float x : v)
    if (x != static_cast<float>(world * (world + 1) / 2)) {
      std::cerr << "rank " << rt.rank() << ": hierarchical allreduce gave " << x << "\n";
      ++failures;
      break;
    }
  std::cout << "rank " << rt.rank() << ": hierarchical allreduce by real host correct" << std::endl;
  failures += ddp(rt, true);
  return failures == 0 ? 0 : 1;
}

// The ranks an error blames: those it says cannot be reached ("rank(s) 3 cannot be reached
// from rank 1"), or else those it says it waited for ("waiting for rank(s) 0"), or the one it
// says died ("rank 1 died"); empty when it names none.
std::vector<int> blamed(const std::string& what) {
  std::smatch m;
  std::string list;
  if (std::regex_search(what, m, std::regex(R"(rank\(s\) ([0-9, ]+) cannot be reached)")) ||
      std::regex_search(what, m, std::regex(R"(waiting for rank\(s\) ([0-9, ]+))")) ||
      std::regex_search(what, m, std::regex(R"(rank ([0-9]+) died)")))
    list = m[1];
  std::vector<int> ranks;
  std::istringstream in(list);
  for (std::string item; std::getline(in, item, ',');)
    if (item.find_first_of("0123456789") != std::string::npos) ranks.push_back(std::stoi(item));
  return ranks;
}

std::string text_of(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text.empty() ? "none" : text;
}

// Allreduces of 4 MiB until one fails: the test bed takes the last host's link down for good
// after "allreduce 3 done" (one rank per host). Every rank must then fail within its collective
// deadline (argv[2] seconds) plus a margin, with an error that blames the rank behind the cut
// link and no other: the last rank, for everyone but itself; every other rank, for the last one
// (all of them are across its link). A healthy neighbour that only waits behind the cut must not
// be blamed.
int link_fault(int deadline_s) {
  RuntimeOptions o = options();
  o.collective_timeout = std::chrono::seconds(deadline_s);
  Runtime rt(o);
  const int cut = rt.world_size() - 1;
  std::vector<int> across;
  for (int r = 0; r < rt.world_size(); ++r)
    if (rt.rank() == cut ? r != cut : r == cut) across.push_back(r);
  std::vector<float> v((4u << 20) / sizeof(float), 1.0f);
  auto start = std::chrono::steady_clock::now();
  try {
    for (int i = 1; i <= 100000; ++i) {
      start = std::chrono::steady_clock::now();
      rt.comm().allreduce(v.data(), v.size(), comm::DataType::float32, comm::ReduceOp::avg);
      std::cout << "rank " << rt.rank() << ": allreduce " << i << " done" << std::endl;
    }
  } catch (const comm::Error& e) {
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string what = e.what();
    std::cout << "rank " << rt.rank() << " failed after " << waited << " s: " << what << std::endl;
    const std::vector<int> blames = blamed(what);
    std::cout << "rank " << rt.rank() << " blames rank(s) " << text_of(blames) << std::endl;
    // The deadline, then at most 5 s of probing, and a margin for a loaded host.
    if (blames == across && waited < deadline_s + 15) return 0;
    std::cerr << "rank " << rt.rank() << ": the error blames rank(s) " << text_of(blames)
              << " (expected " << text_of(across) << ", the rank(s) behind the cut link) or came "
              << "after " << waited << " s (deadline " << deadline_s << " s)\n";
    return 2;
  }
  std::cerr << "rank " << rt.rank() << ": every allreduce succeeded although a link was down\n";
  return 3;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string usage = "usage: troupe_netbed_rank network MIB | hosts PER_HOST | link_fault S";
  if (argc < 3) {
    std::cerr << usage << "\n";
    return 64;
  }
  const int arg = std::atoi(argv[2]);
  if (arg < 1) {
    std::cerr << "troupe_netbed_rank: argument '" << argv[2] << "' (expected a positive number)\n";
    return 64;
  }
  try {
    if (!std::strcmp(argv[1], "network")) return network(static_cast<size_t>(arg));
    if (!std::strcmp(argv[1], "hosts")) return hosts(arg);
    if (!std::strcmp(argv[1], "link_fault")) return link_fault(arg);
  } catch (const std::exception& e) {
    std::cerr << "troupe_netbed_rank " << argv[1] << ": " << e.what() << "\n";
    return 1;
  }
  std::cerr << "troupe_netbed_rank: unknown scenario '" << argv[1] << "'\n" << usage << "\n";
  return 64;
}
