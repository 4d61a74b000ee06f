// actors::Bucket on its own, driven by messages under CAF's test coordinator: it counts ready
// messages, asks its path to reduce the moment it is full, reports to the reducer, answers
// progress_atom with its own reply, and fails its step when a rank died.
#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <vector>

#include "actors/atoms.h"
#include "actors/bucket.h"
#include "tests/support/test_coordinator.h"

using namespace troupe;

namespace {

/// A path that records what it is asked and ends a reduction when the test says so.
struct FakePath : actors::BucketPath {
  struct Call {
    uint32_t step;
    double denominator;
  };
  std::vector<Call> calls;
  std::vector<Done> in_flight;
  std::vector<std::string> aborts;
  std::vector<int> waiting = {1};
  std::string refuse;  // reduce() throws this when set

  void reduce(const actors::ActorThread&, uint32_t step, double denominator, Done done) override {
    if (!refuse.empty()) throw comm::Error(refuse);
    calls.push_back({step, denominator});
    in_flight.push_back(std::move(done));
  }
  void abort(const actors::ActorThread&, const comm::Status& why) override {
    aborts.push_back(why.message());
  }
  std::vector<int> waiting_on() override { return waiting; }
};

struct Report {
  int index;
  uint32_t step;
  bool ok;
  std::string error;
  int peer;
};
struct Progress {
  int index;
  bool launched;
  int ready;
  std::vector<int> waiting;
};
struct Seen {
  std::vector<Report> reports;
  std::vector<Progress> progress;
};

/// Plays the reducer (bucket_done_atom) and the asker of progress_atom.
caf::behavior recorder(caf::event_based_actor*, Seen* out) {
  return {
      [out](actors::bucket_done_atom, int index, uint32_t step, bool ok, const std::string& error,
            int peer) {
        out->reports.push_back({index, step, ok, error, peer});
      },
      [out](actors::bucket_state_atom, int index, bool launched, int ready,
            const std::vector<int>& waiting) {
        out->progress.push_back({index, launched, ready, waiting});
      },
  };
}

struct Fixture {
  Seen seen;
  test::TestSystem t;
  caf::actor reducer = t.keep(t.system->spawn(recorder, &seen));
  std::shared_ptr<FakePath> path = std::make_shared<FakePath>();
  std::shared_ptr<actors::BucketStats> stats = std::make_shared<actors::BucketStats>();
  actors::Bucket bucket;

  explicit Fixture(int parameters) {
    bucket = actors::Bucket::spawn(*t.system, 4, parameters, path,
                                   caf::actor_cast<actors::bucket_sink_actor>(reducer), stats);
    t.keep(bucket.actor());
  }
  void ready(uint32_t step, double denominator = 2) { bucket.ready(step, denominator); }
  void ask_progress() { caf::send_as(reducer, bucket.actor(), actors::progress_atom::value); }
};

}  // namespace

TEST_CASE(
    "a bucket asks its path to reduce on its last ready message, and reports to the reducer") {
  Fixture f(3);
  f.ready(7);
  f.ready(7);
  f.t.run();
  CHECK(f.path->calls.empty());
  f.ready(7, 4.0);
  f.t.run();
  REQUIRE(f.path->calls.size() == 1);
  CHECK(f.path->calls[0].step == 7);
  CHECK(f.path->calls[0].denominator == 4.0);
  CHECK(f.seen.reports.empty());  // the path has not ended yet

  f.path->in_flight[0](comm::Status::success(), 100, 60);
  f.t.run();
  REQUIRE(f.seen.reports.size() == 1);
  CHECK(f.seen.reports[0].index == 4);
  CHECK(f.seen.reports[0].step == 7);
  CHECK(f.seen.reports[0].ok);
  CHECK(f.stats->step == 7);
  CHECK(f.stats->ready == 3);
  CHECK(f.stats->bytes_sent == 100);
  CHECK(f.stats->bytes_received == 60);
  CHECK(f.stats->done_us >= f.stats->ready_us);

  // The next step counts from zero again.
  for (int i = 0; i < 3; ++i) f.ready(8);
  f.t.run();
  REQUIRE(f.path->calls.size() == 2);
  CHECK(f.path->calls[1].step == 8);
}

TEST_CASE(
    "a bucket answers progress_atom with its own reply: started or not, and whom it waits for") {
  Fixture f(3);
  f.ready(1);
  f.ready(1);
  f.ask_progress();
  f.t.run();
  REQUIRE(f.seen.progress.size() == 1);
  CHECK(f.seen.progress[0].index == 4);
  CHECK_FALSE(f.seen.progress[0].launched);
  CHECK(f.seen.progress[0].ready == 2);
  CHECK(f.seen.progress[0].waiting.empty());

  f.path->waiting = {0, 2};
  f.ready(1);
  f.ask_progress();
  f.t.run();
  REQUIRE(f.seen.progress.size() == 2);
  CHECK(f.seen.progress[1].launched);
  CHECK(f.seen.progress[1].ready == 3);
  CHECK(f.seen.progress[1].waiting == std::vector<int>{0, 2});
}

TEST_CASE("launch_atom starts a bucket that is not full, once per step") {
  Fixture f(5);
  f.ready(2);
  f.bucket.launch(2, 1.0);
  f.bucket.launch(2, 1.0);
  f.t.run();
  REQUIRE(f.path->calls.size() == 1);
  CHECK(f.path->calls[0].denominator == 1.0);
  CHECK(f.stats->ready == 1);
}

TEST_CASE("a bucket told that a rank died aborts its path once and fails its later steps by name") {
  Fixture f(1);
  f.bucket.abort("rank 1 died: killed", 1);
  f.bucket.abort("rank 2 died", 2);
  f.t.run();
  CHECK(f.path->aborts == std::vector<std::string>{"rank 1 died: killed"});
  f.ready(3);
  f.t.run();
  CHECK(f.path->calls.empty());  // nothing is started on a broken job
  REQUIRE(f.seen.reports.size() == 1);
  CHECK_FALSE(f.seen.reports[0].ok);
  CHECK(f.seen.reports[0].error == "rank 1 died: killed");
  CHECK(f.seen.reports[0].peer == 1);
}

TEST_CASE("a path that refuses to reduce fails the bucket's step with the bucket's index") {
  Fixture f(1);
  f.path->refuse = "no buffer";
  f.ready(0);
  f.t.run();
  REQUIRE(f.seen.reports.size() == 1);
  CHECK_FALSE(f.seen.reports[0].ok);
  CHECK(f.seen.reports[0].error == "bucket 4: no buffer");
}
