// NcclCommunicator: creation (non-blocking init with a deadline), split, abort and the accessors.
// The thread behind it is in engine.cpp, the operations in operation.cpp.
#include "comm/transport/nccl/communicator.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include "comm/transport/nccl/engine.h"
#include "cuda/stream.h"

namespace troupe::comm {

namespace {

std::string ms(std::chrono::milliseconds t) { return std::to_string(t.count()) + " ms"; }

// 22803 -> "2.28.3" (NCCL >= 2.9 numbers its versions major * 10000 + minor * 100 + patch).
std::string version_text(int code) {
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." +
         std::to_string(code % 100);
}

void check_version() {
  const std::string why = NcclCommunicator::version_mismatch(NcclCommunicator::compiled_version(),
                                                             NcclCommunicator::loaded_version());
  if (!why.empty()) throw Error(why);
}

}  // namespace

int NcclCommunicator::compiled_version() { return NCCL_VERSION_CODE; }

int NcclCommunicator::loaded_version() {
  int version = 0;
  const ncclResult_t result = nccl_library().GetVersion(&version);
  if (result != ncclSuccess) throw Error("ncclGetVersion failed: " + nccl_error(result));
  return version;
}

std::string NcclCommunicator::version_mismatch(int compiled, int loaded) {
  if (loaded >= compiled) return "";
  return "this process loaded NCCL " + version_text(loaded) + ", older than the NCCL " +
         version_text(compiled) +
         " troupe was compiled against (expected the same or newer; one libnccl.so.2 per process, "
         "often torch's: build troupe against the NCCL that torch loads, or put the newer one "
         "first on LD_LIBRARY_PATH)";
}

std::string NcclCommunicator::unique_id() {
  check_version();
  ncclUniqueId id;
  const ncclResult_t result = nccl_library().GetUniqueId(&id);
  if (result != ncclSuccess) throw Error("ncclGetUniqueId failed: " + nccl_error(result));
  return std::string(id.internal, sizeof(id.internal));
}

NcclCommunicator::NcclCommunicator(int rank, int world_size, const std::string& unique_id,
                                   int device, std::chrono::milliseconds timeout) {
  if (world_size < 1)
    throw Error("NcclCommunicator: world size " + std::to_string(world_size) + " (expected >= 1)");
  if (rank < 0 || rank >= world_size)
    throw Error("NcclCommunicator: rank " + std::to_string(rank) + " (expected 0 <= rank < " +
                std::to_string(world_size) + ")");
  if (unique_id.size() != kUniqueIdBytes)
    throw Error("NcclCommunicator: unique id of " + std::to_string(unique_id.size()) +
                " bytes (expected " + std::to_string(kUniqueIdBytes) +
                ", from NcclCommunicator::unique_id() on one rank)");
  if (timeout.count() <= 0)
    throw Error("NcclCommunicator: timeout " + ms(timeout) + " (expected > 0)");
  check_version();
  const int devices = cuda::device_count();
  if (device < 0 || device >= devices)
    throw Error("NcclCommunicator: device " + std::to_string(device) + " (expected 0 <= device < " +
                std::to_string(devices) + ", the CUDA devices this process sees)");

  cuda::DeviceGuard guard(device);
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), kUniqueIdBytes);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const ncclResult_t result =
      nccl_library().CommInitRankConfig(&comm, world_size, id, rank, &config);
  std::string error;
  if (result != ncclSuccess && result != ncclInProgress)
    error = nccl_error(result, comm);
  else
    error = nccl_wait_ready(comm, deadline);
  const std::string where = "rank " + std::to_string(rank) + " of " + std::to_string(world_size) +
                            " on device " + std::to_string(device);
  if (!error.empty()) {
    if (comm != nullptr) nccl_library().CommAbort(comm);
    if (error == "timeout")
      throw Error("NCCL communicator of " + where + " was not ready within " + ms(timeout) +
                  " (does every rank create it, with the same unique id and world size?)");
    throw Error("NCCL communicator of " + where + " could not be created: " + error);
  }
  impl_ = std::make_unique<Impl>(rank, world_size, device, timeout, comm);
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

NcclCommunicator::~NcclCommunicator() = default;

int NcclCommunicator::rank() const { return impl_->rank; }
int NcclCommunicator::world_size() const { return impl_->world; }
int NcclCommunicator::device() const { return impl_->device; }
void* NcclCommunicator::stream() const { return impl_->stream; }
std::chrono::milliseconds NcclCommunicator::timeout() const {
  return std::chrono::milliseconds(impl_->timeout_ms.load());
}
void NcclCommunicator::set_timeout(std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0)
    throw Error("NcclCommunicator::set_timeout: " + ms(timeout) + " (expected > 0)");
  impl_->timeout_ms = timeout.count();
}
bool NcclCommunicator::aborted() const { return impl_->aborted.load(); }

void NcclCommunicator::abort(const std::string& reason) { impl_->request_abort(reason); }

std::unique_ptr<NcclCommunicator> NcclCommunicator::split(std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0)
    throw Error("NcclCommunicator::split: timeout " + ms(timeout) + " (expected > 0)");
  struct Result {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    ncclComm_t child = nullptr;
    std::promise<Status> status;
  };
  auto result = std::make_shared<Result>();
  result->config.blocking = 0;
  auto future = result->status.get_future();
  NcclOperation op;
  op.name = "split";
  op.record = false;
  op.timeout = timeout;
  const int key = impl_->rank;
  op.issue = [result, key](ncclComm_t comm, cudaStream_t) {
    return nccl_library().CommSplit(comm, 0, key, &result->child, &result->config);
  };
  op.done = [result](const Status& s) { result->status.set_value(s); };
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  impl_->submit(std::move(op));
  // The operation fails by its own deadline; the slack covers the thread's last round.
  if (future.wait_until(deadline + std::chrono::seconds(5)) != std::future_status::ready)
    throw Error("NCCL split on " + impl_->who() + " did not answer within " + ms(timeout));
  const Status status = future.get();
  if (!status.ok()) {
    if (result->child != nullptr) nccl_library().CommAbort(result->child);
    throw Error(status.message());
  }
  // NCCL fills in the child's handle only once the parent has left ncclInProgress (NCCL 2.23 on,
  // NVIDIA/nccl#1472; PyTorch waits the same way, pytorch#137741), and from its own thread: the
  // parent's operation may complete here a moment before the handle appears. A null handle is
  // waited for under the split's deadline, never handed to NCCL ("comm argument is NULL").
  ncclComm_t child = nullptr;
  for (auto pause = std::chrono::microseconds(50);
       (child = std::atomic_ref<ncclComm_t>(result->child).load()) == nullptr;
       pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(10))) {
    if (std::chrono::steady_clock::now() >= deadline)
      throw Error("NCCL split on " + impl_->who() +
                  ": the parent completed the split but no new "
                  "communicator appeared within " +
                  ms(timeout));
    std::this_thread::sleep_for(pause);
  }
  cuda::DeviceGuard guard(impl_->device);
  const std::string error = nccl_wait_ready(child, deadline);
  if (!error.empty()) {
    nccl_library().CommAbort(child);
    throw Error("NCCL split on " + impl_->who() + ": the new communicator " +
                (error == "timeout" ? "was not ready within " + ms(timeout) : "failed: " + error));
  }
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(
      std::make_unique<Impl>(impl_->rank, impl_->world, impl_->device, this->timeout(), child)));
}

}  // namespace troupe::comm
