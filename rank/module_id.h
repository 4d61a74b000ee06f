#pragma once
/// ModuleId: a module's number in its Runtime, taken when the module is built and given back when
/// it is destroyed, so a Runtime may create and destroy any number of modules over its life (at
/// most comm::tags::kMaxModules alive at once). The number sits in the top bits of the module's
/// message keys (comm/tags.h); every rank gets the same one when every rank creates and destroys
/// its modules in the same order.
///
/// Declare it before anything that sends messages under its keys (actors, links): members are
/// destroyed in reverse order, so the id is given back only after they are gone.
#include <cstdint>

#include "comm/tags.h"
#include "rank/runtime.h"

namespace troupe {

class ModuleId {
 public:
  explicit ModuleId(Runtime& runtime) : runtime_(runtime), id_(runtime.next_module_id()) {}
  ~ModuleId() { runtime_.release_module_id(id_); }
  ModuleId(const ModuleId&) = delete;
  ModuleId& operator=(const ModuleId&) = delete;

  int value() const { return id_; }
  /// The key bits of this module's messages.
  uint32_t key_prefix() const { return comm::tags::module_prefix(id_); }

 private:
  Runtime& runtime_;
  int id_;
};

}  // namespace troupe
