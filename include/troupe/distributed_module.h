#pragma once
/// Data-parallel training of a torch::nn::Module with gradient buckets, what PyTorch's
/// DistributedDataParallel is to Python: DistributedModule and DdpOptions, and the modules it
/// accepts (TORCH_MODULE holders such as `Net net;`, torch::nn::Linear, std::shared_ptr<NetImpl>;
/// a Module subclass kept by value does not compile). The reference of every member is in the
/// declarations below (troupe/detail/runtime/distributed_module.h); what a training loop needs:
///
/// ```cpp
/// troupe::Runtime rt;
/// troupe::DistributedModule ddp(rt, net);     // rank 0's weights and buffers become everyone's
/// for (auto& batch : *loader) {
///   opt.zero_grad();
///   loss_of(batch).backward();                // buckets reduce while backward runs
///   ddp.step(opt);                            // the averaged gradients, then opt.step()
/// }
/// ```
/// - Several backward passes per step (a GAN: the discriminator on real, then on fake images;
///   the generator's backward through the discriminator) are each averaged over the ranks when
///   they end, the next accumulating onto the averages, as in PyTorch DDP: examples/dcgan. Every
///   rank runs the same passes; each pass gives every parameter a gradient, unless
///   DdpOptions::find_unused_parameters.
/// - `auto guard = ddp.no_sync();` accumulates the passes run while the guard lives without
///   communicating; the first pass after it reduces the sum. Discarding the guard
///   (`ddp.no_sync();`) is a compile warning.
/// - Buffers (BatchNorm's running statistics) are rank 0's on every rank after each backward pass
///   (DdpOptions::broadcast_buffers; false keeps each rank its own).
/// - DdpOptions::name names the module in errors ("parameter 'fc.weight' of module
///   'discriminator'") where a program wraps several.
/// - A step's reductions must finish within DdpOptions::stall_timeout, by default
///   RuntimeOptions::collective_timeout (30 minutes).
/// - step() without a backward since the previous step() throws; so does a backward pass that
///   left parameters without a gradient, at step(), naming them.
/// - DdpOptions::overlap_next_forward lets the reductions of a step run on while the next forward
///   computes: the model's forward calls `troupe::await_parameters(layer)` before each layer,
///   which steps that layer's parameters once their bucket is reduced (examples/fashion_mnist's
///   CnnNet). After the last step, `ddp.await_parameters()` applies what is still pending.
#include "ddp/distributed_module.h"
#include "rank/module_holder.h"
