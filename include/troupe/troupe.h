#pragma once
/// troupe's public API in one include: `#include <troupe/troupe.h>`. The headers of
/// <prefix>/include/troupe/ are the API; what they include from troupe/detail/ (installed only
/// because they need it) is not, and may change. One public header is left out:
/// <troupe/option_checks.h>, the command-line checks, which needs the program's own CLI11.
///
/// ```cpp
/// #include <torch/torch.h>
/// #include <troupe/troupe.h>
///
/// troupe::Runtime rt;                      // rank from torchrun, troupe launch, mpirun, srun
/// Net net;                                 // TORCH_MODULE(Net), or std::make_shared<NetImpl>()
/// troupe::DistributedModule ddp(rt, net);  // troupe/distributed_module.h: what it accepts
/// // Each rank reads its own shard: LibTorch's distributed samplers, given the world size and
/// // this rank (set_epoch before make_data_loader, which keeps its own copy of the sampler).
/// for (size_t epoch = 0; epoch < epochs; ++epoch) {
///   torch::data::samplers::DistributedRandomSampler sampler(dataset.size().value(),
///                                                           rt.world_size(), rt.rank());
///   sampler.set_epoch(epoch);
///   auto loader = torch::data::make_data_loader(dataset, std::move(sampler), batch_size);
///   for (auto& batch : *loader) { ... loss.backward(); ddp.step(opt); }
/// }
/// ```
/// Keep the samplers' allow_duplicates (on by default): it pads the shards to one length, so every
/// rank takes the same number of steps, as the collectives need. troupe/distributed_module.h says
/// what a training loop may do (several backward passes per step, no_sync(), buffers, timeouts).
#include <troupe/algorithms.h>
#include <troupe/checkpoint.h>
#include <troupe/compute_threads.h>
#include <troupe/data_parallel.h>
#include <troupe/device.h>
#include <troupe/distributed_module.h>
#include <troupe/elastic.h>
#include <troupe/job_config.h>
#include <troupe/launch.h>
#include <troupe/optimizers.h>
#include <troupe/runtime.h>
#include <troupe/thread_ranks.h>
