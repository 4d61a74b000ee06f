// How a collective ends when it fails: the blocking driver returns only once nothing of the
// collective is still in flight, and a running collective never keeps its transport alive (a
// transport destroyed from its own thread would join that thread). Driven through a transport
// whose operations complete only when the test says so.
#include <doctest/doctest.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/collectives/communicator.h"
#include "comm/collectives/schedule.h"

using namespace troupe;
using namespace std::chrono_literals;

namespace {

// Rank 0 of two. Sends and receives stay pending until fail_peer: then the first pending operation
// fails at once and the others `release_after` later, all on the transport's own thread (as UCX
// fails a dead peer's operations one after another).
class HeldTransport : public comm::Transport {
 public:
  HeldTransport(bool serial, std::chrono::milliseconds release_after)
      : serial_(serial), release_after_(release_after) {}
  ~HeldTransport() override {
    if (thread_.joinable()) thread_.join();
    // Whatever is still pending ends as a real transport's shut-down ends it.
    for (auto& cb : take()) cb(comm::Status::failure("transport shut down", 1));
  }
  int rank() const override { return 0; }
  int world_size() const override { return 2; }
  std::string name() const override { return "held"; }
  bool serial_callbacks() const override { return serial_; }
  void send(int, comm::Tag, const void*, size_t, comm::Callback done) override { hold(done); }
  void recv(int, comm::Tag, void*, size_t, comm::Callback done) override { hold(done); }
  void fail_peer(int peer, const std::string& reason) override {
    auto held = take();
    if (held.empty()) return;
    thread_ = std::thread([this, held, peer, reason] {
      held.front()(comm::Status::failure(reason, peer));
      std::this_thread::sleep_for(release_after_);  // a slow transport, not a synchronisation
      for (size_t i = 1; i < held.size(); ++i) {
        held[i](comm::Status::failure(reason, peer));
        std::lock_guard<std::mutex> guard(mutex_);
        ++late_;
      }
    });
  }
  size_t pending() {
    std::lock_guard<std::mutex> guard(mutex_);
    return pending_.size();
  }
  // Operations of the failed peer that had not yet ended.
  size_t late() {
    std::lock_guard<std::mutex> guard(mutex_);
    return late_;
  }

 private:
  void hold(comm::Callback done) {
    std::lock_guard<std::mutex> guard(mutex_);
    pending_.push_back(std::move(done));
  }
  std::vector<comm::Callback> take() {
    std::lock_guard<std::mutex> guard(mutex_);
    std::vector<comm::Callback> out;
    out.swap(pending_);
    return out;
  }
  const bool serial_;
  const std::chrono::milliseconds release_after_;
  std::mutex mutex_;
  std::vector<comm::Callback> pending_;
  size_t late_ = 0;
  std::thread thread_;
};

}  // namespace

TEST_CASE("a timed-out collective returns only after every operation it had in flight has ended") {
  for (bool serial : {true, false}) {
    CAPTURE(serial);
    auto transport = std::make_shared<HeldTransport>(serial, 300ms);
    comm::CollectiveOptions options;
    options.chunk_bytes = 64 * 1024;  // several lanes, so several operations in flight
    comm::Communicator comm(transport, options, 100ms);
    std::vector<float> data(1u << 18, 1.0f);
    std::string error;
    try {
      comm.allreduce(data.data(), data.size(), comm::DataType::float32, comm::ReduceOp::sum);
    } catch (const comm::Error& e) {
      error = e.what();
    }
    CHECK(error.find("timed out after 100 ms waiting for rank(s) 1") != std::string::npos);
    // The operations that failed 300 ms after the first have all ended before the call returned:
    // with one still running, the collective could write into `data` after the return.
    CHECK(transport->late() >= 1);
    // Nothing of the collective holds the transport: the test and the communicator only.
    CHECK(transport.use_count() == 2);
  }
}

TEST_CASE("a collective in flight does not keep its transport alive") {
  auto transport = std::make_shared<HeldTransport>(/*serial=*/true, 0ms);
  std::weak_ptr<HeldTransport> weak = transport;
  std::vector<float> data(1u << 16, 1.0f);
  comm::CollectiveOptions options;
  auto schedule = comm::allreduce_schedule(comm::Group{0, 2}, data.data(), data.size(),
                                           comm::DataType::float32, comm::ReduceOp::sum, options);
  auto lock = std::make_shared<std::mutex>();
  auto execution = std::make_shared<comm::Execution>(transport, comm::kFirstUserKey,
                                                     std::move(schedule), comm::locked_post(lock));
  std::string failure;
  execution->on_failure([&](const comm::Status& s) { failure = s.message(); });
  {
    std::lock_guard<std::mutex> guard(*lock);
    execution->start();
  }
  REQUIRE(transport->pending() >= 2);
  // The owner lets go while operations are pending: the transport must go now, on this thread,
  // and end what was pending (here: the held transport fails it in its destructor).
  transport.reset();
  CHECK(weak.expired());
  CHECK(execution->done());
  CHECK(failure.find("transport shut down") != std::string::npos);
}
