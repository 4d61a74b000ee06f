#include "comm/transport/ucx/transport.h"

#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <sstream>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace troupe::comm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kRankBits = 64 - kTagBits;
constexpr int kMaxWorldSize = 1 << kRankBits;
constexpr ucp_tag_t kFullTagMask = ~ucp_tag_t{0};
// tcp rides along only for the endpoints of modules that go on after a peer dies
// (survive_peer_loss); UCX_MAX_RNDV_LANES=0 keeps it off every other endpoint, whose lanes stay
// shared memory alone (with tcp it would take their rendezvous).
constexpr const char* kSingleHostTls = "posix,sysv,tcp,self";
// Across hosts, UCX's default sends every message above 8 KiB over tcp by rendezvous (a request,
// then the data once the receiver answers): a round trip per message, which held a 4-host ring
// allreduce at 1 Gbit/s to ~90% of the line rate's bound; eager messages reached 94-95%, as gloo
// (docs/benchmarks-archive.md, "Eager messages across hosts"). UCX_RNDV_THRESH, when set, wins.
constexpr const char* kAcrossHostsRndvThresh = "inf";
constexpr auto kIdleWait = std::chrono::milliseconds(100);
// The longest sleep with operations in flight when none goes through shared memory (as across
// hosts: UcxTransport::progress_for(false)).
constexpr auto kUnpolledBusyWait = std::chrono::microseconds(250);
constexpr auto kConnectDeadline = std::chrono::seconds(30);
const char* const kShutDown = "transport shut down";

ucp_tag_t wire_tag(int src_rank, Tag tag) {
  return (static_cast<ucp_tag_t>(src_rank) << kTagBits) | (tag & kTagMask);
}

void check_ucx(const char* call, ucs_status_t status) {
  if (status != UCS_OK) throw Error(std::string(call) + " failed: " + ucs_status_string(status));
}

/// One send or receive, from submission until UCX is done with it and its callback has run.
struct Op {
  enum class Kind { send, recv };
  Kind kind = Kind::send;
  int peer = 0;
  Tag tag = 0;
  void* data = nullptr;
  size_t bytes = 0;
  Callback done;
  void* request = nullptr;  // UCX request while UCX still owns the operation
  bool ucx_done = false;    // UCX called back or completed it in the posting call
  bool finished = false;    // `done` has run
  ucs_status_t ucx_status = UCS_OK;
  ucp_tag_recv_info_t info{};
  void* impl = nullptr;  // the UcxTransport::Impl that posted it
  // A standing receive (the answerer of a peer's probes): not counted in in_flight_, so that an
  // idle rank still sleeps kIdleWait instead of polling for a message that may never come.
  bool standing = false;
  // Its message may come or go through a shared-memory FIFO, which UCX does not always signal on
  // its fd: worth polling for (see run()).
  bool polled = false;

  std::string describe() const {
    return std::string("ucx ") + (kind == Kind::send ? "send to" : "recv from") + " rank " +
           std::to_string(peer) + " tag " + std::to_string(tag);
  }
};

/// Work for the progress thread: an operation to post, or a task (connect, fail_peer).
struct Command {
  std::unique_ptr<Op> op;
  std::function<void()> task;
};

// The UCX transports a context found ("posix", "sysv", "tcp", ...), in its order.
std::vector<std::string> resource_names(ucp_context_h context) {
  char* text = nullptr;
  size_t size = 0;
  FILE* stream = ::open_memstream(&text, &size);
  if (stream == nullptr)
    throw Error(std::string("UcxTransport: open_memstream failed: ") + std::strerror(errno));
  ucp_context_print_info(context, stream);
  std::fclose(stream);
  std::string info(text, size);
  std::free(text);
  // Lines read "#      resource 1  :  md 1  dev 1  flags -- tcp/lo": keep the names before '/'.
  std::vector<std::string> names;
  std::istringstream lines(info);
  std::string line;
  while (std::getline(lines, line)) {
    size_t slash = line.rfind('/');
    size_t space = slash == std::string::npos ? slash : line.rfind(' ', slash);
    if (line.find("resource") == std::string::npos || space == std::string::npos) continue;
    std::string name = line.substr(space + 1, slash - space - 1);
    if (!name.empty() && std::find(names.begin(), names.end(), name) == names.end()) {
      names.push_back(name);
    }
  }
  return names;
}

// Whether an endpoint's lanes (lanes_of) include one of UCX's shared-memory FIFOs (the mm
// transports). Each receiving worker has one such FIFO, filled by every sender in turn and read in
// order: a sender that dies between taking an element and marking it written (UCX's mm transports
// have no peer-failure handling) leaves the receiver waiting on that element for good, deaf to
// every other sender on the host. Other transports (tcp, cma, self) keep no state between peers.
bool shares_fifo(const std::string& lanes) {
  std::istringstream words(lanes);
  for (std::string word; words >> word;) {
    const std::string name = word.substr(0, word.find('/'));
    if (name == "posix" || name == "sysv" || name == "xpmem") return true;
  }
  return false;
}

}  // namespace

