#pragma once
/// Fault injection: a rank kills itself (SIGKILL, a real crash: no destructor, no goodbye) at a
/// step and phase chosen in advance, so that tests and demos can show what a job does when a rank
/// dies there.
///
///   TROUPE_FAULT=kill:rank=2,step=100                  rank 2 dies in step 100's backward
///   TROUPE_FAULT=kill:rank=2,step=100,phase=reduce     ... while its step waits for reductions
///   TROUPE_FAULT="kill:rank=1,step=5;kill:rank=2,step=9,phase=optimizer"
///   TROUPE_FAULT="kill:rank=2,step=5;kill:rank=2,step=any,phase=heal,life=1"
///
/// Phases: backward (the step's first gradient hook), reduce (step() has launched every bucket
/// and waits for them), optimizer (the reductions are done, the optimizer has not run),
/// rendezvous (the rank (re)joins the job having completed `step` steps; 0 is the start), heal
/// (an elastic member has learned the size of the state it receives, elastic/elastic.h, and has
/// not received it; `step` is the step the job goes on from). The last two take step=any. In the
/// local-update algorithms (algorithms/local_update) backward is inner step `step` once its
/// backward is done (before the inner optimizer), and reduce the outer sync after step `step`,
/// before its reduction. A rank is its RANK slot at launch, which stays its name when an elastic
/// job renumbers the survivors. A fault fires in one life of its slot: `life=N` (default 0, the
/// first process; a rank that `troupe launch --elastic` restarted has TROUPE_RESTART_COUNT = its
/// life). RuntimeOptions::faults does the same for an embedder; the faults are process-wide (a kill
/// ends the process, thread ranks included).
///
/// The checks sit on the training path, so each is one integer compare against armed_step().
#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace troupe {

enum class FaultPhase : int { backward = 0, reduce = 1, optimizer = 2, rendezvous = 3, heal = 4 };

/// A fault's step that matches any step (phases rendezvous and heal only).
inline constexpr int64_t kAnyStep = INT64_MAX;

/// One planned crash.
struct Fault {
  int rank = 0;
  int64_t step = 0;  // or kAnyStep
  FaultPhase phase = FaultPhase::backward;
  int life = 0;
};

/// "backward", "reduce", "optimizer", "rendezvous", "heal".
const char* fault_phase_name(FaultPhase phase);

/// Parses a fault plan ("kill:rank=R,step=S[,phase=P][,life=L]", several separated by ';'; empty:
/// none).
/// Strict: an unknown action, key or phase, a missing or repeated key, a value that is not a
/// non-negative integer throws comm::Error naming `source` (the variable or option that held it),
/// the value and what was expected.
std::vector<Fault> parse_faults(const std::string& text,
                                const std::string& source = "TROUPE_FAULT");

namespace fault {

/// Per phase, the step at which this process dies (-1: none). Written by arm(), read by the checks.
extern std::array<int64_t, 5> g_armed;

/// The step at which this process dies in `phase`, or -1.
inline int64_t armed_step(FaultPhase phase) { return g_armed[static_cast<size_t>(phase)]; }

/// Arms the faults of rank slot `rank` in life `restart_count` (the earliest per phase).
/// Throws comm::Error naming `source` when a fault names a rank outside 0..world_size-1.
void arm(const std::vector<Fault>& faults, int rank, int world_size, int restart_count,
         const std::string& source = "TROUPE_FAULT");

/// Disarms every phase.
void disarm();

/// Kills this process (SIGKILL) after one line on stderr naming the fault.
[[noreturn]] void fire(FaultPhase phase, int64_t step);

/// The check of a hook: kills the process when `step` is the armed step of `phase`.
inline void at(FaultPhase phase, int64_t step) {
  if (armed_step(phase) == step) fire(phase, step);
}

/// The check of a rare point (rendezvous, heal), where step=any also matches.
inline void at_any(FaultPhase phase, int64_t step) {
  if (armed_step(phase) == step || armed_step(phase) == kAnyStep) fire(phase, step);
}

}  // namespace fault
}  // namespace troupe
