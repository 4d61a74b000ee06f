#include "elastic/launch.h"

#include <doctest/doctest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/status.h"
#include "rank/compute_threads.h"

namespace {

using Clock = std::chrono::steady_clock;

/// One launch with its output captured and its wall time measured.
struct Run {
  troupe::LaunchResult result;
  std::string out;
  std::string err;
  double seconds = 0;
};

Run run(const troupe::LaunchOptions& options) {
  std::ostringstream out, err;
  auto start = Clock::now();
  Run r;
  r.result = troupe::launch(options, out, err);
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  r.out = out.str();
  r.err = err.str();
  return r;
}

troupe::LaunchOptions shell(int nprocs, const std::string& script) {
  troupe::LaunchOptions options;
  options.nprocs = nprocs;
  options.command = {"/bin/sh", "-c", script};
  return options;
}

/// A named pipe under /tmp, removed at scope exit: one rank blocks reading it until another has
/// reached a point in its script and writes it.
struct Fifo {
  Fifo() {
    static int count = 0;
    path = "/tmp/troupe_launch_test_" + std::to_string(getpid()) + "_" + std::to_string(count++);
    unlink(path.c_str());
    REQUIRE(mkfifo(path.c_str(), 0600) == 0);
  }
  ~Fifo() { unlink(path.c_str()); }
  std::string path;
};

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// True once process `pid` has exited (gone, or a zombie waiting for its new parent), polled
/// until a deadline because the kernel finishes an exit asynchronously.
bool exits_within(int pid, double seconds) {
  auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < deadline) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return true;
    auto close_paren = line.rfind(')');
    if (close_paren != std::string::npos && close_paren + 2 < line.size() &&
        (line[close_paren + 2] == 'Z' || line[close_paren + 2] == 'X')) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

}  // namespace

TEST_CASE("three ranks see their own RANK, the world size and one shared MASTER_PORT") {
  Run r = run(shell(3,
                    "echo rank=$RANK world=$WORLD_SIZE port=$MASTER_PORT "
                    "local=$LOCAL_RANK/$LOCAL_WORLD_SIZE addr=$MASTER_ADDR"));
  CHECK(r.result.exit_code == 0);
  CHECK(r.result.failed_rank == -1);
  CHECK(r.result.rank_exit_codes == std::vector<int>{0, 0, 0});
  CHECK(r.result.message == "all 3 ranks exited with status 0");
  std::regex line(R"(\[rank (\d)\] rank=(\d) world=3 port=(\d+) local=(\d)/3 addr=127\.0\.0\.1)");
  std::set<std::string> ranks, ports;
  std::istringstream lines(r.out);
  for (std::string text; std::getline(lines, text);) {
    std::smatch m;
    REQUIRE_MESSAGE(std::regex_match(text, m, line), text);
    CHECK(m[1] == m[2]);
    CHECK(m[1] == m[4]);
    ranks.insert(m[1]);
    ports.insert(m[3]);
  }
  CHECK(ranks == std::set<std::string>{"0", "1", "2"});
  REQUIRE(ports.size() == 1);
  CHECK(std::stoi(*ports.begin()) > 0);
  CHECK(r.err.find("[rank") == std::string::npos);  // only the launcher's compute-thread notice
}

TEST_CASE("an explicit master port and address reach every rank") {
  troupe::LaunchOptions options = shell(2, "echo $MASTER_ADDR:$MASTER_PORT");
  options.master_addr = "10.1.2.3";
  options.master_port = 29555;
  Run r = run(options);
  CHECK(r.result.exit_code == 0);
  CHECK(contains(r.out, "[rank 0] 10.1.2.3:29555\n"));
  CHECK(contains(r.out, "[rank 1] 10.1.2.3:29555\n"));
}

TEST_CASE("a failing rank stops the others quickly and is reported with its status") {
  Run r = run(shell(3, "if [ $RANK = 1 ]; then exit 3; fi; sleep 30"));
  CHECK(r.result.exit_code == 3);
  CHECK(r.result.failed_rank == 1);
  CHECK(r.result.rank_exit_codes == std::vector<int>{128 + SIGTERM, 3, 128 + SIGTERM});
  CHECK(r.result.message == "rank 1 exited with status 3; stopped ranks 0, 2");
  CHECK(r.seconds < 15);  // SIGTERM worked (143 above), so no grace period was waited out
}

