#pragma once
/// What troupe's own code reaches inside a Runtime and an embedder does not: its CAF actor system,
/// in which the modules spawn their actors (through the handles of actors/). Not installed: the
/// public runtime.h names no CAF type.
#include <caf/fwd.hpp>

#include <chrono>

#include "rank/runtime.h"

namespace troupe::detail {

struct RuntimeAccess {
  static caf::actor_system& system(Runtime& runtime);
  /// The deadline of each collective (RuntimeOptions::collective_timeout).
  static std::chrono::milliseconds collective_timeout(const Runtime& runtime);
  /// Elastic: whether the membership service has announced a generation after the one in force,
  /// or stopped the job: this rank's world is ending and it must re-form (Runtime::reform). The
  /// gossip algorithms, which drop a dead neighbour instead of failing, ask it after each step.
  static bool reform_announced(const Runtime& runtime);
};

/// The actor system of `runtime`.
inline caf::actor_system& actor_system(Runtime& runtime) { return RuntimeAccess::system(runtime); }

}  // namespace troupe::detail
