// The thread that owns an NCCL communicator and its stream (engine.h): it issues the queued
// operations in order, polls their completion events and the communicator's asynchronous error,
// enforces deadlines, aborts, and tears down.
#include "comm/transport/nccl/engine.h"

#include <algorithm>

#include "comm/timeout_setting.h"
#include "cuda/stream.h"

namespace troupe::comm {

namespace {

constexpr auto kFirstPause = std::chrono::microseconds(10);
constexpr auto kLongestPause = std::chrono::microseconds(500);

std::string ms(std::chrono::milliseconds t) { return std::to_string(t.count()) + " ms"; }

}  // namespace

std::string nccl_error(ncclResult_t result, ncclComm_t comm) {
  std::string text = nccl_library().GetErrorString(result);
  const char* last = nccl_library().GetLastError(comm);
  if (last != nullptr && *last != '\0') text += " (" + std::string(last) + ")";
  return text;
}

std::string nccl_wait_ready(ncclComm_t comm, std::chrono::steady_clock::time_point deadline) {
  auto pause = std::chrono::microseconds(50);
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t call = nccl_library().CommGetAsyncError(comm, &state);
    if (call != ncclSuccess) return nccl_error(call, comm);
    if (state == ncclSuccess) return "";
    if (state != ncclInProgress) return nccl_error(state, comm);
    if (std::chrono::steady_clock::now() >= deadline) return "timeout";
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(10));
  }
}

NcclCommunicator::Impl::Impl(int r, int w, int d, std::chrono::milliseconds timeout,
                             ncclComm_t comm)
    : rank(r), world(w), device(d), timeout_ms(timeout.count()), comm_(comm) {
  try {
    cuda::DeviceGuard guard(device);
    stream = static_cast<cudaStream_t>(cuda::create_stream());
  } catch (...) {
    nccl_library().CommAbort(comm_);
    throw;
  }
  thread_ = std::thread([this] { loop(); });
}

NcclCommunicator::Impl::~Impl() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

std::string NcclCommunicator::Impl::who() const {
  return "rank " + std::to_string(rank) + " of " + std::to_string(world) + " on device " +
         std::to_string(device);
}

void NcclCommunicator::Impl::submit(NcclOperation op) {
  if (op.timeout.count() <= 0) op.timeout = std::chrono::milliseconds(timeout_ms.load());
  op.deadline = std::chrono::steady_clock::now() + op.timeout;
  std::string refused;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stop_) {
      refused = "NCCL " + op.name + ": the communicator (" + who() + ") is being destroyed";
    } else if (!broken_.empty()) {
      refused = "NCCL " + op.name + ": " + broken_;
    } else {
      queue_.push_back(std::move(op));
    }
  }
  if (refused.empty()) {
    wake_.notify_all();
    return;
  }
  if (op.done) op.done(Status::failure(refused));
}

void NcclCommunicator::Impl::request_abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (abort_request_.empty()) abort_request_ = reason.empty() ? "aborted" : reason;
  }
  wake_.notify_all();
}

bool NcclCommunicator::Impl::idle() const {
  return todo_.empty() && !enqueuing_ && in_flight_.empty();
}

void NcclCommunicator::Impl::loop() {
  cudaSetDevice(device);
  auto pause = kFirstPause;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    if (idle())
      wake_.wait(lock, [&] { return stop_ || !queue_.empty() || !abort_request_.empty(); });
    for (auto& op : queue_) todo_.push_back(std::move(op));
    queue_.clear();
    const std::string request = std::move(abort_request_);
    abort_request_.clear();
    const bool stopping = stop_;
    lock.unlock();

    if (!request.empty()) fail_all(request);
    if (stopping)
      for (auto& op : todo_)
        complete(op, Status::failure("NCCL " + op.name + ": the communicator (" + who() +
                                     ") was destroyed before the operation started"));
    if (stopping) todo_.clear();
    const bool progressed = advance();
    if (stopping && idle()) {
      teardown();
      return;
    }
    pause =
        progressed ? kFirstPause : std::min<std::chrono::microseconds>(pause * 2, kLongestPause);
    lock.lock();
    if (!idle())
      wake_.wait_for(lock, pause, [&] { return !queue_.empty() || !abort_request_.empty(); });
  }
}

