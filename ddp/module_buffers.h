#pragma once
/// ModuleBuffers: a module's buffers (BatchNorm's running statistics, num_batches_tracked, any
/// registered buffer) copied from one rank to every rank with one flat broadcast per dtype
/// (internal to runtime/; DdpOptions::broadcast_buffers). The flat host tensors are allocated
/// once; CUDA buffers travel through them (pinned), as the transport moves host memory.
#include <torch/nn/module.h>

#include <cstdint>
#include <vector>

#include "comm/collectives/communicator.h"

namespace troupe {

class ModuleBuffers {
 public:
  explicit ModuleBuffers(torch::nn::Module& module);
  /// Nothing to send: the module has no buffer (then broadcast is never a collective).
  bool empty() const { return groups_.empty(); }
  /// A collective: every rank's buffers become `root`'s.
  void broadcast(comm::Communicator& comm, int root);

 private:
  struct Group {  // the buffers of one dtype
    comm::DataType type = comm::DataType::float32;
    torch::Tensor flat;
    std::vector<torch::Tensor> buffers;
    std::vector<int64_t> offsets;  // of each buffer in flat, in elements
  };
  std::vector<Group> groups_;
};

}  // namespace troupe
