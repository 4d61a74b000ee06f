// actors::Background::averager and ::gossiper on their own, two ranks over the inproc transport,
// driven by messages under CAF's test coordinator: rounds start when the test fires their timers,
// and stop_atom is answered with (stopped_atom, ok, error).
#include <doctest/doctest.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "actors/atoms.h"
#include "actors/background.h"
#include "comm/tags.h"
#include "comm/transport/inproc/transport.h"
#include "tests/support/test_coordinator.h"

using namespace troupe;

namespace {

struct Stopped {
  bool ok;
  std::string error;
};

/// Asks `target` to stop when told (stop_atom) and records the answer.
caf::behavior stopper(caf::event_based_actor* self, actors::background_actor target,
                      std::vector<Stopped>* out) {
  return {
      [=](actors::stop_atom) {
        self->request(target, caf::infinite, actors::stop_atom::value)
            .then([out](actors::stopped_atom, bool ok, const std::string& error) {
              out->push_back({ok, error});
            });
      },
  };
}

/// A model of plain floats, as algorithms/gossip hands one to the actors (changes land at once).
struct Model {
  std::vector<float> x;
  actors::ModelAccess access() {
    actors::ModelAccess a;
    a.count = x.size();
    a.snapshot = [this](float* dst) {
      std::copy(x.begin(), x.end(), dst);
      return uint64_t{0};
    };
    a.apply = [this](const float* target, const float* snapshot, float weight, uint64_t) {
      for (size_t i = 0; i < x.size(); ++i) x[i] += weight * (target[i] - snapshot[i]);
    };
    return a;
  }
};

// The actor system is declared after what its actors use and before the handles: its destructor
// stops the actors while the fabric and the models still exist.
struct Ranks {
  comm::InprocFabric fabric{2};
  Model models[2];
  std::shared_ptr<actors::BackgroundStats> stats[2] = {std::make_shared<actors::BackgroundStats>(),
                                                       std::make_shared<actors::BackgroundStats>()};
  std::vector<Stopped> answers[2];
  test::TestSystem t;
  actors::background_actor actor[2];  // each rank's averager or gossiper
  caf::actor stoppers[2];

  void watch(int r) { stoppers[r] = t.keep(t.system->spawn(stopper, actor[r], &answers[r])); }
  void averagers() {
    for (int r = 0; r < 2; ++r) {
      actors::AveragerSettings s;
      s.key_prefix = comm::tags::module_prefix(1);
      actor[r] = t.keep(actors::Background::averager(*t.system, models[r].access(), s,
                                                     fabric.transport(r), stats[r])
                            .actor());
      watch(r);
    }
  }
  void gossipers() {
    for (int r = 0; r < 2; ++r) {
      actors::GossiperSettings s;
      s.neighbours = {1 - r};
      s.key_prefix = comm::tags::module_prefix(2);
      actor[r] = t.keep(actors::Background::gossiper(*t.system, models[r].access(), s,
                                                     fabric.transport(r), stats[r])
                            .actor());
      watch(r);
    }
  }
  void start() {
    for (auto& a : actor) caf::anon_send(a, actors::start_atom::value);
    t.run();
  }
  void stop(int r) { caf::anon_send(stoppers[r], actors::stop_atom::value); }
  // Both ranks stop; each must answer once, without an error.
  void stop_both_cleanly() {
    stop(0);
    stop(1);
    t.run();
    for (auto& a : answers) {
      REQUIRE(a.size() == 1);
      CHECK(a[0].ok);
      CHECK(a[0].error == "");
    }
  }
};

}  // namespace

TEST_CASE(
    "two averagers average their models in a round their timer starts, keeping local progress") {
  Ranks k;
  k.models[0].x = {1, 2, 3};
  k.models[1].x = {3, 6, -1};
  k.averagers();
  k.start();
  CHECK(k.stats[0]->rounds == 0);  // nothing before the interval has passed
  k.t.fire_timers();
  CHECK(k.stats[0]->rounds == 1);
  CHECK(k.stats[1]->rounds == 1);
  CHECK(k.models[0].x == std::vector<float>{2, 4, 1});
  CHECK(k.models[1].x == std::vector<float>{2, 4, 1});
  CHECK(k.stats[0]->bytes_sent > 0);

  // Rank 1 trains on (its model moves) while no round runs; the next round averages what each
  // had at its snapshot, and stop_atom on both ends the rounds after one more, answered by each.
  k.models[1].x = {4, 4, 1};
  k.stop_both_cleanly();
  CHECK(k.models[0].x == std::vector<float>{3, 4, 1});
  CHECK(k.models[1].x == std::vector<float>{3, 4, 1});
  CHECK(k.stats[0]->rounds == 2);
}

TEST_CASE("an averager told that a rank died between rounds answers stop with the reason") {
  Ranks k;
  k.models[0].x = {1};
  k.models[1].x = {1};
  k.averagers();
  k.start();
  caf::anon_send(k.actor[0], actors::abort_atom::value, std::string("rank 1 died: killed"), 1);
  k.stop(0);
  k.t.run();
  REQUIRE(k.answers[0].size() == 1);
  CHECK_FALSE(k.answers[0][0].ok);
  CHECK(k.answers[0][0].error == "asynchronous model average, before round 0: rank 1 died: killed");
  std::lock_guard<std::mutex> lock(k.stats[0]->mutex);
  CHECK(k.stats[0]->error == k.answers[0][0].error);
}

TEST_CASE("two gossipers average pairwise, keep the sum of the models, and stop together") {
  Ranks k;
  k.models[0].x = {1, 2};
  k.models[1].x = {5, -2};
  k.gossipers();
  k.start();  // each sends a request at once
  CHECK(k.stats[0]->rounds + k.stats[1]->rounds >= 2);
  for (int i = 0; i < 3; ++i) k.t.fire_timers();
  k.stop_both_cleanly();
  CHECK(k.models[0].x[0] + k.models[1].x[0] == doctest::Approx(6));
  CHECK(k.models[0].x[1] + k.models[1].x[1] == doctest::Approx(0));
  // (Whether the two end closer depends on how exchanges overlap: two that start at once are
  // both applied from the same snapshots. The sum is what the algorithm keeps.)
  CHECK(k.stats[0]->rounds >= 1);
  CHECK(k.stats[0]->bytes_sent > 0);
  CHECK(k.stats[0]->bytes_received > 0);
}

TEST_CASE("a gossiper that never started answers stop at once") {
  Ranks k;
  k.models[0].x = {1};
  k.models[1].x = {1};
  k.gossipers();
  k.stop(0);
  k.t.run();
  REQUIRE(k.answers[0].size() == 1);
  CHECK(k.answers[0][0].ok);
  CHECK(k.stats[0]->rounds == 0);
}