struct UcxWorker::Handles {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::string address;
  bool single_host = false;
  bool single_host_tls = false;  // UCX limited to kSingleHostTls
  ~Handles() {
    if (worker != nullptr) ucp_worker_destroy(worker);
    if (context != nullptr) ucp_cleanup(context);
  }
};

UcxWorker::UcxWorker(bool single_host, int estimated_peers)
    : handles_(std::make_unique<Handles>()) {
  Handles& h = *handles_;
  h.single_host = single_host;
  ucp_config_t* config = nullptr;
  check_ucx("ucp_config_read", ucp_config_read(nullptr, nullptr, &config));
  // Between processes of one host, shared memory without cross-memory attach moved large
  // messages ~1.5x faster here than UCX's default (which adds cma); UCX_TLS, when set, wins.
  if (single_host && std::getenv("UCX_TLS") == nullptr) {
    check_ucx("ucp_config_modify", ucp_config_modify(config, "TLS", kSingleHostTls));
    check_ucx("ucp_config_modify", ucp_config_modify(config, "MAX_RNDV_LANES", "0"));
    h.single_host_tls = true;
  }
  if (!single_host && std::getenv("UCX_RNDV_THRESH") == nullptr)
    check_ucx("ucp_config_modify",
              ucp_config_modify(config, "RNDV_THRESH", kAcrossHostsRndvThresh));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.estimated_num_eps = static_cast<size_t>(std::max(estimated_peers, 1));
  ucs_status_t status = ucp_init(&params, config, &h.context);
  ucp_config_release(config);
  if (status != UCS_OK) {
    const char* tls = std::getenv("UCX_TLS");
    throw Error("ucp_init failed: " + std::string(ucs_status_string(status)) +
                " (UCX_TLS=" + (tls != nullptr ? "\"" + std::string(tls) + "\"" : "unset") +
                "; `ucx_info -d` lists the transports this machine has)");
  }

  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  check_ucx("ucp_worker_create", ucp_worker_create(h.context, &worker_params, &h.worker));

  ucp_address_t* address = nullptr;
  size_t length = 0;
  check_ucx("ucp_worker_get_address", ucp_worker_get_address(h.worker, &address, &length));
  h.address.assign(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(h.worker, address);
}

UcxWorker::~UcxWorker() = default;

const std::string& UcxWorker::address() const { return handles_->address; }

bool UcxWorker::single_host() const { return handles_->single_host; }

struct UcxTransport::Impl {
  const int rank_;
  const int world_size_;
  const UcxTransport::Progress progress_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  int worker_fd_ = -1;
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
  // The kernel lacks epoll_pwait2 (before 5.11): wait_events falls back to epoll_wait's whole
  // milliseconds. Only the progress thread reads and writes it.
  bool no_pwait2_ = false;
  std::thread thread_;

  // Shared with callers, guarded by mutex_.
  std::mutex mutex_;
  std::deque<Command> queue_;
  bool sleeping_ = false;
  bool stop_ = false;
  std::atomic<bool> has_commands_{false};

  // Owned by the progress thread (or by the destructor once the thread has joined).
  std::vector<ucp_ep_h> eps_;
  std::vector<std::string> paths_;      // per peer: the UCX transports of its endpoint's lanes
  std::vector<std::string> protocols_;  // per peer: the endpoint's tag-send protocols by size
  bool single_host_tls_ = false;        // UCX limited to kSingleHostTls
  std::vector<std::string> dead_;       // non-empty: the reason the peer was failed
  std::unordered_map<Op*, std::unique_ptr<Op>> ops_;  // every operation UCX may still call back
  std::vector<std::unordered_set<Op*>> pending_;      // per peer: posted, not yet finished
  std::vector<Op*> completed_;                        // called back by UCX, not yet processed
  std::vector<uint64_t> probe_in_;  // per peer: the buffer of its standing probe receive
  // Modules that go on after a peer dies (survive_peer_loss): their sends to a peer whose
  // endpoint shares a FIFO go through a second endpoint in UCX's peer-failure mode (tcp), made
  // on the first such request. Bit m: module m.
  std::vector<std::string> addresses_;  // as connect() got them
  uint32_t robust_modules_ = 0;
  bool robust_made_ = false;
  std::vector<ucp_ep_h> robust_eps_;
  std::string robust_gap_;  // why some peer has no such endpoint; empty when none lacks one
  std::vector<std::pair<ucp_ep_h, ucs_status_t>> broken_;  // endpoints UCX reported failed
  uint64_t probes_sent_ = 0;
  size_t in_flight_ = 0;         // operations posted to UCX whose callback has not run
  size_t polled_in_flight_ = 0;  // those of them that are `polled`
  std::vector<char> fifo_;       // per peer: its endpoint shares a FIFO (shares_fifo)
  bool shutting_down_ = false;
  bool destroying_ = false;

  Impl(int rank, int world_size, UcxTransport::Progress progress)
      : rank_(rank),
        world_size_(world_size),
        progress_(progress),
        eps_(world_size),
        paths_(world_size),
        protocols_(world_size),
        dead_(world_size),
        pending_(world_size),
        probe_in_(world_size),
        robust_eps_(world_size) {}

  ~Impl() {
    if (thread_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
        has_commands_.store(true, std::memory_order_release);
      }
      wake();
      thread_.join();
    }
    destroying_ = true;
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

  // Takes the context and worker of `made` (this transport destroys them).
  void start(UcxWorker::Handles& made) {
    context_ = std::exchange(made.context, nullptr);
    worker_ = std::exchange(made.worker, nullptr);
    address_ = made.address;
    single_host_tls_ = made.single_host_tls;
    check_ucx("ucp_worker_get_efd", ucp_worker_get_efd(worker_, &worker_fd_));
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (wake_fd_ < 0 || epoll_fd_ < 0) {
      throw Error(std::string("UcxTransport: eventfd/epoll_create1 failed: ") +
                  std::strerror(errno));
    }
    for (int fd : {worker_fd_, wake_fd_}) {
      epoll_event event{};
      event.events = EPOLLIN;
      event.data.fd = fd;
      if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event) != 0) {
        throw Error(std::string("UcxTransport: epoll_ctl failed: ") + std::strerror(errno));
      }
    }
    thread_ = std::thread([this] { run(); });
  }

  // ---- caller side ----

  void submit(Command command) {
    bool wake_now = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(command));
      has_commands_.store(true, std::memory_order_release);
      wake_now = sleeping_;
      sleeping_ = false;
    }
    if (wake_now) wake();
  }

  // Runs `task` on the progress thread (which owns the worker) and returns its result or
  // rethrows its exception; throws naming `caller` and what it waited for after kConnectDeadline.
  template <typename Task>
  auto call(const char* caller, const char* waiting_for, Task task) -> decltype(task()) {
    using Result = decltype(task());
    auto done = std::make_shared<std::promise<Result>>();
    std::future<Result> result = done->get_future();
    submit(Command{nullptr, [task = std::move(task), done]() mutable {
                     try {
                       if constexpr (std::is_void_v<Result>) {
                         task();
                         done->set_value();
                       } else {
                         done->set_value(task());
                       }
                     } catch (...) {
                       done->set_exception(std::current_exception());
                     }
                   }});
    if (result.wait_for(kConnectDeadline) != std::future_status::ready)
      throw Error(std::string(caller) + ": the progress thread did not " + waiting_for +
                  " within " + std::to_string(kConnectDeadline.count()) + " s");
    return result.get();
  }

  void wake() {
    uint64_t one = 1;
    while (::write(wake_fd_, &one, sizeof one) < 0 && errno == EINTR) {
    }
  }

  void post(Op::Kind kind, int peer, Tag tag, void* data, size_t bytes, Callback done) {
    auto op = std::make_unique<Op>();
    op->kind = kind;
    op->peer = peer;
    op->tag = tag;
    op->data = data;
    op->bytes = bytes;
    op->done = std::move(done);
    op->impl = this;
    submit(Command{std::move(op), nullptr});
  }

  // ---- progress thread ----

  void run() {
    auto last_event = Clock::now();
    for (;;) {
      if (has_commands_.load(std::memory_order_acquire)) {
        if (drain_commands()) break;
        last_event = Clock::now();
      }
      if (ucp_worker_progress(worker_) != 0) last_event = Clock::now();
      if (!broken_.empty()) close_broken();
      if (!completed_.empty()) process_completions();
      // Polling pays only for shared memory. Once a module rides the peer-failure endpoints
      // (tcp), the thread polls only while an operation through a FIFO is in flight: tcp wakes
      // it through the fd, and beside busy processes each sched_yield gives the core away for a
      // scheduler tick (docs/benchmarks-archive.md, "One host beside busy processes").
      const bool poll = !robust_made_ || polled_in_flight_ > 0;
      if (poll && Clock::now() - last_event < progress_.spin) {
        // On few cores the thread that waits for our completions may share this core: let it run.
        sched_yield();
        continue;
      }
      bool in_flight = in_flight_ > 0;
      // Idle: sleep until UCX or a caller signals. Arm only after progress found nothing.
      ucs_status_t status = ucp_worker_arm(worker_);
      if (status == UCS_ERR_BUSY) continue;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!queue_.empty() || stop_) continue;
        sleeping_ = true;
      }
      epoll_event events[2];
      const auto busy_wait = poll ? progress_.busy_wait : kUnpolledBusyWait;
      int woken = wait_events(events, 2, status == UCS_OK && !in_flight ? kIdleWait : busy_wait);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        sleeping_ = false;
      }
      // Reading the eventfd resets it; a read with nothing to read (most wake-ups are UCX's or
      // the timeout) cost a fifth of this thread's time in the training benchmark.
      for (int k = 0; k < woken; ++k) {
        if (events[k].data.fd != wake_fd_) continue;
        uint64_t count = 0;
        while (::read(wake_fd_, &count, sizeof count) < 0 && errno == EINTR) {
        }
      }
      if (woken > 0) last_event = Clock::now();
    }
    shut_down();
  }

  // epoll_wait for at most `timeout`, to the microsecond where the kernel has epoll_pwait2 (5.11).
  int wait_events(epoll_event* events, int max, std::chrono::microseconds timeout) {
    timespec ts{static_cast<time_t>(timeout.count() / 1000000),
                static_cast<long>(timeout.count() % 1000000 * 1000)};
    if (!no_pwait2_) {
      int woken = ::epoll_pwait2(epoll_fd_, events, max, &ts, nullptr);
      if (woken >= 0 || errno != ENOSYS) return woken;
      no_pwait2_ = true;
    }
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(timeout);
    return ::epoll_wait(epoll_fd_, events, max, static_cast<int>(ms.count()));
  }

  // Runs queued commands; returns true when the transport is stopping.
  bool drain_commands() {
    std::deque<Command> commands;
    bool stop = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      commands.swap(queue_);
      has_commands_.store(false, std::memory_order_relaxed);
      stop = stop_;
    }
    for (Command& command : commands) {
      if (command.op) {
        start_op(std::move(command.op));
      } else if (command.task) {
        command.task();
      }
    }
    return stop;
  }

  Status precheck(const Op& op) const {
    if (op.peer < 0 || op.peer >= world_size_) {
      return Status::failure(op.describe() + ": peer must be in [0, " +
                             std::to_string(world_size_) + ")");
    }
    if ((op.tag & ~kTagMask) != 0) {
      return Status::failure(
          op.describe() + ": tag must fit in " + std::to_string(kTagBits) + " bits", op.peer);
    }
    if (shutting_down_) return Status::failure(kShutDown, op.peer);
    if (!dead_[op.peer].empty()) return Status::failure(dead_[op.peer], op.peer);
    if (op.kind == Op::Kind::send && eps_[op.peer] == nullptr) {
      return Status::failure(op.describe() + ": not connected (call connect() first)", op.peer);
    }
    return Status::success();
  }

  void start_op(std::unique_ptr<Op> owned) {
    Op* op = owned.get();
    Status problem = precheck(*op);
    if (!problem.ok()) {
      op->finished = true;
      if (op->done) op->done(problem);
      return;
    }
    ops_.emplace(op, std::move(owned));
    pending_[op->peer].insert(op);
    if (!op->standing) ++in_flight_;
    op->polled = !op->standing && through_fifo(op->peer, op->tag);
    if (op->polled) ++polled_in_flight_;

    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.user_data = op;
    ucs_status_ptr_t result;
    if (op->kind == Op::Kind::send) {
      param.cb.send = &on_send_done;
      result = ucp_tag_send_nbx(endpoint_for(op->peer, op->tag), op->data, op->bytes,
                                wire_tag(rank_, op->tag), &param);
    } else {
      // UCX 1.13 leaves recv_info.tag_info unfilled when an unexpected eager message completes
      // the receive inside the call, so the length check would be blind: have UCX call back.
      param.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
      param.cb.recv = &on_recv_done;
      result = ucp_tag_recv_nbx(worker_, op->data, op->bytes, wire_tag(op->peer, op->tag),
                                kFullTagMask, &param);
    }
    if (UCS_PTR_IS_PTR(result)) {
      // UCX may already have called back from inside the posting call.
      if (!op->ucx_done) op->request = result;
      return;
    }
    // Completed (or failed) inside the call: UCX will not call back.
    op->ucx_done = true;
    op->ucx_status = UCS_PTR_STATUS(result);
    finish(op, outcome(*op));
    ops_.erase(op);
  }

  bool robust_route(int peer, Tag tag) const {
    const uint32_t module =
        static_cast<uint32_t>(tag >> (tags::kSubBits + tags::kModuleShift)) & tags::kModuleMask;
    return robust_eps_[peer] != nullptr && (robust_modules_ >> module & 1u) != 0;
  }

  ucp_ep_h endpoint_for(int peer, Tag tag) const {
    return robust_route(peer, tag) ? robust_eps_[peer] : eps_[peer];
  }

  // Whether an operation's message goes through a shared-memory FIFO: a send by its endpoint, a
  // receive by the endpoint the peer sends it through (every rank registers the same modules).
  bool through_fifo(int peer, Tag tag) const {
    return fifo_.empty() || (fifo_[peer] != 0 && !robust_route(peer, tag));
  }

  static void on_send_done(void* request, ucs_status_t status, void* user_data) {
    auto* op = static_cast<Op*>(user_data);
    static_cast<Impl*>(op->impl)->on_ucx_done(op, request, status);
  }

  static void on_recv_done(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                           void* user_data) {
    auto* op = static_cast<Op*>(user_data);
    if (info != nullptr) op->info = *info;
    static_cast<Impl*>(op->impl)->on_ucx_done(op, request, status);
  }

  // Called from inside UCX: only record, user callbacks run later from process_completions.
  void on_ucx_done(Op* op, void* request, ucs_status_t status) {
    op->ucx_done = true;
    op->ucx_status = status;
    op->request = nullptr;
    if (!destroying_) ucp_request_free(request);
    completed_.push_back(op);
  }

  void process_completions() {
    while (!completed_.empty()) {
      std::vector<Op*> batch;
      batch.swap(completed_);
      for (Op* op : batch) {
        if (!op->finished) finish(op, outcome(*op));
        ops_.erase(op);
      }
    }
  }

  Status outcome(const Op& op) const {
    bool is_recv = op.kind == Op::Kind::recv;
    if (op.ucx_status == UCS_OK && (!is_recv || op.info.length == op.bytes)) {
      return Status::success();
    }
    if (!dead_[op.peer].empty()) return Status::failure(dead_[op.peer], op.peer);
    if (shutting_down_) return Status::failure(kShutDown, op.peer);
    if (is_recv && (op.ucx_status == UCS_OK || op.ucx_status == UCS_ERR_MESSAGE_TRUNCATED)) {
      std::string sent = op.info.length > op.bytes || op.ucx_status == UCS_OK
                             ? std::to_string(op.info.length) + "-byte message"
                             : "message larger than " + std::to_string(op.bytes) + " bytes";
      return Status::failure(op.describe() + ": received a " + sent +
                                 " but the receive was posted for " + std::to_string(op.bytes) +
                                 " bytes",
                             op.peer);
    }
    return Status::failure(op.describe() + ": " +
                               (is_recv ? "ucp_tag_recv_nbx" : "ucp_tag_send_nbx") +
                               " failed: " + ucs_status_string(op.ucx_status),
                           op.peer);
  }

  void finish(Op* op, const Status& status) {
    if (op->finished) return;
    op->finished = true;
    pending_[op->peer].erase(op);
    if (!op->standing) --in_flight_;
    if (op->polled) --polled_in_flight_;
    Callback done = std::move(op->done);
    if (done) done(status);
  }

  void connect_all(const std::vector<std::string>& addresses) {
    for (int r = 0; r < world_size_; ++r) {
      if (eps_[r] != nullptr)
        throw Error("UcxTransport::connect: already connected to rank " + std::to_string(r), r);
      if (addresses[r].empty())
        throw Error("UcxTransport::connect: address of rank " + std::to_string(r) + " is empty", r);
    }
    addresses_ = addresses;
    fifo_.assign(world_size_, 1);  // until each endpoint's lanes are known
    for (int r = 0; r < world_size_; ++r) {
      ucp_ep_params_t params{};
      params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
      params.address = reinterpret_cast<const ucp_address_t*>(addresses[r].data());
      params.err_mode = UCP_ERR_HANDLING_MODE_NONE;  // PEER mode would disable shared memory
      ucs_status_t status = ucp_ep_create(worker_, &params, &eps_[r]);
      if (status != UCS_OK) {
        eps_[r] = nullptr;
        throw Error(
            "UcxTransport::connect: ucp_ep_create for rank " + std::to_string(r) + " failed (" +
                std::to_string(addresses[r].size()) +
                "-byte address): " + ucs_status_string(status) +
                (single_host_tls_ ? std::string(" (UCX was limited to ") + kSingleHostTls +
                                        " because LOCAL_WORLD_SIZE equals WORLD_SIZE, i.e. "
                                        "every rank on this host; on several hosts set "
                                        "LOCAL_WORLD_SIZE to the ranks per host, or UCX_TLS)"
                                  : std::string()),
            r);
      }
      const std::string info = print_info(eps_[r]);
      paths_[r] = lanes_of(info);
      fifo_[r] = shares_fifo(paths_[r]) ? 1 : 0;
      protocols_[r] = tag_send_protocols(info);
    }
    for (int r = 0; r < world_size_; ++r)
      if (r != rank_) answer_probes(r);
  }

  // ---- modules that survive a peer's death (survive_peer_loss), on the progress thread ----

  // Marks `module`'s sends for the peer-failure endpoints, making them on the first call: one to
  // each peer whose endpoint shares a FIFO. Returns robust_gap_.
  std::string survive_peer_loss_now(uint32_t module) {
    if (addresses_.empty())
      throw Error("UcxTransport::survive_peer_loss: not connected (call connect() first)");
    robust_modules_ |= 1u << module;
    if (robust_made_) return robust_gap_;
    robust_made_ = true;
    std::vector<int> needing;
    for (int r = 0; r < world_size_; ++r)
      if (r != rank_ && dead_[r].empty() && eps_[r] != nullptr && shares_fifo(paths_[r]))
        needing.push_back(r);
    if (needing.empty()) return robust_gap_;
    const auto names = resource_names(context_);
    std::string lacking, why;
    if (std::find(names.begin(), names.end(), "tcp") == names.end()) {
      const char* tls = std::getenv("UCX_TLS");
      why = std::string("UCX_TLS=") + (tls != nullptr ? tls : "(unset)") +
            " offers no transport that survives a peer's death (add tcp)";
      for (int r : needing) lacking += (lacking.empty() ? "" : ", ") + std::to_string(r);
    } else {
      for (int r : needing) {
        ucp_ep_params_t params{};
        params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                            UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
        params.address = reinterpret_cast<const ucp_address_t*>(addresses_[r].data());
        params.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // UCX leaves out the mm transports
        params.err_handler.cb = &on_endpoint_error;
        params.err_handler.arg = this;
        ucs_status_t status = ucp_ep_create(worker_, &params, &robust_eps_[r]);
        if (status != UCS_OK) {
          robust_eps_[r] = nullptr;
          lacking += (lacking.empty() ? "" : ", ") + std::to_string(r);
          why = std::string("ucp_ep_create in peer-failure mode failed: ") +
                ucs_status_string(status);
        }
      }
    }
    if (!lacking.empty())
      robust_gap_ = "messages to ranks " + lacking +
                    " go through UCX's shared-memory FIFO, which " +
                    "a sender that dies in the middle of a send blocks for every other sender, " +
                    "and " + why;
    return robust_gap_;
  }

  // UCX's error handler of a peer-failure endpoint (inside ucp_worker_progress): record only.
  static void on_endpoint_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
    static_cast<Impl*>(arg)->broken_.emplace_back(ep, status);
  }

  // A peer-failure endpoint fails when its peer's process has ended (its connection reset): UCX
  // fails what was in flight on it, and wants it closed. Later sends to that peer take its other
  // endpoint, as every send to a dead peer did before (the directory tells who died).
  void close_broken() {
    while (!broken_.empty()) {
      auto broken = std::move(broken_);
      broken_.clear();
      for (auto [ep, status] : broken) {
        auto at = std::find(robust_eps_.begin(), robust_eps_.end(), ep);
        if (at != robust_eps_.end()) close_endpoint(std::exchange(*at, nullptr));
      }
    }
  }

  // ---- reachability probes (Transport::probe), on the progress thread ----

  // Keeps a receive posted for `peer`'s probes; each one is answered and the receive posted
  // again, until the peer is failed or the transport ends (the receive then fails: no repost).
  void answer_probes(int peer) {
    auto op = std::make_unique<Op>();
    op->kind = Op::Kind::recv;
    op->peer = peer;
    op->tag = tags::kProbeTag;
    op->data = &probe_in_[peer];
    op->bytes = sizeof(uint64_t);
    op->standing = true;
    op->impl = this;
    op->done = [this, peer](const Status& status) {
      if (!status.ok()) return;
      auto answer = std::make_shared<uint64_t>(probe_in_[peer]);
      start_op(make_op(Op::Kind::send, peer, tags::kProbeAnswerTag, answer.get(),
                       [answer](const Status&) {}));
      answer_probes(peer);
    };
    start_op(std::move(op));
  }

  // A probe: its answer's receive, then the probe itself; `done` runs when the answer came (or
  // the receive failed). The bytes live as long as the callbacks that hold them.
  void probe_now(int peer, Callback done) {
    if (!dead_[peer].empty()) return done(Status::failure(dead_[peer], peer));
    if (shutting_down_) return done(Status::failure(kShutDown, peer));
    if (eps_[peer] == nullptr)
      return done(Status::failure("UcxTransport::probe: rank " + std::to_string(peer) +
                                      " is not connected (call connect() first)",
                                  peer));
    auto bytes = std::make_shared<std::array<uint64_t, 2>>();
    (*bytes)[1] = ++probes_sent_;
    start_op(make_op(Op::Kind::recv, peer, tags::kProbeAnswerTag, &(*bytes)[0],
                     [bytes, done = std::move(done)](const Status& status) { done(status); }));
    start_op(
        make_op(Op::Kind::send, peer, tags::kProbeTag, &(*bytes)[1], [bytes](const Status&) {}));
  }

  std::unique_ptr<Op> make_op(Op::Kind kind, int peer, Tag tag, void* data, Callback done) {
    auto op = std::make_unique<Op>();
    op->kind = kind;
    op->peer = peer;
    op->tag = tag;
    op->data = data;
    op->bytes = sizeof(uint64_t);
    op->done = std::move(done);
    op->impl = this;
    return op;
  }

  // What ucp_ep_print_info writes about an endpoint (UCX 1.13 has no query for its lanes or
  // protocols). UCX picks them per peer when the endpoint is created from the peer's address
  // (shared memory only where the peer's boot id and IPC namespace match ours), so it is final.
  static std::string print_info(ucp_ep_h ep) {
    char* text = nullptr;
    size_t size = 0;
    FILE* stream = ::open_memstream(&text, &size);
    if (stream == nullptr) return {};
    ucp_ep_print_info(ep, stream);
    std::fclose(stream);
    std::string info(text, size);
    std::free(text);
    return info;
  }

  // The protocols of ucp_tag_send_nbx by message size, from print_info's "tag_send:" line:
  // "0..<egr/short>..8185..<egr/zcopy>..(inf)" (no rendezvous), "unknown" when absent.
  static std::string tag_send_protocols(const std::string& info) {
    const std::string key = "tag_send:";
    const size_t at = info.find(key);
    if (at == std::string::npos) return "unknown";
    const size_t begin = info.find_first_not_of(' ', at + key.size());
    const size_t end = info.find('\n', at);
    return begin >= end ? "unknown" : info.substr(begin, end - begin);
  }

  // The UCX transports of an endpoint's lanes, from print_info: "posix/memory sysv/memory
  // cma/memory", "tcp/eth0", "self/memory".
  static std::string lanes_of(const std::string& info) {
    if (info.empty()) return "unknown";
    std::istringstream lines(info);
    std::vector<std::string> found;
    for (std::string line; std::getline(lines, line);) {
      const size_t lane = line.find("lane[");
      if (lane == std::string::npos) continue;
      // "lane[0]:  8:posix/memory.0 md[4] ..." -> "posix/memory"
      std::istringstream words(line.substr(line.find(':', lane) + 1));
      std::string word;
      words >> word;
      word = word.substr(word.find(':') + 1);
      word = word.substr(0, word.find('.'));
      if (!word.empty() && std::find(found.begin(), found.end(), word) == found.end())
        found.push_back(word);
    }
    std::string out;
    for (auto& w : found) out += (out.empty() ? "" : " ") + w;
    return out.empty() ? "unknown" : out;
  }

  void close_ep(int peer) {
    close_endpoint(std::exchange(eps_[peer], nullptr));
    close_endpoint(std::exchange(robust_eps_[peer], nullptr));
  }

  static void close_endpoint(ucp_ep_h ep) {
    if (ep == nullptr) return;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;  // never waits for the peer, which may be gone
    // A forced close completes at once; should UCX still return a request, it frees it when done.
    ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
    if (UCS_PTR_IS_PTR(request)) ucp_request_free(request);
  }

  // Cancels what can be cancelled, force-closes endpoints, then fails whatever is still pending
  // (a receive already matched to a dead sender never completes on its own).
  void abort_pending(const std::vector<int>& peers, const std::string& reason) {
    for (int peer : peers) {
      std::vector<Op*> ops(pending_[peer].begin(), pending_[peer].end());
      for (Op* op : ops) {
        if (op->kind == Op::Kind::recv && op->request != nullptr) {
          ucp_request_cancel(worker_, op->request);
        }
      }
      close_ep(peer);
    }
    ucp_worker_progress(worker_);
    process_completions();
    for (int peer : peers) {
      std::vector<Op*> ops(pending_[peer].begin(), pending_[peer].end());
      for (Op* op : ops) finish(op, Status::failure(reason, peer));
    }
  }

  void fail_peer_now(int peer, const std::string& reason) {
    if (!dead_[peer].empty()) return;
    dead_[peer] = reason.empty() ? "rank " + std::to_string(peer) + " failed" : reason;
    abort_pending({peer}, dead_[peer]);
  }

  void shut_down() {
    shutting_down_ = true;
    std::deque<Command> commands;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      commands.swap(queue_);
    }
    for (Command& command : commands) {
      if (command.op && command.op->done) {
        command.op->done(Status::failure(kShutDown, command.op->peer));
      }
    }
    std::vector<int> all(world_size_);
    for (int r = 0; r < world_size_; ++r) all[r] = r;
    abort_pending(all, kShutDown);
  }
};

