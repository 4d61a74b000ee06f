#pragma once
/// The registry of algorithms: make_data_parallel builds the DataParallel (ddp/data_parallel.h)
/// that a JobAlgorithm (algorithms/job_algorithm.h: a job file's [algorithm], a --algorithm
/// flag) names. The one place that knows every algorithm; the interface it returns knows none.
///
/// ```cpp
/// auto dp = troupe::make_data_parallel(rt, net, troupe::Decentralized{...});
/// for (...) { opt.zero_grad(); loss.backward(); dp->step(opt); }
/// dp->finish();                      // every rank: background work ends together
/// ```
#include <torch/nn/module.h>

#include <memory>
#include <utility>

#include "algorithms/job_algorithm.h"
#include "ddp/data_parallel.h"
#include "ddp/distributed_module.h"

namespace troupe {

/// The algorithm's DataParallel over `module`: a DistributedModule (with `options`) for the
/// bucket algorithms, the classes of algorithms/gossip/decentralized.h for the others. A
/// collective: every rank calls it with the same algorithm.
/// `module`: a shared_ptr or a ModuleHolder (rank/module_holder.h).
std::unique_ptr<DataParallel> make_data_parallel(Runtime& runtime, ModelRef module,
                                                 const JobAlgorithm& algorithm,
                                                 DdpOptions options = {});

}  // namespace troupe
