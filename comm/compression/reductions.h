#pragma once
/// The Reduction of each algorithm (one file each), for make_reduction. Internal to
/// comm/compression.
#include <memory>

#include "comm/compression/algorithms.h"

namespace troupe::comm {

std::shared_ptr<Reduction> make_allreduce_reduction(const BucketBuffer& bucket);
std::shared_ptr<Reduction> make_half_reduction(const HalfPrecision& config,
                                               const BucketBuffer& bucket);
std::shared_ptr<Reduction> make_byte_grad_reduction(const ByteGrad& config,
                                                    const BucketBuffer& bucket);
std::shared_ptr<Reduction> make_int4_reduction(const Int4Quantization& config,
                                               const BucketBuffer& bucket);
std::shared_ptr<Reduction> make_sign_reduction(const SignCompression& config,
                                               const BucketBuffer& bucket);
std::shared_ptr<Reduction> make_sparse_reduction(const Sparsification& config,
                                                 const BucketBuffer& bucket);
std::shared_ptr<Reduction> make_power_sgd_reduction(const PowerSGD& config,
                                                    const BucketBuffer& bucket);

/// A seed for (seed, a, b) with every bit of each input mixed in (splitmix64 finaliser).
uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b);

/// Sets the elements of the bucket outside every tensor (alignment padding) to zero, so that a
/// codec never picks up stale values there. float32 buckets only.
void zero_padding(const BucketBuffer& bucket);

/// An allreduce of `count` floats at `data` whose sum is multiplied by step.scale (before or after,
/// as step.divide_before says).
Schedule scaled_allreduce(const ReduceStep& step, void* data, size_t count, DataType type);

}  // namespace troupe::comm