UcxTransport::UcxTransport(int rank, int world_size, bool single_host)
    : UcxTransport(rank, world_size, std::make_unique<UcxWorker>(single_host, world_size)) {}

UcxTransport::UcxTransport(int rank, int world_size, std::unique_ptr<UcxWorker> worker) {
  if (!worker)
    throw Error("UcxTransport: no UcxWorker (expected one made by UcxWorker's constructor)");
  if (world_size < 1 || world_size > kMaxWorldSize) {
    throw Error("UcxTransport: world_size " + std::to_string(world_size) + " must be in [1, " +
                std::to_string(kMaxWorldSize) + "]");
  }
  if (rank < 0 || rank >= world_size) {
    throw Error("UcxTransport: rank " + std::to_string(rank) + " must be in [0, " +
                std::to_string(world_size) + ")");
  }
  impl_ = std::make_unique<Impl>(rank, world_size, progress_for(worker->single_host()));
  impl_->start(*worker->handles_);
}

UcxTransport::Progress UcxTransport::progress_for(bool single_host) {
  // One host: a reply or the caller's next operation usually comes within 0.5 ms, and past it
  // polling would only steal a core from compute. Across hosts (tcp): every message wakes the
  // thread anyway, and a thread that polls is a CPU hog to the scheduler, so on a busy machine it
  // waits behind every other runnable thread when its next event comes; sleeping at once, it is
  // woken ahead of them. UCX 1.13 does not signal every event on its fd (with a 100 ms timeout, a
  // fraction of a percent of shared-memory ping-pongs waited for it; over tcp a 10 ms timeout
  // halved a 1 Gbit/s allreduce), so with operations in flight the sleep is short, shorter across
  // hosts, where the thread no longer polls. A 64 MiB ring allreduce over 4 hosts at 1 Gbit/s under
  // load 13-34 ran at a median 0.59 of gloo's speed polling, 0.81 not polling with 1 ms sleeps, and
  // 0.96-0.97 in two rounds with 0.25 ms sleeps; recorded runs at load 13-18 gave 0.76 and 0.91
  // (docs/benchmarks-archive.md, "The progress thread across hosts"). At a light load the two are
  // within one run's noise.
  if (single_host) return Progress{std::chrono::microseconds(500), std::chrono::milliseconds(1)};
  return Progress{std::chrono::microseconds(0), std::chrono::microseconds(250)};
}

