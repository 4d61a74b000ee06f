#include "tools/cli/bench_allreduce.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <future>
#include <iostream>
#include <map>

#include "comm/transport/inproc/transport.h"
#include "elastic/launch.h"
#include "rank/env.h"
#include "rank/runtime.h"
#include "tools/cli/option_checks.h"

namespace troupe::cli {

namespace {

struct Row {
  size_t bytes;
  double sec;
  size_t chunk_bytes;  // the ring's chunk the ranks used (the layout's default unless set)
};

// Every rank runs this; all ranks agree on iteration counts through allreduce, and the time of an
// allreduce is the slowest rank's.
std::vector<Row> measure(Runtime& rt, const AllreduceBench& bench) {
  auto& comm = rt.comm();
  std::vector<Row> rows;
  for (size_t bytes : bench.bytes) {
    const size_t count = bytes / sizeof(float);
    std::vector<float> data(count, 1.0f);
    for (int i = 0; i < 2; ++i)
      comm.allreduce(data.data(), count, comm::DataType::float32, comm::ReduceOp::sum);
    // Calibrate: how many iterations fill seconds_per_size.
    comm.barrier();
    auto t0 = std::chrono::steady_clock::now();
    comm.allreduce(data.data(), count, comm::DataType::float32, comm::ReduceOp::sum);
    double one = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    comm.allreduce(&one, 1, comm::DataType::float64, comm::ReduceOp::max);
    int64_t iters =
        std::clamp<int64_t>(static_cast<int64_t>(bench.seconds_per_size / one), 3, 20000);
    comm.barrier();
    t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < iters; ++i)
      comm.allreduce(data.data(), count, comm::DataType::float32, comm::ReduceOp::sum);
    double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
                 static_cast<double>(iters);
    comm.allreduce(&sec, 1, comm::DataType::float64, comm::ReduceOp::max);
    rows.push_back(Row{count * sizeof(float), sec, comm.options().chunk_bytes});
  }
  return rows;
}

std::string human(size_t bytes) {
  char buf[32];
  if (bytes >= (size_t{1} << 30) && bytes % (size_t{1} << 30) == 0)
    std::snprintf(buf, sizeof buf, "%zuGiB", bytes >> 30);
  else if (bytes >= (size_t{1} << 20) && bytes % (size_t{1} << 20) == 0)
    std::snprintf(buf, sizeof buf, "%zuMiB", bytes >> 20);
  else if (bytes >= 1024 && bytes % 1024 == 0)
    std::snprintf(buf, sizeof buf, "%zuKiB", bytes >> 10);
  else
    std::snprintf(buf, sizeof buf, "%zuB", bytes);
  return buf;
}

/// "1gbit,5ms; rank 1=100mbit,20ms", or "" without link emulation.
std::string link_text(const AllreduceBench& bench) {
  std::string text = bench.link;
  for (const std::string& entry : bench.link_ranks)
    text += (text.empty() ? "rank " : "; rank ") + entry;
  return text;
}

void print(const std::vector<Row>& rows, const AllreduceBench& bench, bool shared_memory) {
  const int W = bench.world;
  const std::string link = link_text(bench);
  const std::string over =
      (shared_memory ? std::string("shared memory (above ") + human(bench.tuning.small_bytes) +
                           "; " + bench.transport + " below)"
                     : bench.transport) +
      (link.empty() ? "" : " (emulated link " + link + ")");
  const std::string link_json = link.empty() ? "" : ", \"link\": \"" + link + "\"";
  if (!bench.json)
    std::printf("troupe allreduce, %d ranks over %s, float32 sum\n%10s %12s %12s %12s\n", W,
                over.c_str(), "bytes", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
  for (auto& r : rows) {
    double algbw = static_cast<double>(r.bytes) / r.sec / 1e9;
    double busbw = algbw * 2.0 * (W - 1) / W;
    if (bench.json)
      std::printf(
          "{\"bytes\": %zu, \"world\": %d, \"transport\": \"%s\"%s, \"sec\": %.9g, "
          "\"algbw_GBps\": %.6g, \"busbw_GBps\": %.6g, \"chunk_bytes\": %zu, "
          "\"shared_memory\": %s}\n",
          r.bytes, W, bench.transport.c_str(), link_json.c_str(), r.sec, algbw, busbw,
          r.chunk_bytes, shared_memory && r.bytes > bench.tuning.small_bytes ? "true" : "false");
    else
      std::printf("%10s %12.1f %12.3f %12.3f\n", human(r.bytes).c_str(), r.sec * 1e6, algbw, busbw);
  }
  std::fflush(stdout);
}

}  // namespace

int run_allreduce_bench_rank(const AllreduceBench& bench) {
  RuntimeOptions options;
  options.scheduler_threads = 1;
  options.collectives = bench.tuning;
  Runtime rt(options);
  auto rows = measure(rt, bench);
  if (rt.rank() == 0) print(rows, bench, rt.comm().uses_shared_memory());
  return 0;
}

int run_allreduce_bench(const AllreduceBench& bench, const std::string& self_exe) {
  if (bench.world < 1)
    throw comm::Error("--world " + std::to_string(bench.world) + " (expected >= 1)");
  // Every rank runs on this host and holds a buffer of the largest size: refuse what cannot be
  // allocated before any rank starts (a lower bound: the transports' buffers come on top).
  const size_t largest = *std::max_element(bench.bytes.begin(), bench.bytes.end());
  check_memory(static_cast<uint64_t>(largest) * static_cast<uint64_t>(bench.world),
               available_memory(),
               "--bytes " + human(largest) + " on " + std::to_string(bench.world) + " rank(s)");
  const auto link_env = link_emulation_env(bench.link, bench.link_ranks, bench.world);
  if (bench.transport == "inproc") {
    // The ranks are threads of this process: each gets the emulation in its options.
    const std::map<std::string, std::string> vars(link_env.begin(), link_env.end());
    const comm::LinkEmulation links =
        link_emulation_from_env(bench.world, [&vars](const char* name) -> const char* {
          auto it = vars.find(name);
          return it == vars.end() ? nullptr : it->second.c_str();
        });
    auto fabric = std::make_shared<comm::InprocFabric>(bench.world);
    const int port = pick_free_port();
    std::vector<std::future<std::vector<Row>>> ranks;
    for (int r = 0; r < bench.world; ++r)
      ranks.push_back(std::async(std::launch::async, [&, r] {
        RuntimeOptions options;
        options.transport = "inproc";
        options.fabric = fabric;
        options.scheduler_threads = 1;
        options.collectives = bench.tuning;
        options.links = links;
        RankInfo info;
        info.rank = r;
        info.world_size = bench.world;
        info.local_rank = r;
        info.local_world_size = bench.world;
        info.master_port = port;
        info.source = "explicit";
        options.rank_info = info;
        Runtime rt(options);
        return measure(rt, bench);
      }));
    std::vector<Row> rows;
    for (int r = 0; r < bench.world; ++r) {
      auto got = ranks[r].get();
      if (r == 0) rows = got;
    }
    print(rows, bench, false);
    return 0;
  }
  if (bench.transport != "ucx")
    throw comm::Error("--transport '" + bench.transport + "' (expected ucx or inproc)");
  LaunchOptions launch_options;
  launch_options.nprocs = bench.world;
  launch_options.prefix_output = false;
  launch_options.bind_cores = bench.bind_cores;
  launch_options.extra_env = link_env;
  launch_options.command = {self_exe,      "bench",   "allreduce",
                            "--as-rank",   "--world", std::to_string(bench.world),
                            "--transport", "ucx",     "--bytes"};
  std::string sizes;
  for (size_t b : bench.bytes) sizes += (sizes.empty() ? "" : ",") + std::to_string(b);
  launch_options.command.push_back(sizes);
  launch_options.command.push_back("--seconds");
  launch_options.command.push_back(std::to_string(bench.seconds_per_size));
  if (bench.json) launch_options.command.push_back("--json");
  for (auto& arg : {std::string("--small-bytes"), std::to_string(bench.tuning.small_bytes),
                    std::string("--max-lanes"), std::to_string(bench.tuning.max_lanes)})
    launch_options.command.push_back(arg);
  if (!bench.tuning.shared_memory) launch_options.command.push_back("--no-shared-memory");
  if (bench.tuning.chunk_bytes != 0)  // else each rank takes its layout's default
    launch_options.command.insert(launch_options.command.end(),
                                  {"--chunk-bytes", std::to_string(bench.tuning.chunk_bytes)});
  // For the header that rank 0 prints; the ranks' runtimes read the environment.
  auto& command = launch_options.command;
  if (!bench.link.empty()) command.insert(command.end(), {"--link", bench.link});
  for (const std::string& entry : bench.link_ranks)
    command.insert(command.end(), {"--link-rank", entry});
  auto result = launch(launch_options);
  if (result.exit_code != 0) std::cerr << "troupe bench: " << result.message << "\n";
  return result.exit_code;
}

}  // namespace troupe::cli
