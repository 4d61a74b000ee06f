#pragma once
/// JobAlgorithm: every algorithm a training job can run, the one value a trainer switches on —
/// the bucket algorithms of DistributedModule (comm/compression/algorithms.h) and the
/// decentralized and asynchronous ones of runtime/gossip. A job file's [algorithm] table
/// (runtime/job_config.h) and make_data_parallel (runtime/data_parallel.h) take it.
#include <string>
#include <variant>

#include "comm/compression/algorithms.h"
#include "runtime/gossip/algorithms.h"

namespace troupe {

/// Every algorithm a job can run: the bucket algorithms of DistributedModule, and the
/// decentralized and asynchronous ones of runtime/gossip.
using JobAlgorithm = std::variant<comm::Compression, Decentralized, LowPrecisionDecentralized,
                                  AsyncModelAverage, AsyncGossip>;

/// The name a job file uses for the algorithm ("powersgd", "decentralized", ...).
std::string job_algorithm_name(const JobAlgorithm& algorithm);

/// Whether the survivors of the algorithm train on when a rank dies: the gossip algorithms drop a
/// dead neighbour (decentralized, low_precision_decentralized, async_gossip); the others need
/// every rank in every reduction (the bucket algorithms, async_model_average). `troupe run` keeps
/// the other ranks running when one of a tolerant job dies, and stops them all otherwise.
bool tolerates_dead_ranks(const JobAlgorithm& algorithm);

}  // namespace troupe
