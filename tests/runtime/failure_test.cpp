// Failures reach every rank at once and by name, over thread ranks: a rendezvous port that accepts
// and never answers fails at its deadline; a rank that fails (Runtime::fail, or an exception that
// unwinds its Runtime) ends the other ranks' collectives, DistributedModule steps and asynchronous
// model averages within a second or two, naming the rank and its error, instead of waiting out
// their deadlines (set to 30 s here); and which algorithms `troupe run` lets survive a dead rank.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "comm/transport/inproc/transport.h"
#include "tests/support/torch_doctest.h"

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "algorithms/gossip/decentralized.h"
#include "ddp/distributed_module.h"
#include "tests/support/thread_ranks.h"
#include "tools/job_config.h"

using namespace troupe;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kDeadline = 30s;  // every wait of the surviving ranks
constexpr auto kPromptly = 5s;   // what "at once" must beat on a loaded 2-core machine
const std::string kBadData = "bad data in batch 7: label 11 is outside [0, 10)";

/// A TCP socket listening on 127.0.0.1 that never accepts nor writes: the kernel completes the
/// connections from its backlog, so a client connects and then hears nothing.
class SilentListener {
 public:
  SilentListener() {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof address;
    REQUIRE(bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
    REQUIRE(listen(fd_, 16) == 0);
    REQUIRE(getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length) == 0);
    port_ = ntohs(address.sin_port);
  }
  ~SilentListener() { close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

std::vector<RuntimeOptions> ranks_with_deadline(int world) {
  auto fabric = std::make_shared<comm::InprocFabric>(world);
  const int port = pick_free_port();
  std::vector<RuntimeOptions> options;
  for (int r = 0; r < world; ++r)
    options.push_back(test::thread_rank(r, world, port, fabric, kDeadline));
  return options;
}

/// When the failing rank gave up, and how long after it each other rank's wait ended.
struct FailureClock {
  std::atomic<Clock::rep> failed_at{0};
  void mark() { failed_at = Clock::now().time_since_epoch().count(); }
  double seconds_since() const {
    return std::chrono::duration<double>(Clock::now().time_since_epoch() -
                                         Clock::duration(failed_at.load()))
        .count();
  }
};

/// The trainer's pattern: a rank that cannot go on names its error to the others.
template <class Body>
void or_fail(Runtime& rt, FailureClock& clock, Body body) {
  try {
    body();
  } catch (const std::exception& e) {
    clock.mark();
    rt.fail(e.what());
    throw;
  }
}

void check_names(const std::string& error, int rank, const std::string& text) {
  CAPTURE(error);
  CHECK(error.find("rank " + std::to_string(rank)) != std::string::npos);
  CHECK(error.find("failed: " + text) != std::string::npos);
}

// The same seeded two-layer model on every rank.
torch::nn::Sequential small_model() {
  torch::manual_seed(1);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 2));
}

}  // namespace

TEST_CASE(
    "a rendezvous port that accepts and never answers fails at the deadline naming host:port") {
  SilentListener silent;
  auto fabric = std::make_shared<comm::InprocFabric>(2);
  const auto deadline = 1500ms;
  const auto start = Clock::now();
  std::string error;
  try {
    Runtime rt(test::thread_rank(1, 2, silent.port(), fabric, deadline));
  } catch (const comm::Error& e) {
    error = e.what();
  }
  const auto took = Clock::now() - start;
  CAPTURE(error);
  CHECK(error.find("127.0.0.1:" + std::to_string(silent.port())) != std::string::npos);
  CHECK(error.find("within 1500 ms") != std::string::npos);
  CHECK(error.find("no handshake in time") != std::string::npos);
  CHECK(took >= deadline);
  CHECK(took < deadline + 3s);
}

TEST_CASE("a rank that fails ends every other rank's collective at once, naming it and its error") {
  for (int victim : {2, 0}) {  // rank 0 also hosts the directory that relays the news
    CAPTURE(victim);
    FailureClock clock;
    std::vector<double> waited(4, -1);
    auto errors = test::run_ranks(ranks_with_deadline(4), [&](int rank, Runtime& rt) {
      double x = 1;
      if (rank == victim) {
        rt.comm().barrier();  // every rank has started
        or_fail(rt, clock, [] { throw std::runtime_error(kBadData); });
      }
      try {
        // The victim may fail while the others are still in the barrier it has left.
        rt.comm().barrier();
        rt.comm().allreduce(&x, 1, comm::DataType::float64, comm::ReduceOp::sum);
      } catch (const comm::Error&) {
        waited[static_cast<size_t>(rank)] = clock.seconds_since();
        throw;
      }
    });
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      if (r == victim) {
        CHECK(errors[static_cast<size_t>(r)] == kBadData);
        continue;
      }
      check_names(errors[static_cast<size_t>(r)], victim, kBadData);
      MESSAGE("rank " << r << " heard of rank " << victim << "'s failure after "
                      << waited[static_cast<size_t>(r)] << " s");
      CHECK(waited[static_cast<size_t>(r)] >= 0);
      CHECK(waited[static_cast<size_t>(r)] < std::chrono::duration<double>(kPromptly).count());
    }
  }
}

