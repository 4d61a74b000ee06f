#include "ddp/wrapped_modules.h"

#include <mutex>
#include <unordered_map>

#include "comm/status.h"

namespace troupe {

namespace {

struct Claim {
  const WrappedModule* owner;
  std::string wrapper;
  std::string module;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const void*, Claim> claims;  // by parameter TensorImpl
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: wrappers may outlive static teardown
  return *r;
}

}  // namespace

WrappedModule::WrappedModule(const torch::nn::Module* module, const std::string& wrapper) {
  if (!module) return;
  auto named = module->named_parameters(/*recurse=*/true);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& item : named) {
    const void* key = item.value().unsafeGetTensorImpl();
    auto found = r.claims.find(key);
    if (found != r.claims.end() && found->second.owner == this) continue;  // a tied parameter
    if (found != r.claims.end()) {
      for (const void* k : keys_) r.claims.erase(k);
      keys_.clear();
      throw comm::Error(wrapper + ": module " + module->name() + " (parameter '" + item.key() +
                        "') is already wrapped by a live " + found->second.wrapper + " of module " +
                        found->second.module +
                        " (expected one wrapper per module: destroy the first one before wrapping "
                        "the module again)");
    }
    r.claims.emplace(key, Claim{this, wrapper, module->name()});
    keys_.push_back(key);
  }
}

WrappedModule::~WrappedModule() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const void* k : keys_) r.claims.erase(k);
}

}  // namespace troupe
