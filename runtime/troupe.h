#pragma once
/// troupe's API in one include, inside the source tree: `#include "runtime/troupe.h"`. An
/// installed troupe's users include <troupe/troupe.h> (include/troupe/: the curated public headers,
/// which bring the same classes).
///
/// ```cpp
/// #include <torch/torch.h>
/// #include "runtime/troupe.h"
///
/// troupe::Runtime rt;                          // rank from torchrun / troupe launch / mpirun /
/// srun Net net;                                     // TORCH_MODULE(Net), or
/// std::make_shared<NetImpl>() troupe::DistributedModule ddp(rt, net);      //
/// runtime/module_holder.h: what it accepts
/// // Each rank reads its own shard: LibTorch's distributed samplers (<torch/data.h>, declared in
/// // torch/data/samplers/distributed.h), given the world size and this rank.
/// for (size_t epoch = 0; epoch < epochs; ++epoch) {
///   torch::data::samplers::DistributedRandomSampler sampler(dataset.size().value(),
///                                                           rt.world_size(), rt.rank());
///   sampler.set_epoch(epoch);                  // this epoch's shuffle, the same on every rank
///   auto loader = torch::data::make_data_loader(dataset, std::move(sampler), batch_size);
///   for (auto& batch : *loader) { ... ddp.step(opt); }
/// }
/// ```
/// make_data_loader keeps its own copy of the sampler, so set_epoch must be called before the
/// loader is made (hence a loader per epoch; the dataset's tensors are shared, not copied).
/// DistributedSequentialSampler takes the same arguments and does not shuffle. Keep the
/// samplers' allow_duplicates (on by default): it pads the shards to the same length, so every
/// rank takes the same number of steps, as the collectives need.
///
/// What it brings: Runtime (runtime.h), DistributedModule and its algorithms
/// (distributed_module.h), the DataParallel interface and make_data_parallel (data_parallel.h),
/// ModelSwitch (model_switch.h), the decentralized and asynchronous modules
/// (gossip/decentralized.h), the optimizers (optim/), the rank environment (env.h) and the
/// launcher (launch.h).
#include "runtime/data_parallel.h"
#include "runtime/distributed_module.h"
#include "runtime/env.h"
#include "runtime/gossip/algorithms.h"
#include "runtime/gossip/decentralized.h"
#include "runtime/launch.h"
#include "runtime/model_switch.h"
#include "runtime/module_holder.h"
#include "runtime/optim/centralized.h"
#include "runtime/optim/fp16_optimizer.h"
#include "runtime/optim/power_sgd.h"
#include "runtime/optim/sign_sgd.h"
#include "runtime/optim/sparsified_sgd.h"
#include "runtime/runtime.h"
