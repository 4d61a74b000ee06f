#pragma once
/// How a model reaches troupe's wrappers. They keep a shared_ptr to the module (the module must
/// outlive the gradient hooks they install), so they take what LibTorch programs hold a model in:
///   - `auto net = std::make_shared<Net>();`           a shared_ptr (any Module subclass);
///   - `Net net;` where TORCH_MODULE(Net) names NetImpl  a ModuleHolder, shared by value;
///   - `torch::nn::Linear net(4, 2);`, `torch::nn::Sequential net(...)`  LibTorch's holders.
/// A Module subclass kept by value (`struct Net : torch::nn::Module {...}; Net net;`) cannot be
/// shared: nothing keeps it alive past its scope, and copying it would train the copy. Passing one
/// fails to compile with a message saying so; declare the class as NetImpl with TORCH_MODULE(Net),
/// or create it with std::make_shared. Each wrapper takes a ModelRef, which accepts the first two
/// and refuses the third.
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>
#include <type_traits>

#include "comm/status.h"

namespace troupe {

/// True for a Module subclass passed by reference: what the wrappers refuse at compile time.
template <typename M>
constexpr bool is_module_by_value = std::is_base_of_v<torch::nn::Module, std::decay_t<M>>;

/// The compile-time refusal of a module by value (see above): the wrappers' constructors for a
/// Module& delegate to their shared_ptr constructor with this, which does not compile.
template <typename M>
std::shared_ptr<torch::nn::Module> refused_module_by_value() {
  static_assert(!is_module_by_value<M>,
                "troupe keeps a shared_ptr to the module, so a Module subclass held by value "
                "cannot be wrapped: create it with std::make_shared<Net>(), or declare it as "
                "NetImpl with TORCH_MODULE(Net) and pass the holder");
  return nullptr;
}

/// A model as a wrapper's constructor takes it: a shared_ptr to any Module subclass, or a
/// ModuleHolder (shared); a Module subclass by value does not compile (see above).
class ModelRef {
 public:
  template <typename T, typename = std::enable_if_t<std::is_base_of_v<torch::nn::Module, T>>>
  ModelRef(std::shared_ptr<T> module) : module_(std::move(module)) {}
  ModelRef(std::nullptr_t) {}
  template <typename Contained>
  ModelRef(const torch::nn::ModuleHolder<Contained>& holder)
      : module_(holder.is_empty() ? nullptr : holder.ptr()), empty_holder_(holder.is_empty()) {}
  template <typename M, typename = std::enable_if_t<is_module_by_value<M>>>
  ModelRef(M&) : module_(refused_module_by_value<M>()) {}

  /// The module, for the wrapper named `who` (null when it was given a null shared_ptr). Throws
  /// comm::Error naming `who` for an empty holder (constructed from nullptr).
  std::shared_ptr<torch::nn::Module> get(const char* who) const {
    if (empty_holder_)
      throw comm::Error(std::string(who) +
                        ": the module holder is empty (constructed from nullptr); expected a "
                        "constructed module");
    return module_;
  }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  bool empty_holder_ = false;
};

}  // namespace troupe
