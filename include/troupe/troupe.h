#pragma once
/// troupe's public API in one include: `#include <troupe/troupe.h>`. The headers of
/// <prefix>/include/troupe/ are the API; what they include from troupe/detail/ (installed only
/// because they need it) is not, and may change.
///
/// ```cpp
/// #include <torch/torch.h>
/// #include <troupe/troupe.h>
///
/// troupe::Runtime rt;                          // rank from torchrun / troupe launch / mpirun / srun
/// Net net;                                     // TORCH_MODULE(Net), or std::make_shared<NetImpl>()
/// troupe::DistributedModule ddp(rt, net);      // troupe/distributed_module.h: what it accepts
/// for (auto& batch : *loader) { ... loss.backward(); ddp.step(opt); }
/// ```
/// runtime/troupe.h (in the source tree) says how each rank reads its own shard.
#include <troupe/algorithms.h>
#include <troupe/checkpoint.h>
#include <troupe/compute_threads.h>
#include <troupe/data_parallel.h>
#include <troupe/distributed_module.h>
#include <troupe/launch.h>
#include <troupe/optimizers.h>
#include <troupe/runtime.h>