TEST_CASE("a rank whose Runtime an exception unwinds is announced as failed, not as left") {
  FailureClock clock;
  std::vector<double> waited(3, -1);
  auto errors = test::run_ranks(ranks_with_deadline(3), [&](int rank, Runtime& rt) {
    double x = 1;
    if (rank == 1) {
      rt.comm().barrier();  // every rank has started
      clock.mark();
      throw std::runtime_error(kBadData);  // no Runtime::fail: the destructor sees the unwinding
    }
    try {
      rt.comm().barrier();
      rt.comm().allreduce(&x, 1, comm::DataType::float64, comm::ReduceOp::sum);
    } catch (const comm::Error&) {
      waited[static_cast<size_t>(rank)] = clock.seconds_since();
      throw;
    }
  });
  CHECK(errors[1] == kBadData);
  for (int r : {0, 2}) {
    CAPTURE(errors[static_cast<size_t>(r)]);
    check_names(errors[static_cast<size_t>(r)], 1, "an exception unwound its Runtime");
    CHECK(waited[static_cast<size_t>(r)] >= 0);
    CHECK(waited[static_cast<size_t>(r)] < std::chrono::duration<double>(kPromptly).count());
  }
}

TEST_CASE(
    "a rank that fails mid-training ends every other rank's DistributedModule step, naming it") {
  torch::set_num_threads(1);
  FailureClock clock;
  std::vector<double> waited(3, -1);
  auto errors = test::run_ranks(ranks_with_deadline(3), [&](int rank, Runtime& rt) {
    auto model = small_model();
    torch::optim::SGD opt(model->parameters(), 0.01);
    DdpOptions d;
    d.stall_timeout = kDeadline;
    DistributedModule ddp(rt, model.ptr(), GradientAllReduce{}, d);
    for (int step = 0; step < 50; ++step) {
      if (rank == 2 && step == 3) or_fail(rt, clock, [] { throw std::runtime_error(kBadData); });
      opt.zero_grad();
      model->forward(torch::randn({4, 8})).pow(2).mean().backward();
      try {
        ddp.step(opt);
      } catch (const comm::Error&) {
        waited[static_cast<size_t>(rank)] = clock.seconds_since();
        throw;
      }
    }
  });
  CHECK(errors[2] == kBadData);
  for (int r : {0, 1}) {
    check_names(errors[static_cast<size_t>(r)], 2, kBadData);
    MESSAGE("rank " << r << "'s step failed " << waited[static_cast<size_t>(r)]
                    << " s after rank 2");
    CHECK(waited[static_cast<size_t>(r)] >= 0);
    CHECK(waited[static_cast<size_t>(r)] < std::chrono::duration<double>(kPromptly).count());
  }
}

TEST_CASE("a rank that fails ends the asynchronous model average on every other rank, naming it") {
  torch::set_num_threads(1);
  FailureClock clock;
  std::vector<double> waited(4, -1);
  auto errors = test::run_ranks(ranks_with_deadline(4), [&](int rank, Runtime& rt) {
    auto model = small_model();
    torch::optim::SGD opt(model->parameters(), 0.01);
    AsyncModelAverage a;
    a.sync_interval_ms = 2;
    a.warmup_steps = 0;
    GossipOptions g;
    g.timeout = kDeadline;
    AsynchronousModule dp(rt, model.ptr(), a, g);
    try {
      // The survivors train until the averages stop them; bounded, in case they never do. The
      // victim fails once a few averages (of every rank) have passed.
      for (int step = 0; step < 100000; ++step) {
        if (rank == 2 && dp.stats().background_rounds >= 3)
          or_fail(rt, clock, [] { throw std::runtime_error(kBadData); });
        if (clock.failed_at && clock.seconds_since() > 10) break;
        opt.zero_grad();
        model->forward(torch::randn({4, 8})).pow(2).mean().backward();
        dp.step(opt);
      }
      dp.finish();
    } catch (const comm::Error&) {
      waited[static_cast<size_t>(rank)] = clock.seconds_since();
      throw;
    }
  });
  CHECK(errors[2] == kBadData);
  for (int r : {0, 1, 3}) {
    check_names(errors[static_cast<size_t>(r)], 2, kBadData);
    CHECK(errors[static_cast<size_t>(r)].find("async_model_average") != std::string::npos);
    MESSAGE("rank " << r << " stopped averaging " << waited[static_cast<size_t>(r)]
                    << " s after rank 2 failed");
    CHECK(waited[static_cast<size_t>(r)] >= 0);
    CHECK(waited[static_cast<size_t>(r)] < std::chrono::duration<double>(kPromptly).count());
  }
}

TEST_CASE("troupe run lets the other ranks run on after a death only for the gossip algorithms") {
  CHECK(tolerates_dead_ranks(Decentralized{}));
  CHECK(tolerates_dead_ranks(LowPrecisionDecentralized{}));
  CHECK(tolerates_dead_ranks(AsyncGossip{}));
  CHECK_FALSE(tolerates_dead_ranks(AsyncModelAverage{}));
  CHECK_FALSE(tolerates_dead_ranks(comm::Compression{comm::GradientAllReduce{}}));
  CHECK_FALSE(tolerates_dead_ranks(comm::Compression{comm::PowerSGD{}}));
}