TEST_CASE("a rank that ignores SIGTERM is killed once the grace period ends") {
  Fifo ready;  // rank 0 fails only once rank 1 ignores SIGTERM
  troupe::LaunchOptions options =
      shell(2, "if [ $RANK = 0 ]; then read x < " + ready.path + "; echo ready; exit 4; fi; " +
                   "trap '' TERM; echo > " + ready.path + "; sleep 30");
  options.grace_sec = 0.3;
  options.timeout_sec = 20;
  Run r = run(options);
  CHECK(r.result.failed_rank == 0);
  CHECK(r.result.exit_code == 4);
  CHECK(r.result.rank_exit_codes == std::vector<int>{4, 128 + SIGKILL});
  CHECK(r.out == "[rank 0] ready\n");
  CHECK(r.seconds < 15);
}

TEST_CASE("a rank killed by a signal is reported with the signal") {
  Run r = run(shell(2, "if [ $RANK = 1 ]; then kill -KILL $$; fi; sleep 30"));
  CHECK(r.result.failed_rank == 1);
  CHECK(r.result.exit_code == 128 + SIGKILL);
  CHECK(contains(r.result.message, "rank 1 was killed by signal 9"));
  CHECK(contains(r.result.message, "; stopped rank 0"));
}

TEST_CASE("with stop_on_failure off a failing rank is reported and the others run to the end") {
  // Rank 0 finishes only once the launcher has reaped rank 1 (kill -0 holds while a zombie).
  Fifo pid_of_rank1;
  troupe::LaunchOptions options =
      shell(2, "if [ $RANK = 1 ]; then echo $$ > " + pid_of_rank1.path + "; exit 3; fi; " +
                   "read pid < " + pid_of_rank1.path +
                   "; while kill -0 $pid 2>/dev/null; do :; done; echo done");
  options.stop_on_failure = false;
  options.timeout_sec = 20;
  Run r = run(options);
  CHECK(r.result.failed_rank == 1);
  CHECK(r.result.exit_code == 3);
  CHECK(r.result.rank_exit_codes == std::vector<int>{0, 3});
  CHECK(r.result.message ==
        "rank 1 exited with status 3; failed: rank 1; rank 0 ran on and exited with status 0");
  CHECK(r.out == "[rank 0] done\n");
}

TEST_CASE("no process started by a failed rank outlives the launch") {
  Fifo printed;  // rank 1 fails only once rank 0 has printed its child's pid
  troupe::LaunchOptions options =
      shell(2, "sleep 30 & echo child=$!; if [ $RANK = 1 ]; then read x < " + printed.path +
                   "; exit 3; fi; echo > " + printed.path + "; wait");
  options.timeout_sec = 20;
  Run r = run(options);
  CHECK(r.result.failed_rank == 1);
  std::regex child(R"(\[rank \d\] child=(\d+))");
  int checked = 0;
  for (std::sregex_iterator it(r.out.begin(), r.out.end(), child), end; it != end; ++it) {
    CHECK(exits_within(std::stoi((*it)[1]), 2));
    ++checked;
  }
  CHECK(checked == 2);
}

TEST_CASE("a program that is not in PATH fails naming it") {
  troupe::LaunchOptions options;
  options.nprocs = 2;
  options.command = {"troupe-no-such-program", "--flag"};
  Run r = run(options);
  CHECK(r.result.exit_code == 127);
  CHECK(r.result.failed_rank == 0);
  CHECK(r.result.message ==
        "cannot start 'troupe-no-such-program' for rank 0: not found in PATH (expected an "
        "executable file); rank 1 not started");
  CHECK(r.result.rank_exit_codes == std::vector<int>{127, -1});
}

TEST_CASE("a file that cannot be executed fails naming it and starts no further rank") {
  troupe::LaunchOptions options;
  options.nprocs = 3;
  options.command = {"/dev/null"};
  Run r = run(options);
  CHECK(r.result.exit_code == 126);
  CHECK(r.result.failed_rank == 0);
  CHECK(contains(r.result.message, "cannot start '/dev/null' for rank 0: Permission denied"));
  CHECK(contains(r.result.message, "ranks 1, 2 not started"));
  CHECK(r.result.rank_exit_codes == std::vector<int>{126, -1, -1});
}

