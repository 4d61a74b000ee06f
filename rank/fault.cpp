#include "rank/fault.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <mutex>

#include "comm/status.h"

namespace troupe {

namespace {

constexpr const char* kExpected =
    "expected kill:rank=R,step=S[,phase=backward|reduce|optimizer|rendezvous|heal][,life=L], "
    "several separated by ';'";

int64_t parse_count(const std::string& value, const std::string& key, const std::string& where) {
  bool digits =
      !value.empty() && value.size() <= 18 &&
      std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (!digits)
    throw comm::Error(where + ": " + key + "='" + value + "' is not a non-negative integer (" +
                      kExpected + ")");
  return std::stoll(value);
}

Fault parse_one(const std::string& item, const std::string& where) {
  const std::string action = "kill:";
  if (item.compare(0, action.size(), action) != 0)
    throw comm::Error(where + ": '" + item + "' does not start with 'kill:' (" + kExpected + ")");
  Fault fault;
  bool has_rank = false, has_step = false, has_phase = false, has_life = false;
  const std::string rest = item.substr(action.size());
  for (size_t begin = 0; begin <= rest.size();) {
    size_t end = rest.find(',', begin);
    if (end == std::string::npos) end = rest.size();
    const std::string pair = rest.substr(begin, end - begin);
    begin = end + 1;
    const size_t eq = pair.find('=');
    if (eq == std::string::npos)
      throw comm::Error(where + ": '" + pair + "' in '" + item + "' is not key=value (" +
                        kExpected + ")");
    const std::string key = pair.substr(0, eq), value = pair.substr(eq + 1);
    bool* seen = key == "rank"    ? &has_rank
                 : key == "step"  ? &has_step
                 : key == "phase" ? &has_phase
                 : key == "life"  ? &has_life
                                  : nullptr;
    if (!seen)
      throw comm::Error(where + ": unknown key '" + key + "' in '" + item + "' (" + kExpected +
                        ")");
    if (*seen)
      throw comm::Error(where + ": key '" + key + "' appears twice in '" + item + "' (" +
                        kExpected + ")");
    *seen = true;
    if (key == "rank") {
      const int64_t rank = parse_count(value, key, where);
      if (rank > 65535)
        throw comm::Error(where + ": rank=" + value + " is out of range (expected 0..65535)");
      fault.rank = static_cast<int>(rank);
    } else if (key == "step") {
      fault.step = value == "any" ? kAnyStep : parse_count(value, key, where);
    } else if (key == "life") {
      const int64_t life = parse_count(value, key, where);
      if (life > 1000000)
        throw comm::Error(where + ": life=" + value + " is out of range (expected 0..1000000)");
      fault.life = static_cast<int>(life);
    } else if (value == "backward") {
      fault.phase = FaultPhase::backward;
    } else if (value == "reduce") {
      fault.phase = FaultPhase::reduce;
    } else if (value == "optimizer") {
      fault.phase = FaultPhase::optimizer;
    } else if (value == "rendezvous") {
      fault.phase = FaultPhase::rendezvous;
    } else if (value == "heal") {
      fault.phase = FaultPhase::heal;
    } else {
      throw comm::Error(where + ": phase='" + value + "' in '" + item +
                        "' (expected backward, reduce, optimizer, rendezvous or heal)");
    }
  }
  if (!has_rank || !has_step)
    throw comm::Error(where + ": '" + item + "' lacks " + (!has_rank ? "rank=" : "step=") + " (" +
                      kExpected + ")");
  if (fault.step == kAnyStep && fault.phase != FaultPhase::rendezvous &&
      fault.phase != FaultPhase::heal)
    throw comm::Error(where + ": step=any in '" + item + "' with phase " +
                      fault_phase_name(fault.phase) +
                      " (expected a step number; any is for phase rendezvous or heal)");
  return fault;
}

}  // namespace

const char* fault_phase_name(FaultPhase phase) {
  switch (phase) {
    case FaultPhase::backward:
      return "backward";
    case FaultPhase::reduce:
      return "reduce";
    case FaultPhase::optimizer:
      return "optimizer";
    case FaultPhase::rendezvous:
      return "rendezvous";
    case FaultPhase::heal:
      return "heal";
  }
  return "?";
}

std::vector<Fault> parse_faults(const std::string& text, const std::string& source) {
  std::vector<Fault> faults;
  if (text.empty()) return faults;
  const std::string where = source + "='" + text + "'";
  for (size_t begin = 0; begin <= text.size();) {
    size_t end = text.find(';', begin);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(begin, end - begin);
    begin = end + 1;
    if (item.empty())
      throw comm::Error(where + ": an empty fault between ';' (" + std::string(kExpected) + ")");
    faults.push_back(parse_one(item, where));
  }
  return faults;
}

namespace fault {

std::array<int64_t, 5> g_armed = {-1, -1, -1, -1, -1};

namespace {

// Several Runtimes of one process (thread ranks) arm at once. The plan is computed aside and
// written under this lock, and only the entries that change are written: in the usual case (no
// fault, or the same plan) nothing is written at all, so the hooks' plain reads race with
// nothing. With thread ranks and faults the last Runtime made sets the process's plan.
std::mutex g_arm_mutex;

void store(const std::array<int64_t, 5>& plan) {
  std::lock_guard<std::mutex> lock(g_arm_mutex);
  for (size_t i = 0; i < plan.size(); ++i)
    if (g_armed[i] != plan[i]) g_armed[i] = plan[i];
}

}  // namespace

void arm(const std::vector<Fault>& faults, int rank, int world_size, int restart_count,
         const std::string& source) {
  for (const Fault& f : faults)
    if (f.rank >= world_size)
      throw comm::Error(source + ": a fault names rank " + std::to_string(f.rank) +
                        " (expected 0.." + std::to_string(world_size - 1) + " in a job of " +
                        std::to_string(world_size) + " ranks)");
  std::array<int64_t, 5> plan = {-1, -1, -1, -1, -1};
  for (const Fault& f : faults) {
    if (f.rank != rank || f.life != restart_count) continue;
    int64_t& armed = plan[static_cast<size_t>(f.phase)];
    if (armed < 0 || f.step < armed) armed = f.step;  // kAnyStep is the largest
  }
  store(plan);
}

void disarm() { store({-1, -1, -1, -1, -1}); }

void fire(FaultPhase phase, int64_t step) {
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  const long long ms = static_cast<long long>(now.tv_sec) * 1000 + now.tv_nsec / 1000000;
  char line[192];
  const int n = std::snprintf(line, sizeof line,
                              "troupe: fault injection: pid %d kills itself at step %lld (%s) at "
                              "unix ms %lld\n",
                              static_cast<int>(getpid()), static_cast<long long>(step),
                              fault_phase_name(phase), ms);
  if (n > 0) (void)!write(2, line, static_cast<size_t>(std::min(n, 191)));
  raise(SIGKILL);
  _exit(137);  // not reached
}

}  // namespace fault
}  // namespace troupe
