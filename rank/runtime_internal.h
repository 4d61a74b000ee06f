#pragma once
/// What troupe's own code reaches inside a Runtime and an embedder does not: its actors
/// (actors/node.h: the actor system in which the modules spawn theirs, through the handles of
/// actors/). Not installed: the public runtime.h names no CAF type, and neither does this file.
#include <chrono>

#include "rank/runtime.h"

namespace troupe::actors {
class Node;  // actors/node.h
}  // namespace troupe::actors

namespace troupe::detail {

struct RuntimeAccess {
  static actors::Node& node(Runtime& runtime);
  /// The deadline of each collective (RuntimeOptions::collective_timeout).
  static std::chrono::milliseconds collective_timeout(const Runtime& runtime);
  /// Elastic: whether the membership service has announced a generation after the one in force,
  /// or stopped the job: this rank's world is ending and it must re-form (Runtime::reform). The
  /// gossip algorithms, which drop a dead neighbour instead of failing, ask it after each step.
  static bool reform_announced(const Runtime& runtime);
};

/// The actors of `runtime` (node(rt).system(): the actor system its modules spawn theirs in).
inline actors::Node& node(Runtime& runtime) { return RuntimeAccess::node(runtime); }

}  // namespace troupe::detail
