#pragma once
/// WrappedModule: the claim a data-parallel wrapper (DistributedModule, DecentralizedModule,
/// AsynchronousModule) holds on its module's parameters while it lives, so that a second wrapper
/// of the same module — or of a module sharing a parameter with it, such as a submodule — is
/// refused instead of training silently wrong (two sets of hooks, or gossip re-pointing the
/// storage under the buckets). Claims are process-wide and keyed by the parameters' TensorImpl,
/// so thread ranks that each wrap their own module object never collide.
#include <torch/nn/module.h>

#include <string>
#include <vector>

namespace troupe {

class WrappedModule {
 public:
  /// Claims every parameter of `module` for `wrapper` ("DistributedModule", ...). Throws
  /// comm::Error naming the module, its first claimed parameter and the live wrapper that holds
  /// it; claims nothing then. A null module claims nothing (the wrapper reports it).
  WrappedModule(const torch::nn::Module* module, const std::string& wrapper);
  /// Releases the claim: a new wrapper may then take the module.
  ~WrappedModule();
  WrappedModule(const WrappedModule&) = delete;
  WrappedModule& operator=(const WrappedModule&) = delete;

 private:
  std::vector<const void*> keys_;
};

}  // namespace troupe