TEST_CASE("timeout_sec stops every rank and reports the timeout") {
  troupe::LaunchOptions options = shell(2, "sleep 30");
  options.timeout_sec = 0.5;
  Run r = run(options);
  CHECK(r.result.exit_code == 124);
  CHECK(r.result.failed_rank == -1);
  CHECK(r.result.message == "timed out after 0.5 s; stopped ranks 0, 1");
  CHECK(r.result.rank_exit_codes == std::vector<int>{128 + SIGTERM, 128 + SIGTERM});
  CHECK(r.seconds >= 0.5);
  CHECK(r.seconds < 15);
}

TEST_CASE("SIGTERM sent to the launcher stops the ranks") {
  Run r = run(shell(2, "if [ $RANK = 0 ]; then kill -TERM $PPID; fi; sleep 30"));
  CHECK(r.result.exit_code == 128 + SIGTERM);
  CHECK(r.result.failed_rank == -1);
  CHECK(r.result.message == "launcher received SIGTERM; stopped ranks 0, 1");
  CHECK(r.result.rank_exit_codes == std::vector<int>{128 + SIGTERM, 128 + SIGTERM});
  CHECK(r.seconds < 15);
}

TEST_CASE("stderr goes to the err stream and a last line without newline is not lost") {
  Run r = run(shell(1, "echo out; echo oops >&2; printf 'a\\nb\\nno newline'"));
  CHECK(r.result.exit_code == 0);
  CHECK(r.out == "[rank 0] out\n[rank 0] a\n[rank 0] b\n[rank 0] no newline\n");
  CHECK(r.err == "[rank 0] oops\n");
}

TEST_CASE("without prefixes output passes through unchanged") {
  troupe::LaunchOptions options = shell(1, "printf 'x\\ny'");
  options.prefix_output = false;
  Run r = run(options);
  CHECK(r.out == "x\ny");
}

TEST_CASE("extra_env reaches the ranks but cannot override the rank variables") {
  troupe::LaunchOptions options = shell(2, "echo $TROUPE_TEST_VALUE $RANK");
  options.extra_env = {{"TROUPE_TEST_VALUE", "hello"}, {"RANK", "7"}};
  Run r = run(options);
  CHECK(contains(r.out, "[rank 0] hello 0\n"));
  CHECK(contains(r.out, "[rank 1] hello 1\n"));
}

TEST_CASE("invalid launch options are errors naming the option") {
  troupe::LaunchOptions options = shell(0, "true");
  CHECK_THROWS_WITH_AS(troupe::launch(options),
                       "LaunchOptions.nprocs=0 is not positive (expected at least 1)",
                       troupe::comm::Error);
  options = troupe::LaunchOptions{};
  CHECK_THROWS_WITH_AS(troupe::launch(options),
                       "LaunchOptions.command is empty (expected a program and its arguments)",
                       troupe::comm::Error);
  options = shell(1, "true");
  options.master_port = 70000;
  CHECK_THROWS_AS(troupe::launch(options), troupe::comm::Error);
  options = shell(1, "true");
  options.timeout_sec = -1;
  CHECK_THROWS_AS(troupe::launch(options), troupe::comm::Error);
}

TEST_CASE("pick_free_port returns a port that can be bound on 127.0.0.1") {
  int port = troupe::pick_free_port();
  REQUIRE(port > 0);
  REQUIRE(port <= 65535);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  CHECK(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  close(fd);
}

namespace {

// The distinct lines the ranks of a successful launch printed, without their "[rank R] " prefix.
std::set<std::string> printed_lines(const troupe::LaunchOptions& options) {
  auto r = run(options);
  REQUIRE(r.result.exit_code == 0);
  std::set<std::string> seen;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) seen.insert(line.substr(line.find("] ") + 2));
  return seen;
}

}  // namespace

