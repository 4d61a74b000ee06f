// TcpStore, the client of torchrun's c10d TCPStore: values both ways against LibTorch's server and
// against PyTorch's Python one (where installed), deadlines and bad arguments; and thread ranks
// that rendezvous through such a store as they do under torchrun's agent.
#include "tests/support/torch_doctest.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "comm/transport/inproc/transport.h"
#include "rank/env.h"
#include "rank/tcp_store.h"
#include "tests/support/skip.h"
#include "tests/support/thread_ranks.h"
#include "tests/support/torchrun.h"

using namespace troupe;
using namespace std::chrono_literals;

namespace {

/// A c10d TCPStore server on a free port of 127.0.0.1, as torchrun's agent runs one.
std::unique_ptr<c10d::TCPStore> store_server() {
  c10d::TCPStoreOptions o;
  o.port = 0;
  o.isServer = true;
  o.waitWorkers = false;
  o.timeout = 20s;
  return std::make_unique<c10d::TCPStore>("127.0.0.1", o);
}

std::string text(const std::vector<uint8_t>& bytes) {
  return std::string(bytes.begin(), bytes.end());
}

template <typename Call>
std::string error_of(Call&& call) {
  try {
    call();
  } catch (const comm::Error& e) {
    return e.what();
  }
  return "no comm::Error";
}

}  // namespace

TEST_CASE("a TcpStore sets and gets binary values through LibTorch's TCPStore server") {
  auto server = store_server();
  TcpStore client("127.0.0.1", server->getPort(), 20s);
  const std::string binary("a\0b\xff", 4);
  client.set("from_client", binary);
  CHECK(text(server->get("from_client")) == binary);
  const std::string value = "from the server";
  server->set("from_server", std::vector<uint8_t>(value.begin(), value.end()));
  CHECK(client.get("from_server", 5s) == value);
}

TEST_CASE("a TcpStore get of a key nobody sets fails at its deadline, naming host, port and key") {
  auto server = store_server();
  TcpStore client("127.0.0.1", server->getPort(), 20s);
  const auto start = std::chrono::steady_clock::now();
  const std::string what = error_of([&] { client.get("never/set", 300ms); });
  const auto waited = std::chrono::steady_clock::now() - start;
  CAPTURE(what);
  CHECK(what.find("key 'never/set' was not set in the TCPStore at 127.0.0.1:" +
                  std::to_string(server->getPort()) + " within 300 ms") != std::string::npos);
  CHECK(waited >= 300ms);
  CHECK(waited < 20s);
}

TEST_CASE("a TcpStore with nobody listening fails at its deadline, naming host and port") {
  const int port = pick_free_port();
  const auto start = std::chrono::steady_clock::now();
  const std::string what = error_of([&] { TcpStore("127.0.0.1", port, 500ms); });
  const auto waited = std::chrono::steady_clock::now() - start;
  CAPTURE(what);
  CHECK(what.find("cannot reach the TCPStore at 127.0.0.1:" + std::to_string(port) +
                  " within 500 ms") != std::string::npos);
  CHECK(waited < 20s);
}

TEST_CASE("bad TcpStore arguments are refused, naming them") {
  CHECK(error_of([] {
          TcpStore("localhost", 0, 1s);
        }).find("port 0 of host 'localhost' (expected 1..65535)") != std::string::npos);
  CHECK(error_of([] { TcpStore("localhost", 70000, 1s); }).find("port 70000") != std::string::npos);
  CHECK(error_of([] {
          TcpStore("localhost", 29500, 0ms);
        }).find("timeout 0 ms for localhost:29500 (expected > 0)") != std::string::npos);
  auto server = store_server();
  TcpStore client("127.0.0.1", server->getPort(), 20s);
  CHECK(error_of([&] { client.get("k", 0ms); }).find("of key 'k'") != std::string::npos);
}

TEST_CASE("a TcpStore talks to PyTorch's own TCPStore server in Python") {
  const std::string python = test::torch_python();
  if (python.empty()) {
    test::skip_case(
        "no torchrun (scripts/setup installs the torch wheel in .venv): no Python TCPStore");
    return;
  }
  // The server prints its port, sets a key, waits (30 s at most) for ours and prints it.
  const std::string script =
      "import datetime\n"
      "from torch.distributed import TCPStore\n"
      "s = TCPStore('127.0.0.1', 0, None, True, datetime.timedelta(seconds=30), "
      "wait_for_workers=False)\n"
      "print(s.port, flush=True)\n"
      "s.set('from_python', 'hello from python')\n"
      "s.wait(['from_cpp'])\n"
      "print(s.get('from_cpp').decode(), flush=True)\n";
  const std::string command = python + " -c \"" + script + "\"";
  FILE* pipe = popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  char line[256] = {};
  std::string port_line = fgets(line, sizeof(line), pipe) ? line : "";
  CAPTURE(port_line);
  const int port = std::atoi(port_line.c_str());
  std::string got, echoed;
  if (port > 0) {
    TcpStore client("127.0.0.1", port, 20s);
    got = client.get("from_python", 20s);
    client.set("from_cpp", "hello from troupe");
    echoed = fgets(line, sizeof(line), pipe) ? line : "";
  }
  const int status = pclose(pipe);
  CHECK(port > 0);
  CHECK(got == "hello from python");
  CHECK(echoed == "hello from troupe\n");
  CHECK(status == 0);
}

TEST_CASE("torchrun's agent-store variables give the directory's key in the store, per attempt") {
  std::map<std::string, std::string> env = {{"RANK", "1"},
                                            {"WORLD_SIZE", "2"},
                                            {"MASTER_PORT", "29400"},
                                            {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                            {"TORCHELASTIC_RUN_ID", "job7"},
                                            {"TORCHELASTIC_RESTART_COUNT", "2"}};
  auto getenv = [&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  CHECK(rank_info_from_env(getenv).agent_store_key == "troupe/directory/job7/2");
  env["TORCHELASTIC_USE_AGENT_STORE"] =
      "False";  // --standalone, c10d rendezvous: MASTER_PORT is free
  CHECK(rank_info_from_env(getenv).agent_store_key == "");
  env.erase("TORCHELASTIC_USE_AGENT_STORE");
  CHECK(rank_info_from_env(getenv).agent_store_key == "");
}

TEST_CASE("ranks behind torchrun's agent store meet at the port rank 0 writes into the store") {
  auto server = store_server();  // the agent's store, holding MASTER_PORT
  const int world = 3;
  std::vector<float> sums(world, -1);
  // Twice: the second Runtime of the job has a key of its own, not the first one's port.
  for (int round = 0; round < 2; ++round) {
    auto fabric = std::make_shared<comm::InprocFabric>(world);
    std::vector<RuntimeOptions> options;
    for (int r = 0; r < world; ++r) {
      options.push_back(test::thread_rank(r, world, server->getPort(), fabric));
      options.back().rank_info->agent_store_key = "troupe/directory/test/0";
    }
    auto errors = test::run_ranks(options, [&](int r, Runtime& rt) {
      float value = static_cast<float>(r + 1);
      rt.comm().allreduce(&value, 1, comm::DataType::float32, comm::ReduceOp::sum);
      sums[static_cast<size_t>(r)] = value;
    });
    for (auto& e : errors) CHECK(e == "");
    for (float s : sums) CHECK(s == 6.0f);
    const std::string port = text(server->get("troupe/directory/test/0/" + std::to_string(round)));
    CAPTURE(port);
    CHECK(std::atoi(port.c_str()) > 0);
    CHECK(std::atoi(port.c_str()) != server->getPort());
  }
}
