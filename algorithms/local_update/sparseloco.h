#pragma once
/// SparseLoCo (Sarfi et al. 2025; DeMo's family): DiLoCo's H local steps, but the outer gradient
/// (global - local weights) is sent sparse and in few bits, and an error-feedback memory takes the
/// place of the outer momentum. At every synchronisation each rank
///   e  = ef_decay * e + (global - local)
///   c  = Q(topk(e))      the k = ratio * chunk largest |e| of each chunk, in value_bits bits
///   e -= c               what was not sent, quantisation error included, stays for later
/// and the ranks allgather their c (16-bit indices within the chunk, 2-bit min-max codes and a
/// {min, max} pair per chunk); every rank sums them in fp32 and steps
///   global -= outer_lr * (sum of c) / world size,
/// then continues from global. docs/algorithms.md gives the bytes on the wire.
///
/// ```cpp
/// troupe::SparseLoCoModule dp(rt, net, troupe::SparseLoCo{/*inner_steps=*/50});
/// for (...) { inner.zero_grad(); loss.backward(); dp.step(inner); }  // syncs every 50th step
/// ```
/// Parameters are float32 on the CPU or one CUDA device (algorithms/gossip/flat_model.h), rank 0's
/// broadcast at construction; buffers stay local, as in DiLoCo (diloco.h).
#include <torch/nn/module.h>

#include <memory>
#include <string>

#include "algorithms/local_update/algorithms.h"
#include "algorithms/local_update/local_update_module.h"

namespace troupe {

/// "sparseloco(h=50, ratio=0.015625, chunk=4096, bits=2, beta=0.95, outer_lr=1)".
std::string sparseloco_name(const SparseLoCo& config);

/// The bytes one rank's message holds at each synchronisation for a model of `count` parameters:
/// the {min, max} pairs (or the float values at 32 bits), the 16-bit indices and the codes, in
/// whole 32-bit words. A ring allgather sends (world - 1) of them per rank.
size_t sparseloco_message_bytes(const SparseLoCo& config, size_t count);

/// step() synchronises at every inner_steps-th call. The state holds the error-feedback memory
/// besides local_update_module.h's.
class SparseLoCoModule : public LocalUpdateModule {
 public:
  /// A collective: every rank wraps the same model with the same config. Throws comm::Error
  /// naming a setting out of range (and what was expected), or a parameter that is not float32.
  SparseLoCoModule(Runtime& runtime, std::shared_ptr<torch::nn::Module> module, SparseLoCo config);

 private:
  struct Impl;
};

}  // namespace troupe