TEST_CASE("every rank of a launch gets the same fresh job secret unless the launcher has one") {
  const auto secrets = printed_lines;
  auto options = shell(3, "echo \"$TROUPE_JOB_SECRET\"");
  const auto first = secrets(options);
  REQUIRE(first.size() == 1);  // the same on every rank
  CHECK(std::regex_match(*first.begin(), std::regex("[0-9a-f]{64}")));
  const auto second = secrets(options);
  REQUIRE(second.size() == 1);
  CHECK(*second.begin() != *first.begin());  // a new one for each launch
  options.extra_env = {{"TROUPE_JOB_SECRET", "one-secret-for-many-nodes"}};
  CHECK(secrets(options) == std::set<std::string>{"one-secret-for-many-nodes"});
}

TEST_CASE(
    "every rank of a launch gets the same fresh job id unless one is given, and a bad one is "
    "refused") {
  const auto ids = printed_lines;
  auto options = shell(3, "echo \"$TROUPE_JOB_ID\"");
  const auto first = ids(options);
  REQUIRE(first.size() == 1);  // the same on every rank
  CHECK(std::regex_match(*first.begin(), std::regex("[0-9a-f]{32}")));
  const auto second = ids(options);
  REQUIRE(second.size() == 1);
  CHECK(*second.begin() != *first.begin());  // a new one for each launch
  options.extra_env = {{"TROUPE_JOB_ID", "from-the-environment"}};
  CHECK(ids(options) == std::set<std::string>{"from-the-environment"});
  options.job_id = "given.job-1";  // --job-id wins
  CHECK(ids(options) == std::set<std::string>{"given.job-1"});
  options.job_id = "two words";
  CHECK_THROWS_WITH(troupe::launch(options),
                    doctest::Contains("job_id (--job-id) = 'two words' is invalid (expected 1..128 "
                                      "of A-Z, a-z, 0-9, '.', '_', '-')"));
}

namespace {

/// The CPUs of a Cpus_allowed_list line ("0-3,8,10-11").
std::set<int> cpu_list(const std::string& text) {
  std::set<int> cpus;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) {
    const auto dash = part.find('-');
    const int lo = std::stoi(part.substr(0, dash));
    const int hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
    for (int c = lo; c <= hi; ++c) cpus.insert(c);
  }
  return cpus;
}

}  // namespace

TEST_CASE(
    "bind_cores gives each rank its own equal share of the launcher's cores, and refuses "
    "more ranks than cores") {
  const int cores = troupe::available_cores();
  if (cores < 2) {
    MESSAGE("fewer than 2 cores: nothing to divide, skipped");
    return;
  }
  troupe::LaunchOptions options =
      shell(2, "sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' /proc/self/status");
  options.bind_cores = true;
  Run bound = run(options);
  REQUIRE(bound.result.exit_code == 0);
  const std::regex line(R"(\[rank (\d)\] ([0-9,-]+))");
  std::vector<std::set<int>> sets(2);
  for (std::sregex_iterator it(bound.out.begin(), bound.out.end(), line), end; it != end; ++it)
    sets[static_cast<size_t>(std::stoi((*it)[1]))] = cpu_list((*it)[2]);
  INFO("output: " << bound.out);
  CHECK(sets[0].size() == static_cast<size_t>(cores / 2));
  CHECK(sets[1].size() == static_cast<size_t>(cores / 2));
  CHECK(*sets[0].rbegin() < *sets[1].begin());  // rank 0 the lower cores, no overlap

  options.bind_cores = false;  // unbound: every rank may run on every core of the launcher
  Run free = run(options);
  REQUIRE(free.result.exit_code == 0);
  CHECK(contains(free.out, "[rank 1] "));
  for (std::sregex_iterator it(free.out.begin(), free.out.end(), line), end; it != end; ++it)
    CHECK(cpu_list((*it)[2]).size() == static_cast<size_t>(cores));

  options = shell(cores + 1, "true");
  options.bind_cores = true;
  const std::string refusal =
      "bind_cores (--bind-cores) with " + std::to_string(cores + 1) + " processes";
  CHECK_THROWS_WITH_AS(troupe::launch(options), doctest::Contains(refusal.c_str()),
                       troupe::comm::Error);
}
