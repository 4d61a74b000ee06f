#pragma once
/// GradientPath: how the buckets of one DistributedModule are reduced, chosen once per module.
///
/// A gradient path is the way a bucket's flat buffer gets from "this rank's gradients" to "the sum
/// over ranks divided by the step's denominator, the same bits on every rank". Each path is one
/// file of ddp/gradient_path/ and tells its own story there:
///   nccl.cpp           CUDA buckets, one NCCL allreduce each, on the device
///   host_staging.cpp   CUDA buckets copied to pinned host memory, reduced there by another path;
///                      or compressed on the device first (device_codecs.h: fp16/bf16, sign,
///                      8-bit/4-bit min-max, top-k, PowerSGD), so that only the codes are copied
///   shared_memory.cpp  CPU buckets of ranks on one host, summed straight from each other's memory
///   transport.cpp      CPU buckets, the algorithm's stages (comm::Reduction) over the transport
///
/// The contract of a path:
/// - can_serve(context) looks at the module, its options and the runtime, and answers "" when the
///   path can reduce this module's buckets, or why it cannot ("the parameters are on the CPU"):
///   what the user reads when no path serves. It communicates nothing and holds nothing, and it
///   answers the same on every rank when the ranks agree on what the model check compares.
/// - connect(context) runs once on the chosen path, after the model check, on every rank at the
///   same point (it may be a collective: a communicator split, shared memory mapped).
/// - Each time the module (re)builds its buckets: begin_buckets(count), then bucket_memory() and
///   bucket() for each bucket in order. bucket_memory() gives the bucket's flat tensor (where the
///   path needs it to live); bucket() gives the bucket actor its share of the path
///   (actors::BucketPath: reduce a step, abort, say whom it waits for).
/// - name() is what DistributedModule::gradient_path() says and the model check compares.
///
/// choose_gradient_path() walks gradient_path_candidates() in order and takes the first that can
/// serve; the others' reasons stay with the choice. Adding a path is one file of
/// ddp/gradient_path/ defining its make_..._path(), and one entry in that list
/// (ddp/gradient_path.cpp).
#include <torch/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "actors/bucket.h"
#include "comm/compression/algorithms.h"
#include "comm/compression/reduction.h"

namespace troupe {

class Runtime;
class CudaGradients;
struct DdpOptions;

/// What GradientPath::adopt() did with a gradient that autograd put elsewhere than its bucket slot.
enum class Adoption {
  /// Copied into its slot; the gradient is to point at the slot.
  copied,
  /// Handed to the bucket's next reduction, which reads it where it lies and writes the result
  /// into the slot; the gradient is to point at the slot.
  read_in_place,
  /// Handed to the bucket's next reduction, which reads it where it lies and writes the result
  /// over it: the gradient stays where it is and holds the reduced value once the reduction ends
  /// (the slot is not written).
  reduced_in_place,
};

/// What a path may look at to decide whether it can serve a module, and use to set itself up.
/// The pointers stay valid while the module lives.
struct GradientPathContext {
  Runtime* runtime = nullptr;
  const comm::Compression* algorithm = nullptr;
  const DdpOptions* options = nullptr;
  /// The parameters that get gradients, in definition order.
  const std::vector<torch::Tensor>* params = nullptr;
  /// CUDA parameters: their device and events (ddp/cuda_gradients.h); null for a CPU module.
  CudaGradients* cuda = nullptr;
  /// The module's key prefix: the upper bits of every key of its collectives.
  uint32_t key_prefix = 0;
  /// How a path that runs comm::Reductions (the transport path) makes each bucket's; unset:
  /// comm::make_reduction(*algorithm, buffer). Host staging that compresses on the device sets it
  /// for the path it wraps: the exchange of the device's codes (comm/compression/coded.h).
  std::function<std::shared_ptr<comm::Reduction>(const comm::BucketBuffer&)> make_reduction;
};

class GradientPath {
 public:
  virtual ~GradientPath() = default;
  /// "cpu", "cpu via shared memory", "cuda via nccl", "cuda via host staging", "cuda via host
  /// staging, compressed on the device".
  virtual std::string name() const = 0;
  /// "" when this path can reduce the module's buckets, else why not.
  virtual std::string can_serve(const GradientPathContext& context) const = 0;
  /// Once, on the chosen path, on every rank at the same point after the model check.
  virtual void connect(const GradientPathContext& context) { (void)context; }
  /// A new set of `count` buckets is being built (at construction and at the rebuild).
  virtual void begin_buckets(int count) { (void)count; }
  /// The flat buffer of bucket `index`: `elements` zeros with `options` (the parameters' dtype
  /// and device). By default ordinary memory on that device.
  virtual torch::Tensor bucket_memory(int index, int64_t elements,
                                      const torch::TensorOptions& options);
  /// A gradient that autograd put elsewhere than its place in bucket `bucket` (the user had set
  /// it to none, or replaced it): `grad`, dense and contiguous on the CPU, belongs in `view`, its
  /// parameter's slice at element `offset` of the bucket (same shape and dtype), as far as the
  /// bucket's next reduction reads it. By default copied in; a path whose reduction can read it
  /// where it lies hands it over instead and keeps `grad` until that reduction has ended, and may
  /// have the result written over it (Adoption::reduced_in_place). Called on the trainer's
  /// thread, before the bucket is told the gradient is ready.
  virtual Adoption adopt(int bucket, int64_t offset, const torch::Tensor& grad,
                         const torch::Tensor& view);
  /// Bucket `buffer.index`'s share of the path, over `buffer` (its bucket_memory()). CUDA buckets:
  /// `ready_events` (cudaEvent_t) are recorded where its gradients became ready and where step()
  /// last touched the buckets; device work on the buffer waits for all of them.
  virtual std::shared_ptr<actors::BucketPath> bucket(const comm::BucketBuffer& buffer,
                                                     std::vector<void*> ready_events) = 0;
};

/// The paths in order of preference; the first that can serve is taken.
std::vector<std::unique_ptr<GradientPath>> gradient_path_candidates();

/// The path chosen for a module and why the ones before it declined.
struct GradientPathChoice {
  std::unique_ptr<GradientPath> path;
  /// "nccl: the parameters are on the CPU", one per candidate that declined, in order.
  std::vector<std::string> declined;
};

/// The first of `candidates` that can serve `context`. Throws comm::Error listing every
/// candidate's reason when none can.
GradientPathChoice choose_gradient_path(std::vector<std::unique_ptr<GradientPath>> candidates,
                                        const GradientPathContext& context);

}  // namespace troupe
