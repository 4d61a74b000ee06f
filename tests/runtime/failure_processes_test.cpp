// Failures between real processes: a stopped (SIGSTOP) rank 0 fails a joining rank at its
// rendezvous deadline; a rank process that gives up with an exception ends the others' steps at
// once, naming it (and its error when it called Runtime::fail); and `troupe run` of a gossip job
// lets the survivors of a dead rank finish, then says which rank failed.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/transport/inproc/transport.h"
#include "elastic/launch.h"
#include "rank/runtime.h"
#include "tests/support/stop_process.h"

extern char** environ;

using namespace troupe;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

bool port_accepts(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  bool ok = connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0;
  close(fd);
  return ok;
}

/// Rank 0 of a world of 2 as a child process (troupe_test_rank, waiting at its rendezvous for
/// rank 1); killed and reaped when the test ends, stopped or not.
class RankZero {
 public:
  explicit RankZero(int port) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) env.push_back(*e);
    for (std::string v :
         {"RANK=0", "WORLD_SIZE=2", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1"})
      env.push_back(v);
    env.push_back("MASTER_PORT=" + std::to_string(port));
    std::vector<char*> envp, argv;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::string program = TROUPE_TEST_RANK_BIN, scenario = "collectives";
    argv = {program.data(), scenario.data(), nullptr};
    REQUIRE(posix_spawn(&pid_, program.c_str(), nullptr, nullptr, argv.data(), envp.data()) == 0);
  }
  ~RankZero() {
    kill(pid_, SIGKILL);  // ends a stopped process too
    waitpid(pid_, nullptr, 0);
  }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
};

std::string write_file(const std::string& name, const std::string& text) {
  std::string path = "/tmp/troupe_failure_test_" + std::to_string(getpid()) + "_" + name;
  std::ofstream(path) << text;
  return path;
}

}  // namespace

TEST_CASE("a rank joining a stopped rank 0 fails at its rendezvous deadline naming host:port") {
  const int port = pick_free_port();
  RankZero rank0(port);
  // Readiness, not timing: rank 0 listens once its directory is published.
  const auto give_up = Clock::now() + 60s;
  while (!port_accepts(port) && Clock::now() < give_up) std::this_thread::sleep_for(20ms);
  REQUIRE(port_accepts(port));
  test::stop_process(rank0.pid());  // waits until none of its threads can welcome rank 1

  RuntimeOptions o;
  RankInfo info;
  info.rank = 1;
  info.world_size = 2;
  info.local_rank = 1;
  info.local_world_size = 2;
  info.master_port = port;
  info.source = "explicit";
  o.rank_info = info;
  o.transport = "inproc";
  o.fabric = std::make_shared<comm::InprocFabric>(2);
  o.scheduler_threads = 1;
  o.rendezvous_timeout = 2000ms;
  const auto start = Clock::now();
  std::string error;
  try {
    Runtime rt(o);
  } catch (const comm::Error& e) {
    error = e.what();
  }
  const auto took = Clock::now() - start;
  CAPTURE(error);
  MESSAGE("rank 1 gave up after " << std::chrono::duration<double>(took).count()
                                  << " s: " << error);
  CHECK(error.find("127.0.0.1:" + std::to_string(port)) != std::string::npos);
  CHECK(error.find("2000 ms") != std::string::npos);
  CHECK(took < 2000ms + 3s);
}

TEST_CASE(
    "a rank process that gives up with an exception ends the others' steps at once, naming it") {
  for (const char* scenario : {"ddp_fail_one", "ddp_throw_one"}) {
    CAPTURE(scenario);
    LaunchOptions o;
    o.nprocs = 3;
    o.command = {TROUPE_TEST_RANK_BIN, scenario};
    o.timeout_sec = 120;
    o.stop_on_failure = false;
    o.extra_env = {{"UCX_TLS", "sm,self"}};
    std::ostringstream out, err;
    auto r = launch(o, out, err);
    const std::string log = out.str() + err.str();
    INFO(log);
    REQUIRE(r.rank_exit_codes.size() == 3);
    CHECK(r.rank_exit_codes[2] == 1);  // main's catch: the exception's way out
    CHECK(r.rank_exit_codes[0] == 0);  // each survivor checks its own error and its timing
    CHECK(r.rank_exit_codes[1] == 0);
  }
}

TEST_CASE("troupe run of a gossip job lets the survivors of a dead rank finish and names it") {
  // The trainer of the job, with the example's test-only failure injection: rank 2 exits at
  // step 20 with status 3.
  const std::string bin = TROUPE_BIN;
  const std::string trainer = bin.substr(0, bin.rfind('/') + 1) + "fashion_mnist";
  auto script = write_file("trainer.sh",
                           "#!/bin/sh\nexec " + trainer + " \"$@\" --die-rank 2 --die-step 20\n");
  REQUIRE(chmod(script.c_str(), 0755) == 0);
  auto job = write_file("ring.toml",
                        "[job]\nworld_size = 3\nmode = \"processes\"\n"
                        "timeout_sec = 240\n"
                        "[topology]\nkind = \"ring\"\n"
                        "[algorithm]\nname = \"decentralized\"\n"
                        "[trainer]\nprogram = \"" +
                            script +
                            "\"\n"
                            "model = \"mlp\"\nepochs = 1\nbatch = 128\nlog_every = 50\n");
  std::string text;
  FILE* pipe = popen((bin + " run " + job + " 2>&1").c_str(), "r");
  REQUIRE(pipe);
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, pipe)) > 0;) text.append(buf, n);
  const int status = pclose(pipe);
  INFO(text);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 3);  // the dead rank's status
  CHECK(text.find("[rank 2] exiting abruptly at step 20") != std::string::npos);
  CHECK(text.find("[rank 0] finished without dropped peer(s) 2") != std::string::npos);
  CHECK(text.find("[rank 1] finished without dropped peer(s) 2") != std::string::npos);
  CHECK(text.find("[rank 0] epoch 1 test accuracy") != std::string::npos);
  CHECK(text.find("troupe run: rank 2 exited with status 3; failed: rank 2; ranks 0, 1 ran on "
                  "and exited with status 0") != std::string::npos);
  std::remove(script.c_str());
  std::remove(job.c_str());
}
