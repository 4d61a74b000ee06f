// actors::Reducer on its own, driven by messages under CAF's test coordinator: it answers
// await_atom with (step_done_atom, step, ok, error) once every bucket of the step is done, at once
// for a failed bucket, and with a stall report built from each unfinished bucket's progress.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "actors/atoms.h"
#include "actors/reducer.h"
#include "tests/support/test_coordinator.h"

using namespace troupe;

namespace {

struct StepDone {
  uint32_t step;
  bool ok;
  std::string error;
};

/// The trainer's side: asks for steps and records the answers.
caf::behavior trainer(caf::event_based_actor* self, actors::reducer_actor reducer,
                      std::vector<StepDone>* out) {
  return {
      [=](actors::await_atom, uint32_t step, int64_t stall_ms) {
        self->request(reducer, caf::infinite, actors::await_atom::value, step, stall_ms)
            .then([out](actors::step_done_atom, uint32_t s, bool ok, const std::string& error) {
              out->push_back({s, ok, error});
            });
      },
      [=](actors::await_atom, uint32_t step, int64_t stall_ms, const std::vector<int>& buckets) {
        self->request(reducer, caf::infinite, actors::await_atom::value, step, stall_ms, buckets)
            .then([out](actors::step_done_atom, uint32_t s, bool ok, const std::string& error) {
              out->push_back({s, ok, error});
            });
      },
  };
}

/// A bucket that only answers progress_atom, as told.
caf::behavior stub_bucket(caf::event_based_actor*, int index, bool launched, int ready,
                          std::vector<int> waiting) {
  return {
      [=](actors::progress_atom) {
        return caf::make_message(actors::bucket_state_atom::value, index, launched, ready, waiting);
      },
  };
}

struct Fixture {
  std::vector<StepDone> answers;
  test::TestSystem t;
  actors::reducer_actor reducer = t.keep(actors::Reducer::spawn(*t.system, 2).actor());
  caf::actor asker = t.keep(t.system->spawn(trainer, reducer, &answers));

  Fixture() {
    // Stubs that answer only progress_atom, which is all a reducer asks of a bucket.
    std::vector<actors::bucket_actor> buckets = {
        caf::actor_cast<actors::bucket_actor>(
            t.keep(t.system->spawn(stub_bucket, 0, true, 2, std::vector<int>{1}))),
        caf::actor_cast<actors::bucket_actor>(
            t.keep(t.system->spawn(stub_bucket, 1, false, 1, std::vector<int>{})))};
    caf::anon_send(reducer, actors::setup_atom::value, buckets,
                   std::vector<std::vector<std::string>>{{"fc2.weight", "fc2.bias"},
                                                         {"fc1.weight", "fc1.bias"}},
                   std::vector<int>{2, 2});
    t.run();
  }
  void done(int bucket, uint32_t step, bool ok = true, const std::string& error = "") {
    caf::anon_send(reducer, actors::bucket_done_atom::value, bucket, step, ok, error, -1);
  }
  void await(uint32_t step, int64_t stall_ms = 60000) {
    caf::anon_send(asker, actors::await_atom::value, step, stall_ms);
  }
  void await_some(uint32_t step, std::vector<int> buckets, int64_t stall_ms = 60000) {
    caf::anon_send(asker, actors::await_atom::value, step, stall_ms, std::move(buckets));
  }
};

}  // namespace

TEST_CASE("the reducer answers a waiting trainer when the step's last bucket is done") {
  Fixture f;
  f.await(5);
  f.done(1, 5);
  f.t.run();
  CHECK(f.answers.empty());
  f.done(0, 5);
  f.t.run();
  REQUIRE(f.answers.size() == 1);
  CHECK(f.answers[0].step == 5);
  CHECK(f.answers[0].ok);
  CHECK(f.answers[0].error == "");
}

TEST_CASE(
    "the reducer answers at once for a step already done, and a repeated report counts once") {
  Fixture f;
  f.done(0, 9);
  f.done(0, 9);
  f.t.run();
  f.await(9);
  f.t.run();
  CHECK(f.answers.empty());  // bucket 1 has not reported: the duplicate did not count for it
  f.done(1, 9);
  f.done(0, 10);
  f.done(1, 10);
  f.await(10);
  f.t.run();
  REQUIRE(f.answers.size() == 2);
  CHECK(f.answers[0].step == 9);
  CHECK(f.answers[1].step == 10);
  CHECK(f.answers[1].ok);
}

TEST_CASE("a failed bucket fails its step at once, naming the bucket's parameters and the error") {
  Fixture f;
  f.await(3);
  f.done(1, 3, false, "rank 1 died");
  f.t.run();
  REQUIRE(f.answers.size() == 1);
  CHECK_FALSE(f.answers[0].ok);
  CHECK(f.answers[0].error == "step 3: bucket 1 (fc1.weight, fc1.bias) failed: rank 1 died");
}

TEST_CASE("a stalled step is reported with what each unfinished bucket says of itself") {
  Fixture f;
  f.await(4, 0);  // stalls as soon as the timer fires
  f.t.run();
  CHECK(f.answers.empty());
  f.t.fire_timers();
  REQUIRE(f.answers.size() == 1);
  CHECK_FALSE(f.answers[0].ok);
  CHECK(f.answers[0].error ==
        "step 4 stalled: not done after 0 ms: bucket 0 (fc2.weight, fc2.bias) is reducing and "
        "waits for rank(s) 1; bucket 1 (fc1.weight, fc1.bias) never started: 1 of 2 parameters "
        "had a gradient;");
}

TEST_CASE("a wait for some buckets is answered when they are done and leaves the step open") {
  Fixture f;
  f.await_some(6, {1});
  f.done(0, 6);
  f.t.run();
  CHECK(f.answers.empty());  // bucket 0 is not the one asked for
  f.done(1, 6);
  f.t.run();
  REQUIRE(f.answers.size() == 1);
  CHECK(f.answers[0].ok);
  f.await_some(6, {0});  // done already: answered at once
  f.t.run();
  REQUIRE(f.answers.size() == 2);
  CHECK(f.answers[1].ok);
  f.await(6);  // the step as a whole, still known
  f.t.run();
  REQUIRE(f.answers.size() == 3);
  CHECK(f.answers[2].ok);
  f.await_some(6, {2});  // no such bucket
  f.t.run();
  REQUIRE(f.answers.size() == 4);
  CHECK_FALSE(f.answers[3].ok);
  CHECK(f.answers[3].error == "step 6: no bucket 2 (expected 0 to 1)");
}

TEST_CASE("a wait for some buckets stalls naming only them, and the failure stays for the step") {
  Fixture f;
  f.await_some(8, {1}, 0);
  f.t.run();
  f.t.fire_timers();
  REQUIRE(f.answers.size() == 1);
  CHECK_FALSE(f.answers[0].ok);
  CHECK(f.answers[0].error ==
        "step 8 stalled: not done after 0 ms: bucket 1 (fc1.weight, fc1.bias) never started: 1 "
        "of 2 parameters had a gradient;");
  f.done(0, 8);
  f.done(1, 8);
  f.await(8);
  f.t.run();
  REQUIRE(f.answers.size() == 2);
  CHECK_FALSE(f.answers[1].ok);  // the stall is the step's outcome
}
