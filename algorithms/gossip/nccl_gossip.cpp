#include "algorithms/gossip/nccl_gossip.h"

#include <future>

#include "comm/status.h"

#ifdef TROUPE_HAVE_NCCL
#include "comm/transport/nccl/communicator.h"
#include "cuda/stream.h"
#include "rank/torch_stream.h"
#endif

namespace troupe::gossip {

#ifdef TROUPE_HAVE_NCCL

struct NcclGossip::State {
  int device = -1;
  // The buffers outlive the communicator (destroyed first, in ~NcclGossip): an operation still in
  // flight when the module goes away keeps writing into them until its deadline.
  torch::Tensor send;
  std::vector<torch::Tensor> recv;
  void* ready = nullptr;  // recorded on torch's stream once `send` holds the weights
  std::unique_ptr<comm::NcclCommunicator> comm;
  std::future<comm::Status> pending;
  std::string what;
  size_t bytes_sent = 0;
  size_t bytes_received = 0;
};

NcclGossip::NcclGossip(Runtime& runtime, int device, std::chrono::milliseconds timeout)
    : state_(std::make_unique<State>()) {
  state_->device = device;
  state_->comm = runtime.nccl(device)->split(timeout);
  state_->comm->set_timeout(timeout);
  cuda::DeviceGuard guard(device);
  state_->ready = cuda::create_event();
}

NcclGossip::~NcclGossip() {
  state_->comm.reset();  // waits for the round in flight, up to its deadline
  cuda::DeviceGuard guard(state_->device);
  cuda::destroy_event(state_->ready);
}

bool NcclGossip::in_flight() const { return state_->pending.valid(); }

void NcclGossip::start(const torch::Tensor& weights, const std::vector<int>& send_to,
                       const std::vector<int>& recv_from, const std::string& what) {
  auto& s = *state_;
  if (in_flight())
    throw comm::Error(what + ": started while " + s.what + " is still in flight over NCCL");
  if (!weights.is_cuda() || weights.get_device() != s.device ||
      weights.scalar_type() != torch::kFloat32 || !weights.is_contiguous())
    throw comm::Error(what + ": weights on " + weights.device().str() + " of type " +
                      std::string(c10::toString(weights.scalar_type())) +
                      ", expected contiguous float32 on cuda:" + std::to_string(s.device));
  torch::NoGradGuard no_grad;
  cuda::DeviceGuard guard(s.device);
  if (!s.send.defined() || s.send.numel() != weights.numel()) s.send = torch::empty_like(weights);
  s.send.copy_(weights);  // on torch's current stream, after the optimizer's step
  s.recv.resize(recv_from.size());
  std::vector<void*> targets;
  for (auto& r : s.recv) {
    if (!r.defined() || r.numel() != weights.numel()) r = torch::empty_like(weights);
    targets.push_back(r.data_ptr());
  }
  cuda::record_event(s.ready, torch_current_stream(s.device));
  auto promise = std::make_shared<std::promise<comm::Status>>();
  s.pending = promise->get_future();
  s.what = what;
  const size_t count = static_cast<size_t>(weights.numel());
  s.bytes_sent = count * sizeof(float) * send_to.size();
  s.bytes_received = count * sizeof(float) * recv_from.size();
  try {
    s.comm->exchange(s.send.data_ptr(), count, comm::DataType::float32, send_to, recv_from, targets,
                     {s.ready},
                     [promise](const comm::Status& status) { promise->set_value(status); });
  } catch (...) {
    s.pending = {};
    throw;
  }
}

NcclGossip::Outcome NcclGossip::wait(std::chrono::steady_clock::time_point deadline) {
  auto& s = *state_;
  if (!in_flight()) throw comm::Error("NCCL gossip: wait() with no round in flight");
  // The operation fails at its own deadline; the slack covers the communicator thread's last poll.
  if (s.pending.wait_until(deadline + std::chrono::seconds(5)) != std::future_status::ready) {
    s.comm->abort(s.what + ": no completion before the deadline");
    // The abort fails the operation at once; its callback ends the wait.
    if (s.pending.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      s.pending = {};
      throw comm::Error(s.what + " over NCCL: did not complete, nor fail after an abort");
    }
  }
  const comm::Status status = s.pending.get();
  if (!status.ok()) throw comm::Error(s.what + " over NCCL: " + status.message());
  return Outcome{s.bytes_sent, s.bytes_received};
}

const torch::Tensor& NcclGossip::sent() const { return state_->send; }
const torch::Tensor& NcclGossip::received(size_t i) const { return state_->recv.at(i); }

void NcclGossip::abort(const std::string& reason) { state_->comm->abort(reason); }

#else  // !TROUPE_HAVE_NCCL

struct NcclGossip::State {
  torch::Tensor none;
};

NcclGossip::NcclGossip(Runtime&, int device, std::chrono::milliseconds) {
  throw comm::Error("NCCL gossip on cuda:" + std::to_string(device) +
                    ": troupe was built without NCCL (expected a troupe built where CMake finds "
                    "CUDA and NCCL, or GossipOptions::stage_through_host)");
}
NcclGossip::~NcclGossip() = default;
bool NcclGossip::in_flight() const { return false; }
void NcclGossip::start(const torch::Tensor&, const std::vector<int>&, const std::vector<int>&,
                       const std::string&) {}
NcclGossip::Outcome NcclGossip::wait(std::chrono::steady_clock::time_point) { return {}; }
const torch::Tensor& NcclGossip::sent() const { return state_->none; }
const torch::Tensor& NcclGossip::received(size_t) const { return state_->none; }
void NcclGossip::abort(const std::string&) {}

#endif

}  // namespace troupe::gossip