UcxTransport::~UcxTransport() = default;

std::string UcxTransport::local_address() const { return impl_->address_; }

void UcxTransport::connect(const std::vector<std::string>& addresses) {
  if (static_cast<int>(addresses.size()) != impl_->world_size_) {
    throw Error("UcxTransport::connect: got " + std::to_string(addresses.size()) +
                " addresses, expected world_size " + std::to_string(impl_->world_size_));
  }
  Impl* impl = impl_.get();
  impl_->call("UcxTransport::connect", "create the endpoints",
              [impl, addresses] { impl->connect_all(addresses); });
}

std::vector<std::string> UcxTransport::peer_transports() const {
  // Written once by connect() on the progress thread, which then handed its result over through
  // the promise: readable here without a lock.
  return impl_->paths_;
}

std::vector<std::string> UcxTransport::peer_protocols() const {
  return impl_->protocols_;  // as paths_
}

std::string UcxTransport::available_transports() {
  ucp_config_t* config = nullptr;
  check_ucx("ucp_config_read", ucp_config_read(nullptr, nullptr, &config));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG;
  ucp_context_h context = nullptr;
  ucs_status_t status = ucp_init(&params, config, &context);
  ucp_config_release(config);
  check_ucx("ucp_init", status);
  std::vector<std::string> names;
  try {
    names = resource_names(context);
  } catch (...) {
    ucp_cleanup(context);
    throw;
  }
  ucp_cleanup(context);
  std::string joined;
  for (const std::string& name : names) joined += (joined.empty() ? "" : ", ") + name;
  return joined;
}

