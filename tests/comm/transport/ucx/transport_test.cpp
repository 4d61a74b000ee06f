// UcxTransport between real processes: the test forks one child per rank before any UCX state
// exists, the children swap worker addresses through pipes to the parent, and each child reports
// pass or fail through its exit code.
#include "comm/transport/ucx/transport.h"

#include <doctest/doctest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/collectives/communicator.h"
#include "comm/transport/link_emulation.h"
#include "tests/support/stop_process.h"

namespace troupe::comm {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::seconds;

constexpr auto kPipeDeadline = seconds(60);
constexpr auto kOpDeadline = seconds(30);
constexpr auto kJobDeadline = seconds(90);

bool write_all(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool read_all(int fd, void* data, size_t size, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd pfd{fd, POLLIN, 0};
    int ready = ::poll(&pfd, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
    ssize_t n = ::read(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

/// Length-prefixed messages over a pipe.
void tell(int fd, const std::string& message) {
  uint32_t size = static_cast<uint32_t>(message.size());
  if (!write_all(fd, &size, sizeof size) || !write_all(fd, message.data(), message.size())) {
    throw std::runtime_error("pipe write failed");
  }
}

std::string hear(int fd, const char* waiting_for) {
  auto deadline = Clock::now() + kPipeDeadline;
  uint32_t size = 0;
  std::string message;
  bool ok = read_all(fd, &size, sizeof size, deadline);
  if (ok) {
    message.resize(size);
    ok = read_all(fd, &message[0], size, deadline);
  }
  if (!ok)
    throw std::runtime_error(std::string("pipe closed or timed out waiting for ") + waiting_for);
  return message;
}

/// Failures seen inside a child rank; its exit code is 1 when there is any.
struct Verdict {
  int rank = 0;
  int failures = 0;
  void expect(bool ok, const std::string& what) {
    if (ok) return;
    ++failures;
    std::fprintf(stderr, "rank %d: %s\n", rank, what.c_str());
  }
};

/// Statuses of the operations a child posted; waits for them with a deadline.
class Outcomes {
 public:
  Callback track() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    size_t index = state_->statuses.size();
    state_->statuses.emplace_back();
    state_->calls.push_back(0);
    auto state = state_;
    return [state, index](const Status& status) {
      std::lock_guard<std::mutex> guard(state->mutex);
      state->statuses[index] = status;
      ++state->calls[index];
      state->changed.notify_all();
    };
  }
  bool wait_all(Clock::duration limit = kOpDeadline) {
    std::unique_lock<std::mutex> lock(state_->mutex);
    return state_->changed.wait_for(lock, limit, [&] {
      for (int c : state_->calls) {
        if (c == 0) return false;
      }
      return true;
    });
  }
  Status status(size_t i) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->statuses[i];
  }
  int calls(size_t i) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->calls[i];
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->calls.size();
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable changed;
    std::vector<Status> statuses;
    std::vector<int> calls;
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

/// What a child rank's body sees: its transport, the pipes to the parent, its verdict.
struct RankContext {
  int rank;
  int world;
  std::unique_ptr<UcxTransport> transport;
  int to_parent;
  int from_parent;
  Verdict verdict;
};

using Body = std::function<void(RankContext&)>;

/// Where a job's ranks say they are (UcxTransport's `single_host`). Across hosts UCX sends every
/// message eagerly, so a send completes once its bytes are out, received or not; on one host a
/// large send waits for its receiver (rendezvous), which the tests of pending sends need.
enum class Layout { across_hosts, one_host };

int run_child(int rank, int world, Layout layout, int to_parent, int from_parent,
              const Body& body) {
  RankContext ctx{rank, world, nullptr, to_parent, from_parent, Verdict{rank, 0}};
  try {
    ctx.transport = std::make_unique<UcxTransport>(rank, world, layout == Layout::one_host);
    tell(to_parent, ctx.transport->local_address());
    std::vector<std::string> table;
    for (int r = 0; r < world; ++r) table.push_back(hear(from_parent, "the address table"));
    ctx.transport->connect(table);
    body(ctx);
    tell(to_parent, "done");
    hear(from_parent, "the final barrier");
    ctx.transport.reset();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: exception: %s\n", rank, e.what());
    return 2;
  }
  return ctx.verdict.failures == 0 ? 0 : 1;
}

/// A job of `world` forked processes, each running `body` over a UcxTransport.
class ProcessJob {
 public:
  ProcessJob(int world, const Body& body, Layout layout = Layout::across_hosts) : children_(world) {
    old_sigpipe_ = ::signal(SIGPIPE, SIG_IGN);
    for (int r = 0; r < world; ++r) {
      int up[2];
      int down[2];
      REQUIRE(::pipe(up) == 0);
      REQUIRE(::pipe(down) == 0);
      std::fflush(nullptr);
      pid_t pid = ::fork();
      REQUIRE(pid >= 0);
      if (pid == 0) {
        for (int q = 0; q < r; ++q) {
          ::close(children_[q].to_child);
          ::close(children_[q].from_child);
        }
        ::close(up[0]);
        ::close(down[1]);
        ::_exit(run_child(r, world, layout, up[1], down[0], body));
      }
      ::close(up[1]);
      ::close(down[0]);
      children_[r] = Child{pid, down[1], up[0], true, -1};
    }
    try {
      std::vector<std::string> table;
      for (int r = 0; r < world; ++r) table.push_back(hear(r));
      for (int r = 0; r < world; ++r) {
        for (const std::string& address : table) say(r, address);
      }
    } catch (...) {
      end_all();
      throw;
    }
  }

  ~ProcessJob() { end_all(); }

  std::string hear(int rank) { return troupe::comm::hear(children_[rank].from_child, "a child"); }
  void say(int rank, const std::string& message) { tell(children_[rank].to_child, message); }

  /// Sends `sig` to a child (SIGCONT); SIGSTOP returns once the child has stopped.
  void signal(int rank, int sig) {
    if (sig == SIGSTOP) return troupe::test::stop_process(children_[rank].pid);
    REQUIRE(::kill(children_[rank].pid, sig) == 0);
  }

  void kill(int rank) {
    Child& child = children_[rank];
    ::kill(child.pid, SIGKILL);
    int status = 0;
    ::waitpid(child.pid, &status, 0);
    child.running = false;
    child.code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
  }

  /// Lets every live child leave its body only when all have finished their operations.
  void barrier() {
    for (size_t r = 0; r < children_.size(); ++r) {
      if (children_[r].running) CHECK(hear(static_cast<int>(r)) == "done");
    }
    for (size_t r = 0; r < children_.size(); ++r) {
      if (children_[r].running) say(static_cast<int>(r), "exit");
    }
  }

  /// Exit codes (128 + signal when killed by one); a child past the deadline is killed: -1.
  std::vector<int> wait() {
    auto deadline = Clock::now() + kJobDeadline;
    for (Child& child : children_) {
      while (child.running) {
        int status = 0;
        pid_t done = ::waitpid(child.pid, &status, WNOHANG);
        if (done == child.pid) {
          child.running = false;
          child.code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
        } else if (Clock::now() > deadline) {
          ::kill(child.pid, SIGKILL);
          ::waitpid(child.pid, nullptr, 0);
          child.running = false;
          child.code = -1;
        } else {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
      }
    }
    std::vector<int> codes;
    for (const Child& child : children_) codes.push_back(child.code);
    return codes;
  }

 private:
  struct Child {
    pid_t pid = -1;
    int to_child = -1;
    int from_child = -1;
    bool running = false;
    int code = -1;
  };
  void end_all() {
    for (Child& child : children_) {
      if (child.running) {
        ::kill(child.pid, SIGKILL);
        ::waitpid(child.pid, nullptr, 0);
        child.running = false;
      }
      ::close(child.to_child);
      ::close(child.from_child);
      child.to_child = child.from_child = -1;
    }
    ::signal(SIGPIPE, old_sigpipe_);
  }

  std::vector<Child> children_;
  void (*old_sigpipe_)(int) = SIG_DFL;
};

uint8_t pattern(int src, Tag tag, size_t i) {
  return static_cast<uint8_t>(src * 131 + tag * 31 + i * 7 + (i >> 12));
}

std::vector<uint8_t> patterned(int src, Tag tag, size_t size) {
  std::vector<uint8_t> data(size);
  for (size_t i = 0; i < size; ++i) data[i] = pattern(src, tag, i);
  return data;
}

bool intact(const std::vector<uint8_t>& data, int src, Tag tag) {
  for (size_t i = 0; i < data.size(); ++i) {
    if (data[i] != pattern(src, tag, i)) return false;
  }
  return true;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

const std::vector<size_t> kSizes = {0, 1, 4099, 8u << 20};

// Sends every size under tags base+k, receives them from `from` posted in reverse order, and
// checks every byte; `gate` runs between posting the first and the second half of the work.
void exchange(RankContext& ctx, int to, int from, Tag base, const std::function<void()>& gate,
              bool recvs_first) {
  UcxTransport& t = *ctx.transport;
  std::vector<std::vector<uint8_t>> out;
  std::vector<std::vector<uint8_t>> in;
  for (size_t k = 0; k < kSizes.size(); ++k) {
    out.push_back(patterned(ctx.rank, base + k, kSizes[k]));
    in.emplace_back(kSizes[k], 0xEE);
  }
  Outcomes sends;
  Outcomes recvs;
  auto post_recvs = [&] {
    for (size_t k = kSizes.size(); k-- > 0;) {
      t.recv(from, base + k, in[k].data(), in[k].size(), recvs.track());
    }
  };
  auto post_sends = [&] {
    for (size_t k = 0; k < kSizes.size(); ++k) {
      t.send(to, base + k, out[k].data(), out[k].size(), sends.track());
    }
  };
  if (recvs_first) {
    post_recvs();
    gate();
    post_sends();
  } else {
    post_sends();
    gate();
    post_recvs();
  }
  ctx.verdict.expect(sends.wait_all() && recvs.wait_all(),
                     "timed out at tag base " + std::to_string(base));
  for (size_t k = 0; k < kSizes.size(); ++k) {
    std::string what = "tag " + std::to_string(base + k) + " size " + std::to_string(kSizes[k]);
    ctx.verdict.expect(sends.status(k).ok(), what + " send: " + sends.status(k).message());
    Status r = recvs.status(kSizes.size() - 1 - k);
    ctx.verdict.expect(r.ok(), what + " recv: " + r.message());
    ctx.verdict.expect(intact(in[k], from, base + k), what + " arrived corrupted");
  }
}

// Tells `peer` a zero-byte marker under `tag` and waits for the same marker from it.
void handshake(RankContext& ctx, int peer, Tag tag) {
  Outcomes marks;
  ctx.transport->send(peer, tag, nullptr, 0, marks.track());
  ctx.transport->recv(peer, tag, nullptr, 0, marks.track());
  ctx.verdict.expect(marks.wait_all() && marks.status(0).ok() && marks.status(1).ok(),
                     "handshake " + std::to_string(tag) + " failed");
}

void check_exit_codes(const std::vector<int>& codes, const std::vector<int>& expected) {
  REQUIRE(codes.size() == expected.size());
  for (size_t r = 0; r < codes.size(); ++r) {
    INFO("rank " << r << " exit code " << codes[r] << " (details on stderr)");
    CHECK(codes[r] == expected[r]);
  }
}

}  // namespace

TEST_CASE("ucx tagged messages of every size arrive intact between two processes in any order") {
  ProcessJob job(2, [](RankContext& ctx) {
    int other = 1 - ctx.rank;
    // Unexpected: every send is posted before the matching receive.
    exchange(
        ctx, other, other, 100, [&] { handshake(ctx, other, 1); }, false);
    // Expected: every receive is posted before the matching send.
    exchange(
        ctx, other, other, 200, [&] { handshake(ctx, other, 2); }, true);
    // A rank talks to itself through the same API.
    exchange(
        ctx, ctx.rank, ctx.rank, 300, [] {}, false);
  });
  job.barrier();
  check_exit_codes(job.wait(), {0, 0});
}

TEST_CASE("a ucx receive whose posted size differs from the message fails naming both sizes") {
  struct Case {
    Tag tag;
    size_t sent;
    size_t posted;
  };
  static const std::vector<Case> cases = {
      {10, 100, 64}, {11, 8u << 20, 4u << 20}, {12, 16, 32}, {13, 4u << 20, 8u << 20}};
  ProcessJob job(2, [](RankContext& ctx) {
    UcxTransport& t = *ctx.transport;
    Outcomes ops;
    std::vector<std::vector<uint8_t>> buffers;
    for (const Case& c : cases) buffers.emplace_back(ctx.rank == 0 ? c.sent : c.posted);
    std::vector<uint8_t> good = patterned(0, 14, 64);
    std::vector<uint8_t> good_in(64);
    for (size_t i = 0; i < cases.size(); ++i) {
      if (ctx.rank == 0) {
        t.send(1, cases[i].tag, buffers[i].data(), buffers[i].size(), ops.track());
      } else {
        t.recv(0, cases[i].tag, buffers[i].data(), buffers[i].size(), ops.track());
      }
    }
    // A well-sized message afterwards still arrives: a mismatch spoils nothing else.
    if (ctx.rank == 0) {
      t.send(1, 14, good.data(), good.size(), ops.track());
    } else {
      t.recv(0, 14, good_in.data(), good_in.size(), ops.track());
    }
    ctx.verdict.expect(ops.wait_all(), "operations did not complete");
    if (ctx.rank == 1) {
      for (size_t i = 0; i < cases.size(); ++i) {
        Status s = ops.status(i);
        const std::string& m = s.message();
        ctx.verdict.expect(!s.ok(), "tag " + std::to_string(cases[i].tag) + " succeeded");
        ctx.verdict.expect(has(m, std::to_string(cases[i].sent)) &&
                               has(m, std::to_string(cases[i].posted)) && has(m, "rank 0") &&
                               has(m, "tag " + std::to_string(cases[i].tag)),
                           "message lacks sizes, peer or tag: " + m);
        ctx.verdict.expect(s.peer() == 0, "status peer is " + std::to_string(s.peer()));
      }
      ctx.verdict.expect(ops.status(cases.size()).ok() && good_in == good,
                         "the well-sized message after the mismatches failed");
    }
  });
  job.barrier();
  check_exit_codes(job.wait(), {0, 0});
}

TEST_CASE("fail_peer fails pending ucx operations with the reason and later ones at once") {
  static const std::string reason = "rank 0 left the job (test)";
  ProcessJob job(
      2,
      [](RankContext& ctx) {
        UcxTransport& t = *ctx.transport;
        Outcomes bye;
        if (ctx.rank == 0) {
          t.recv(1, 22, nullptr, 0, bye.track());
          ctx.verdict.expect(bye.wait_all() && bye.status(0).ok(), "goodbye from rank 1 missing");
          return;
        }
        std::vector<uint8_t> small(64);
        std::vector<uint8_t> large(8u << 20, 1);
        Outcomes pending;
        t.recv(0, 20, small.data(), small.size(), pending.track());  // rank 0 never sends it
        t.send(0, 21, large.data(), large.size(), pending.track());  // rank 0 never receives it
        t.send(0, 22, nullptr, 0, bye.track());
        ctx.verdict.expect(bye.wait_all() && bye.status(0).ok(), "goodbye to rank 0 failed");
        t.fail_peer(0, reason);
        ctx.verdict.expect(pending.wait_all(), "pending operations not failed by fail_peer");
        for (size_t i = 0; i < 2; ++i) {
          Status s = pending.status(i);
          ctx.verdict.expect(!s.ok() && s.message() == reason && s.peer() == 0,
                             "pending op " + std::to_string(i) + " ended with: " + s.message());
        }
        Outcomes later;
        t.send(0, 23, small.data(), small.size(), later.track());
        t.recv(0, 24, small.data(), small.size(), later.track());
        ctx.verdict.expect(later.wait_all(std::chrono::seconds(1)),
                           "later ops did not fail at once");
        for (size_t i = 0; i < 2; ++i) {
          Status s = later.status(i);
          ctx.verdict.expect(!s.ok() && s.message() == reason && s.peer() == 0,
                             "later op " + std::to_string(i) + " ended with: " + s.message());
        }
        // Other peers are unaffected: rank 1 still reaches itself.
        exchange(
            ctx, 1, 1, 300, [] {}, true);
        for (Outcomes* o : {&pending, &later}) {
          for (size_t i = 0; i < o->size(); ++i) {
            ctx.verdict.expect(o->calls(i) == 1,
                               "a callback ran " + std::to_string(o->calls(i)) + " times");
          }
        }
      },
      Layout::one_host);  // the large send must wait for its receiver
  job.barrier();
  check_exit_codes(job.wait(), {0, 0});
}

TEST_CASE("a ucx receive pending from a killed process fails through fail_peer without a hang") {
  static const std::string reason = "rank 0 died (test)";
  ProcessJob job(2, [](RankContext& ctx) {
    handshake(ctx, 1 - ctx.rank, 1);  // the endpoints have carried traffic before the kill
    if (ctx.rank == 0) {
      hear(ctx.from_parent, "being killed");
      ctx.verdict.expect(false, "rank 0 was not killed");
      return;
    }
    std::vector<uint8_t> in(8u << 20);
    std::vector<uint8_t> out(8u << 20, 7);
    Outcomes pending;
    ctx.transport->recv(0, 30, in.data(), in.size(), pending.track());
    ctx.transport->send(0, 31, out.data(), out.size(), pending.track());
    tell(ctx.to_parent, "ready");
    hear(ctx.from_parent, "rank 0 killed");
    ctx.transport->fail_peer(0, reason);
    ctx.verdict.expect(pending.wait_all(std::chrono::seconds(10)), "fail_peer did not complete");
    Status r = pending.status(0);
    ctx.verdict.expect(!r.ok() && r.message() == reason && r.peer() == 0,
                       "the recv ended with: " + r.message());
    // UCX itself may fail the send first (its shared memory segment vanished with the process).
    Status s = pending.status(1);
    ctx.verdict.expect(!s.ok() && s.peer() == 0, "the send ended with: " + s.message());
    auto start = Clock::now();
    ctx.transport.reset();
    ctx.verdict.expect(Clock::now() - start < std::chrono::seconds(5), "destructor took over 5 s");
  });
  CHECK(job.hear(1) == "ready");
  job.kill(0);
  job.say(1, "killed");
  job.barrier();
  check_exit_codes(job.wait(), {128 + SIGKILL, 0});
}

// On one host UCX moves messages through one shared-memory FIFO per receiver, which every sender
// fills in turn: a sender killed between taking an element and marking it written leaves the
// receiver stuck on that element, deaf to the others. Rank 2 floods rank 0 with gossip-sized
// messages of a module that survives peer loss and is killed mid-stream; rank 1's messages of
// that module must still reach rank 0. (Without survive_peer_loss 3 of 12 rounds went deaf.)
TEST_CASE("a ucx sender killed in the middle of its sends leaves its receiver hearing the others") {
  constexpr int kRounds = 12;
  constexpr int kMessages = 8;
  constexpr size_t kBytes = 2700;
  static const uint32_t prefix = tags::module_prefix(1);
  auto tag = [](int k) { return tags::tag_of(tags::round_key(prefix, static_cast<uint64_t>(k))); };
  for (int round = 0; round < kRounds; ++round) {
    CAPTURE(round);
    ProcessJob job(
        3,
        [&](RankContext& ctx) {
          UcxTransport& t = *ctx.transport;
          const std::string gap = t.survive_peer_loss(prefix);
          ctx.verdict.expect(gap.empty(), "survive_peer_loss: " + gap);
          tell(ctx.to_parent, "ready");
          if (ctx.rank == 2) {
            std::vector<uint8_t> out(kBytes, 3);
            std::atomic<int> in_flight{0};
            hear(ctx.from_parent, "every rank ready");
            tell(ctx.to_parent, "flooding");
            for (int k = 1000;; ++k) {
              while (in_flight.load() > 16) std::this_thread::yield();
              in_flight.fetch_add(1);
              t.send(0, tag(k), out.data(), out.size(),
                     [&](const Status&) { in_flight.fetch_sub(1); });
            }
          }
          if (ctx.rank == 1) {
            hear(ctx.from_parent, "rank 2 killed");
            std::vector<std::vector<uint8_t>> out;
            Outcomes sent;
            for (int k = 0; k < kMessages; ++k) out.push_back(patterned(1, tag(k), kBytes));
            for (int k = 0; k < kMessages; ++k)
              t.send(0, tag(k), out[k].data(), out[k].size(), sent.track());
            ctx.verdict.expect(sent.wait_all(seconds(10)), "rank 1's sends did not complete");
            return;
          }
          std::vector<std::vector<uint8_t>> in(kMessages, std::vector<uint8_t>(kBytes));
          Outcomes heard;
          for (int k = 0; k < kMessages; ++k)
            t.recv(1, tag(k), in[k].data(), in[k].size(), heard.track());
          hear(ctx.from_parent, "rank 2 killed");
          t.fail_peer(2, "rank 2 was killed (test)");
          ctx.verdict.expect(heard.wait_all(seconds(10)),
                             "rank 0 did not hear rank 1 within 10 s after rank 2 was killed");
          for (int k = 0; k < kMessages; ++k) {
            ctx.verdict.expect(
                heard.calls(k) == 1 && heard.status(k).ok() && intact(in[k], 1, tag(k)),
                "message " + std::to_string(k) + " from rank 1 missing or corrupted");
          }
        },
        Layout::one_host);
    for (int r = 0; r < 3; ++r) REQUIRE(job.hear(r) == "ready");
    job.say(2, "go");
    CHECK(job.hear(2) == "flooding");
    job.kill(2);
    job.say(0, "killed");
    job.say(1, "killed");
    job.barrier();
    check_exit_codes(job.wait(), {0, 0, 128 + SIGKILL});
  }
}

TEST_CASE(
    "a ucx probe is answered by a running peer whatever it does, never by a stopped one, and fails "
    "at once for a failed one") {
  static const std::string reason = "rank 2 cannot be reached (test)";
  ProcessJob job(3, [](RankContext& ctx) {
    UcxTransport& t = *ctx.transport;
    ctx.verdict.expect(t.can_probe(), "a ucx transport cannot probe");
    if (ctx.rank == 1) {  // busy elsewhere: blocked on its pipe, not in any operation
      hear(ctx.from_parent, "rank 0's probes");
      return;
    }
    if (ctx.rank == 2) {
      tell(ctx.to_parent, "ready");
      return;
    }
    hear(ctx.from_parent, "rank 2 stopped");
    Outcomes running, stopped, failed;
    t.probe(1, running.track());
    ctx.verdict.expect(running.wait_all(std::chrono::seconds(10)) && running.status(0).ok(),
                       "rank 1's probe: " + running.status(0).message());
    t.probe(2, stopped.track());
    // A stopped process cannot answer: nothing within a second (an answer would be a bug).
    ctx.verdict.expect(!stopped.wait_all(std::chrono::seconds(1)), "a stopped rank answered");
    t.fail_peer(2, reason);
    ctx.verdict.expect(stopped.wait_all(std::chrono::seconds(10)), "fail_peer left the probe");
    ctx.verdict.expect(!stopped.status(0).ok() && stopped.status(0).message() == reason,
                       "the unanswered probe ended with: " + stopped.status(0).message());
    t.probe(2, failed.track());
    ctx.verdict.expect(failed.wait_all(std::chrono::seconds(1)) && !failed.status(0).ok() &&
                           failed.status(0).message() == reason,
                       "a probe of a failed peer ended with: " + failed.status(0).message());
    ctx.verdict.expect(stopped.calls(0) == 1 && running.calls(0) == 1, "a callback ran twice");
    tell(ctx.to_parent, "probed");
  });
  CHECK(job.hear(2) == "ready");
  job.signal(2, SIGSTOP);
  job.say(0, "stopped");
  CHECK(job.hear(0) == "probed");
  job.signal(2, SIGCONT);
  job.say(1, "probed");
  job.barrier();
  check_exit_codes(job.wait(), {0, 0, 0});
}

// Rank 0's allreduce over UCX with a 300 ms deadline, which its peers never join; returns the
// error it ended with.
std::string lonely_allreduce(RankContext& ctx) {
  std::shared_ptr<Transport> borrowed(ctx.transport.get(), [](Transport*) {});
  Communicator comm(borrowed, CollectiveOptions{}, std::chrono::milliseconds(300));
  float x = 1;
  try {
    comm.allreduce(&x, 1, DataType::float32, ReduceOp::sum);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST_CASE(
    "a collective over ucx that times out says whether its peers answered a probe, and names the "
    "one that did not") {
  // Rank 1 runs but joins no collective: it answers, so it is slow, not cut off.
  ProcessJob slow(2, [](RankContext& ctx) {
    if (ctx.rank == 1) return hear(ctx.from_parent, "rank 0's allreduce"), void();
    const std::string error = lonely_allreduce(ctx);
    ctx.verdict.expect(has(error,
                           "timed out after 300 ms waiting for rank(s) 1 (every other rank "
                           "answered a reachability probe within 500 ms"),
                       "error: " + error);
    tell(ctx.to_parent, "timed out");
  });
  CHECK(slow.hear(0) == "timed out");
  slow.say(1, "done");
  slow.barrier();
  check_exit_codes(slow.wait(), {0, 0});
  // Rank 2 stopped: it alone cannot be reached, rank 1 answered.
  ProcessJob stopped(3, [](RankContext& ctx) {
    if (ctx.rank == 1) return hear(ctx.from_parent, "rank 0's allreduce"), void();
    if (ctx.rank == 2) return tell(ctx.to_parent, "ready");
    hear(ctx.from_parent, "rank 2 stopped");
    const std::string error = lonely_allreduce(ctx);
    ctx.verdict.expect(has(error,
                           ": rank(s) 2 cannot be reached from rank 0 (no answer to a "
                           "reachability probe within 500 ms"),
                       "error: " + error);
    tell(ctx.to_parent, "timed out");
  });
  CHECK(stopped.hear(2) == "ready");
  stopped.signal(2, SIGSTOP);
  stopped.say(0, "stopped");
  CHECK(stopped.hear(0) == "timed out");
  stopped.signal(2, SIGCONT);
  stopped.say(1, "done");
  stopped.barrier();
  check_exit_codes(stopped.wait(), {0, 0, 0});
}

TEST_CASE("a lone ucx rank rejects bad peers and tags and fails what is pending when destroyed") {
  ProcessJob job(
      1,
      [](RankContext& ctx) {
        UcxTransport& t = *ctx.transport;
        ctx.verdict.expect(!UcxTransport::version().empty(), "empty UCX version");
        std::string transports = UcxTransport::available_transports();  // follows UCX_TLS
        ctx.verdict.expect(!transports.empty() && !has(transports, "/") && !has(transports, "#"),
                           "transports: \"" + transports + "\"");
        std::vector<uint8_t> buffer(8u << 20);
        Outcomes bad;
        t.send(1, 1, buffer.data(), 8, bad.track());
        t.recv(-1, 1, buffer.data(), 8, bad.track());
        t.send(0, kTagMask + 1, buffer.data(), 8, bad.track());
        ctx.verdict.expect(bad.wait_all(), "bad operations did not fail");
        ctx.verdict.expect(
            has(bad.status(0).message(), "rank 1") && has(bad.status(0).message(), "[0, 1)"),
            "bad peer message: " + bad.status(0).message());
        ctx.verdict.expect(has(bad.status(1).message(), "rank -1"),
                           "bad peer message: " + bad.status(1).message());
        ctx.verdict.expect(has(bad.status(2).message(), "48 bits"),
                           "bad tag message: " + bad.status(2).message());
        bool threw = false;
        try {
          t.fail_peer(3, "no such rank");
        } catch (const Error& e) {
          threw = has(e.what(), "peer 3");
        }
        ctx.verdict.expect(threw, "fail_peer accepted rank 3 of 1");

        Outcomes pending;
        std::vector<uint8_t> small(64);
        t.recv(0, 7, small.data(), small.size(), pending.track());    // never sent
        t.send(0, 8, buffer.data(), buffer.size(), pending.track());  // never received
        Outcomes sync;
        t.send(0, 9, nullptr, 0, sync.track());
        t.recv(0, 9, nullptr, 0, sync.track());
        ctx.verdict.expect(sync.wait_all(), "self message did not arrive");
        auto start = Clock::now();
        ctx.transport.reset();
        ctx.verdict.expect(Clock::now() - start < seconds(5), "destructor took over 5 s");
        ctx.verdict.expect(pending.wait_all(seconds(0)), "destructor left operations pending");
        for (size_t i = 0; i < 2; ++i) {
          ctx.verdict.expect(pending.status(i).message() == "transport shut down",
                             "pending op ended with: " + pending.status(i).message());
        }
      },
      Layout::one_host);  // the large send must wait for its receiver
  job.barrier();
  check_exit_codes(job.wait(), {0});
}

TEST_CASE("a ucx transport made from a worker made earlier takes its address and moves bytes") {
  ProcessJob job(
      1,
      [](RankContext& ctx) {
        // What an elastic spare does: the context and worker before its rank is known, the
        // transport once a world takes it.
        auto made = std::make_unique<UcxWorker>(/*single_host=*/true, /*estimated_peers=*/4);
        const std::string address = made->address();
        ctx.verdict.expect(!address.empty(), "a worker made earlier has no address");
        UcxTransport t(0, 1, std::move(made));
        ctx.verdict.expect(t.local_address() == address,
                           "the transport did not take the worker's address");
        t.connect({address});
        std::vector<uint8_t> sent(1000), got(1000);
        for (size_t i = 0; i < sent.size(); ++i) sent[i] = static_cast<uint8_t>(i * 7);
        Outcomes self;
        t.recv(0, 3, got.data(), got.size(), self.track());
        t.send(0, 3, sent.data(), sent.size(), self.track());
        ctx.verdict.expect(self.wait_all(), "a self message through it did not arrive");
        ctx.verdict.expect(got == sent, "a self message through it arrived changed");
        bool threw = false;
        try {
          UcxTransport none(0, 1, std::unique_ptr<UcxWorker>());
        } catch (const Error& e) {
          threw = has(e.what(), "no UcxWorker");
        }
        ctx.verdict.expect(threw, "a transport without a worker was made");
      },
      Layout::one_host);
  job.barrier();
  check_exit_codes(job.wait(), {0});
}

TEST_CASE("a ucx message on an emulated link arrives no earlier than its link allows, intact") {
  ProcessJob job(2, [](RankContext& ctx) {
    // A rate slow enough that the link's time (89 ms) outweighs the transport's own, so that the
    // upper bound below can both catch a rate applied 10x too slow and leave room for a busy host.
    const LinkShape shape = parse_link_shape("100mbit,5ms");
    const size_t bytes = 1u << 20;
    // Rank 0 shapes its link to rank 1; rank 1 answers each message over its plain transport.
    std::shared_ptr<Transport> plain(ctx.transport.get(), [](Transport*) {});
    auto t = ctx.rank == 0 ? std::make_shared<EmulatedTransport>(
                                 plain, std::vector<LinkShape>{LinkShape{}, shape})
                           : plain;
    handshake(ctx, 1 - ctx.rank, 1);
    if (ctx.rank == 1) {
      std::vector<uint8_t> in(bytes);
      Outcomes ops;
      t->recv(0, 40, in.data(), in.size(), ops.track());
      ctx.verdict.expect(ops.wait_all() && ops.status(0).ok(), "the shaped message failed");
      ctx.verdict.expect(intact(in, 0, 40), "the shaped message arrived corrupted");
      t->send(0, 41, nullptr, 0, ops.track());
      ctx.verdict.expect(ops.wait_all() && ops.status(1).ok(), "the answer failed");
      return;
    }
    ctx.verdict.expect(t->name() == "ucx+emulated", "name " + t->name());
    std::vector<uint8_t> out = patterned(0, 40, bytes);
    Outcomes ops;
    t->recv(1, 41, nullptr, 0, ops.track());
    const auto start = Clock::now();
    t->send(1, 40, out.data(), out.size(), ops.track());
    ctx.verdict.expect(ops.wait_all(), "the shaped message or its answer timed out");
    const auto took = Clock::now() - start;
    const auto least = std::chrono::microseconds(83886) + shape.latency;  // 2^20 B at 12.5 MB/s
    ctx.verdict.expect(took >= least && took <= 3 * least + std::chrono::milliseconds(250),
                       "the round trip took " +
                           std::to_string(std::chrono::duration<double, std::milli>(took).count()) +
                           " ms, the link needs 88.9 ms (expected at most 517 ms)");
    ctx.verdict.expect(ops.status(0).ok() && ops.status(1).ok(), "an operation failed");
  });
  job.barrier();
  check_exit_codes(job.wait(), {0, 0});
}

}  // namespace troupe::comm
