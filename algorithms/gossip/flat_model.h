#pragma once
/// FlatModel (internal to algorithms/gossip): a module's float32 parameters moved into one flat
/// buffer, each parameter a view of its slice, so that weights are sent, snapshotted and mixed as
/// one array; plus the lock that orders the optimizer's step against background averaging.
///
/// The parameters may live on the CPU or on one CUDA device. The algorithms work on the weights
/// in host memory through host(): for a CPU model that is the flat buffer itself (pull() and
/// push() do nothing); for a CUDA model it is a pinned host mirror, which pull() fills from the
/// device and push() copies back (each a synchronous copy on the calling thread's current torch
/// stream) — the "host staging" path. D-PSGD over NCCL (nccl_gossip.h) works on tensor() instead.
///
/// A parameter stays a view of the flat buffer only as long as nobody replaces its storage:
/// torch::load (which set_()s every parameter), `p.set_data(...)` or `module->to(...)` after
/// construction leave the buffer behind. reattach() finds such parameters (one data pointer
/// compared per parameter) and brings them back.
#include <torch/nn/module.h>
#include <torch/types.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rank/runtime.h"

namespace troupe::gossip {

/// Asks the Runtime's transport to carry the messages of the module with `key_prefix` so that a
/// neighbour's death cannot silence the others (comm::Transport::survive_peer_loss): a gossip
/// module goes on without its dead neighbours. Where the transport cannot, rank 0 warns on stderr,
/// naming `what` and the reason.
void survive_peer_loss(Runtime& runtime, uint32_t key_prefix, const std::string& what);

class FlatModel {
 public:
  /// A collective: checks that every rank has the same parameters (names, shapes; all float32,
  /// else an error naming the parameter and its dtype) on the same kind of device (all on the CPU
  /// or all on one CUDA device, else an error naming the parameter and its device), flattens them
  /// and copies rank 0's values to every rank (unless `broadcast` is false). `what` names the
  /// algorithm in error messages.
  FlatModel(Runtime& runtime, std::shared_ptr<torch::nn::Module> module, std::string what,
            bool broadcast = true);

  size_t count() const { return static_cast<size_t>(flat_.numel()); }
  /// The flat weights, on the parameters' device.
  const torch::Tensor& tensor() const { return flat_; }
  bool on_cuda() const { return flat_.is_cuda(); }
  /// The CUDA device of the parameters; -1 on the CPU.
  int device() const { return on_cuda() ? flat_.get_device() : -1; }

  /// The weights in host memory (count() floats): see the class comment. Whoever changes them
  /// holds mutex() from pull() to push().
  float* host() { return host_; }
  /// host() := the weights (CUDA: device to host copy; CPU: nothing).
  void pull();
  /// The weights := host() (CUDA: host to device copy; CPU: nothing).
  void push();

  /// Held by whoever changes the weights: the optimizer step and the background actors.
  std::mutex& mutex() { return mutex_; }
  /// The gradients of the parameters, copied into `out` (count() floats in host memory; zeros
  /// where none).
  void gradients(float* out) const;
  /// Copies `in` (host memory) into the gradients (allocating those that are undefined).
  void set_gradients(const float* in);
  /// Every parameter whose storage is no longer its slice of the flat buffer (see the class
  /// comment): its values are copied into the slice and it becomes a view of the slice again.
  /// Returns whether there was one. Throws comm::Error naming a parameter whose shape, dtype or
  /// device is no longer the one it had at construction (its storage is then left as it is).
  /// Call it on the trainer's thread, between iterations, holding mutex().
  bool reattach();
  const std::string& what() const { return what_; }

 private:
  std::string what_;
  std::vector<torch::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<int64_t> offsets_;
  torch::Tensor flat_;
  torch::Tensor mirror_;  // CUDA models: the pinned host mirror
  float* host_ = nullptr;
  std::mutex mutex_;
};

}  // namespace troupe::gossip