std::string UcxTransport::version() { return ucp_get_version_string(); }

int UcxTransport::rank() const { return impl_->rank_; }

int UcxTransport::world_size() const { return impl_->world_size_; }

void UcxTransport::send(int peer, Tag tag, const void* data, size_t bytes, Callback done) {
  impl_->post(Op::Kind::send, peer, tag, const_cast<void*>(data), bytes, std::move(done));
}

void UcxTransport::recv(int peer, Tag tag, void* data, size_t bytes, Callback done) {
  impl_->post(Op::Kind::recv, peer, tag, data, bytes, std::move(done));
}

void UcxTransport::probe(int peer, Callback done) {
  if (peer < 0 || peer >= impl_->world_size_ || peer == impl_->rank_) {
    done(Status::failure("UcxTransport::probe: peer " + std::to_string(peer) +
                             " (expected another rank in [0, " +
                             std::to_string(impl_->world_size_) + "))",
                         peer));
    return;
  }
  Impl* impl = impl_.get();
  impl_->submit(Command{nullptr, [impl, peer, done = std::move(done)]() mutable {
                          impl->probe_now(peer, std::move(done));
                        }});
}

std::string UcxTransport::survive_peer_loss(uint32_t key_prefix) {
  const uint32_t module = key_prefix >> tags::kModuleShift & tags::kModuleMask;
  Impl* impl = impl_.get();
  return impl_->call("UcxTransport::survive_peer_loss", "make the endpoints",
                     [impl, module] { return impl->survive_peer_loss_now(module); });
}

void UcxTransport::fail_peer(int peer, const std::string& reason) {
  if (peer < 0 || peer >= impl_->world_size_) {
    throw Error("UcxTransport::fail_peer: peer " + std::to_string(peer) + " must be in [0, " +
                std::to_string(impl_->world_size_) + ")");
  }
  Impl* impl = impl_.get();
  impl_->submit(Command{nullptr, [impl, peer, reason] { impl->fail_peer_now(peer, reason); }});
}

}  // namespace troupe::comm
