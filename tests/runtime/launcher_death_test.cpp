// Ranks die with their launcher: a `troupe launch` killed with SIGKILL (which it cannot catch, so
// it cannot stop its ranks) leaves no rank running.
#include <dirent.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

/// The state letter and parent of process `pid` from /proc/PID/stat; state 0 when it is gone.
struct ProcStat {
  char state = 0;
  int parent = 0;
  std::string name;
};

ProcStat proc_stat(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  ProcStat stat;
  if (!std::getline(in, line)) return stat;
  const auto open = line.find('('), close = line.rfind(')');
  if (open == std::string::npos || close == std::string::npos || close + 4 > line.size())
    return stat;
  stat.name = line.substr(open + 1, close - open - 1);
  stat.state = line[close + 2];
  stat.parent = std::stoi(line.substr(close + 4));
  return stat;
}

/// The processes whose parent is `parent` and whose name is `name`.
std::vector<int> children_named(int parent, const std::string& name) {
  std::vector<int> found;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return found;
  while (dirent* entry = readdir(proc)) {
    const int pid = std::atoi(entry->d_name);
    if (pid <= 0) continue;
    const ProcStat stat = proc_stat(pid);
    if (stat.parent == parent && stat.name == name && stat.state != 'Z') found.push_back(pid);
  }
  closedir(proc);
  return found;
}

/// True while `pid` runs (neither gone nor a zombie).
bool alive(int pid) {
  const char state = proc_stat(pid).state;
  return state != 0 && state != 'Z' && state != 'X';
}

}  // namespace

TEST_CASE("the ranks of a launcher killed with SIGKILL die within seconds instead of running on") {
  std::vector<std::string> args = {TROUPE_BIN, "launch", "-n", "2", "--", "sleep", "300"};
  std::vector<char*> argv;
  for (auto& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  pid_t launcher = -1;
  REQUIRE(posix_spawn(&launcher, argv[0], &actions, nullptr, argv.data(), environ) == 0);
  posix_spawn_file_actions_destroy(&actions);

  // Both ranks have started sleep (exec done) before the launcher is killed.
  std::vector<int> ranks;
  for (auto deadline = Clock::now() + std::chrono::seconds(30);
       ranks.size() < 2 && Clock::now() < deadline;
       std::this_thread::sleep_for(std::chrono::milliseconds(10)))
    ranks = children_named(launcher, "sleep");
  REQUIRE(ranks.size() == 2);

  REQUIRE(kill(launcher, SIGKILL) == 0);
  int status = 0;
  REQUIRE(waitpid(launcher, &status, 0) == launcher);
  CHECK(WIFSIGNALED(status));

  std::vector<int> survivors = ranks;
  for (auto deadline = Clock::now() + std::chrono::seconds(10);
       !survivors.empty() && Clock::now() < deadline;
       std::this_thread::sleep_for(std::chrono::milliseconds(10))) {
    std::vector<int> still;
    for (int pid : survivors)
      if (alive(pid)) still.push_back(pid);
    survivors = still;
  }
  CHECK_MESSAGE(survivors.empty(), survivors.size(),
                " rank(s) still running 10 s after the launcher died");
  for (int pid : survivors) kill(pid, SIGKILL);  // leave no orphan behind when it fails
}