// Moves every operation one step on; true when one did.
bool NcclCommunicator::Impl::advance() {
  if (comm_ == nullptr) {
    // Broken: what was queued before it broke fails with the reason.
    if (todo_.empty()) return false;
    std::string broken;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      broken = broken_;
    }
    for (auto& op : todo_) complete(op, Status::failure("NCCL " + op.name + ": " + broken));
    todo_.clear();
    return true;
  }
  bool progressed = false;
  const auto now = std::chrono::steady_clock::now();
  if (enqueuing_) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t call = nccl_library().CommGetAsyncError(comm_, &state);
    if (call != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
      fail_all("NCCL " + enqueuing_->name + " failed on " + who() + ": " +
               nccl_error(call != ncclSuccess ? call : state, comm_));
      return true;
    }
    if (state == ncclInProgress) {
      if (now >= enqueuing_->deadline)
        fail_all("NCCL " + enqueuing_->name + " on " + who() + " was not enqueued within " +
                 ms(enqueuing_->timeout) +
                 " (did every rank issue it?); the communicator was "
                 "aborted" +
                 kTimeoutSetting);
      return false;
    }
    NcclOperation op = std::move(*enqueuing_);
    enqueuing_.reset();
    issued(std::move(op));
    progressed = true;
  }
  while (comm_ != nullptr && !enqueuing_ && !todo_.empty()) {
    issue_next();
    progressed = true;
  }
  for (size_t i = 0; comm_ != nullptr && i < in_flight_.size();) {
    auto& op = in_flight_[i];
    const cudaError_t query = cudaEventQuery(op.event);
    if (query == cudaErrorNotReady) {
      if (now >= op.deadline) {
        fail_all("NCCL " + op.name + " on " + who() + " did not complete within " + ms(op.timeout) +
                 "; the communicator was aborted" + kTimeoutSetting);
        return true;
      }
      ++i;
      continue;
    }
    if (query != cudaSuccess) {
      cudaGetLastError();
      fail_all("NCCL " + op.name + " on " + who() + ": CUDA reports " + cudaGetErrorName(query) +
               ": " + cudaGetErrorString(query));
      return true;
    }
    NcclOperation done = std::move(op);
    in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(i));
    spare_events_.push_back(done.event);
    complete(done, Status::success());
    progressed = true;
  }
  if (comm_ != nullptr && !in_flight_.empty()) {
    // A peer that died or a network failure shows here, not in the events (they would never
    // complete).
    ncclResult_t state = ncclSuccess;
    const ncclResult_t call = nccl_library().CommGetAsyncError(comm_, &state);
    if (call != ncclSuccess || (state != ncclSuccess && state != ncclInProgress))
      fail_all("NCCL " + in_flight_.front().name + " on " + who() +
               " failed: " + nccl_error(call != ncclSuccess ? call : state, comm_));
  }
  return progressed;
}

void NcclCommunicator::Impl::issue_next() {
  NcclOperation op = std::move(todo_.front());
  todo_.pop_front();
  if (!op.issue) {
    complete(op, Status::success());
    return;
  }
  for (void* event : op.ready) {
    const cudaError_t status = cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(event), 0);
    if (status != cudaSuccess) {
      cudaGetLastError();
      const std::string why =
          "NCCL " + op.name + " on " + who() +
          ": cudaStreamWaitEvent on a ready event failed: " + cudaGetErrorString(status);
      complete(op, Status::failure(why));
      fail_all(why);
      return;
    }
  }
  const ncclResult_t result = op.issue(comm_, stream);
  if (result == ncclSuccess) {
    issued(std::move(op));
  } else if (result == ncclInProgress) {
    enqueuing_ = std::move(op);
  } else {
    const std::string why =
        "NCCL " + op.name + " failed on " + who() + ": " + nccl_error(result, comm_);
    complete(op, Status::failure(why));
    fail_all(why);
  }
}

// The operation's calls are on the stream: run its follow-up and record its completion event.
void NcclCommunicator::Impl::issued(NcclOperation op) {
  try {
    if (op.after) op.after(comm_, stream);
    if (!op.record) {
      complete(op, Status::success());
      return;
    }
    if (spare_events_.empty()) {
      cudaEvent_t event = nullptr;
      const cudaError_t status = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
      if (status != cudaSuccess)
        throw std::runtime_error(std::string("cudaEventCreateWithFlags failed: ") +
                                 cudaGetErrorString(status));
      spare_events_.push_back(event);
    }
    op.event = spare_events_.back();
    const cudaError_t status = cudaEventRecord(op.event, stream);
    if (status != cudaSuccess)
      throw std::runtime_error(std::string("cudaEventRecord failed: ") +
                               cudaGetErrorString(status));
    spare_events_.pop_back();
    in_flight_.push_back(std::move(op));
  } catch (const std::exception& e) {
    cudaGetLastError();
    const std::string why = "NCCL " + op.name + " on " + who() + ": " + e.what();
    complete(op, Status::failure(why));
    fail_all(why);
  }
}

void NcclCommunicator::Impl::complete(NcclOperation& op, const Status& status) {
  if (!op.done) return;
  auto done = std::move(op.done);
  op.done = nullptr;
  done(status);
}

void NcclCommunicator::Impl::fail_all(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!broken_.empty()) return;
    broken_ = "the NCCL communicator (" + who() + ") was aborted: " + reason;
  }
  aborted = true;
  if (comm_ != nullptr) nccl_library().CommAbort(comm_);
  comm_ = nullptr;
  std::string broken;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    broken = broken_;
  }
  const Status failure = Status::failure(broken);
  if (enqueuing_) complete(*enqueuing_, failure);
  enqueuing_.reset();
  for (auto& op : in_flight_) {
    spare_events_.push_back(op.event);
    complete(op, failure);
  }
  in_flight_.clear();
  for (auto& op : todo_) complete(op, failure);
  todo_.clear();
}

void NcclCommunicator::Impl::teardown() {
  if (comm_ != nullptr) {
    // Flush and free the communicator; abort it when that does not end in time (a peer gone).
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms.load());
    const ncclResult_t result = nccl_library().CommFinalize(comm_);
    const bool finalized = (result == ncclSuccess || result == ncclInProgress) &&
                           nccl_wait_ready(comm_, deadline).empty();
    if (finalized)
      nccl_library().CommDestroy(comm_);
    else
      nccl_library().CommAbort(comm_);
    comm_ = nullptr;
  }
  for (cudaEvent_t event : spare_events_) cudaEventDestroy(event);
  spare_events_.clear();
  cuda::destroy_stream(stream);
  stream = nullptr;
}

}  // namespace troupe::comm
