#include "ddp/module_buffers.h"

#include <torch/torch.h>

#include <algorithm>

#include "rank/model_check.h"

namespace troupe {

ModuleBuffers::ModuleBuffers(torch::nn::Module& module) {
  bool on_cuda = false;
  for (auto& item : module.named_buffers(/*recurse=*/true)) {
    const auto& b = item.value();
    if (!b.defined() || b.numel() == 0) continue;
    const auto type = comm_type(b.scalar_type(), "buffer '" + item.key() + "'");
    auto group = std::find_if(groups_.begin(), groups_.end(),
                              [&](const Group& g) { return g.type == type; });
    if (group == groups_.end()) {
      groups_.emplace_back();
      group = groups_.end() - 1;
      group->type = type;
    }
    group->offsets.push_back(
        group->buffers.empty() ? 0 : group->offsets.back() + group->buffers.back().numel());
    group->buffers.push_back(b);
    on_cuda = on_cuda || b.is_cuda();
  }
  for (auto& g : groups_) {
    const int64_t total = g.offsets.back() + g.buffers.back().numel();
    g.flat = torch::empty(
        {total}, torch::TensorOptions().dtype(g.buffers[0].scalar_type()).pinned_memory(on_cuda));
  }
}

void ModuleBuffers::broadcast(comm::Communicator& comm, int root) {
  torch::NoGradGuard no_grad;
  const bool sending = comm.rank() == root;
  for (auto& g : groups_) {
    if (sending)
      for (size_t k = 0; k < g.buffers.size(); ++k)
        g.flat.narrow(0, g.offsets[k], g.buffers[k].numel()).copy_(g.buffers[k].reshape({-1}));
    comm.broadcast(g.flat.data_ptr(), static_cast<size_t>(g.flat.numel()), g.type, root);
    if (!sending)
      for (size_t k = 0; k < g.buffers.size(); ++k)
        g.buffers[k].copy_(
            g.flat.narrow(0, g.offsets[k], g.buffers[k].numel()).view(g.buffers[k].sizes()));
  }
}

}  // namespace troupe
