#pragma once
/// Data-parallel training of one torch::nn::Module with gradient buckets: DistributedModule and
/// DdpOptions, and the modules it accepts (ModuleHolders and shared_ptrs).
#include "runtime/distributed_module.h"
#include "runtime/module_holder.h"
