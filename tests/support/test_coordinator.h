#pragma once
// Test support: an actor system on CAF's test coordinator (scheduler.policy = testing), so every
// message is delivered on the test's thread when it says run(), and a timer fires only when it
// says trigger_timeouts(): the cases that drive an actor with messages are deterministic. (CAF's
// test DSL, caf/test/dsl.hpp, needs CAF's own unit-test engine, not doctest; the coordinator
// underneath it does not.)
#include <caf/all.hpp>
#include <caf/scheduler/test_coordinator.hpp>

#include <memory>
#include <vector>

namespace troupe::test {

struct TestSystem {
  caf::actor_system_config config;
  std::unique_ptr<caf::actor_system> system;
  caf::scheduler::test_coordinator* sched = nullptr;
  std::vector<caf::actor> spawned;

  TestSystem() {
    config.set("scheduler.policy", caf::atom("testing"));
    config.set("logger.file-verbosity", caf::atom("quiet"));
    system = std::make_unique<caf::actor_system>(config);
    sched = &dynamic_cast<caf::scheduler::test_coordinator&>(system->scheduler());
  }
  ~TestSystem() {
    for (auto& a : spawned) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    sched->run();
  }
  /// Keeps `a` (a handle, typed or not) to be stopped at the end of the case.
  template <class Handle>
  Handle keep(Handle a) {
    spawned.push_back(caf::actor_cast<caf::actor>(a));
    return a;
  }
  /// Delivers every message now due, including those the deliveries send.
  void run() { sched->run(); }
  /// Fires every pending timer (delayed_send), then delivers what follows.
  void fire_timers() {
    sched->trigger_timeouts();
    sched->run();
  }
};

}  // namespace troupe::test
