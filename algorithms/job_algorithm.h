#pragma once
/// JobAlgorithm: every algorithm a training job can run, the one value a trainer switches on —
/// the bucket algorithms of DistributedModule (comm/compression/algorithms.h) and the
/// decentralized and asynchronous ones of algorithms/gossip. A job file's [algorithm] table
/// (tools/job_config.h) and make_data_parallel (algorithms/registry.h) take it.
#include <string>
#include <variant>

#include "algorithms/gossip/algorithms.h"
#include "algorithms/local_update/algorithms.h"
#include "comm/compression/algorithms.h"

namespace troupe {

/// Every algorithm a job can run: the bucket algorithms of DistributedModule, the decentralized
/// and asynchronous ones of algorithms/gossip, and the local-update ones of
/// algorithms/local_update.
using JobAlgorithm =
    std::variant<comm::Compression, Decentralized, LowPrecisionDecentralized, AsyncModelAverage,
                 AsyncGossip, DiLoCo, StreamingDiLoCo, SparseLoCo>;

/// An algorithm as the command line's --algorithm gives it: a bucket algorithm with its settings
/// ("powersgd:rank=2", comm::parse_compression), or
/// "diloco[:h=50,outer_lr=0.7,outer_momentum=0.9,nesterov=1,compress=fp16]" (compress: a bucket
/// algorithm's name, with its default settings; a job file's outer_compression takes settings too),
/// or "sparseloco[:h=50,outer_lr=1,ratio=0.015625,chunk=4096,bits=2,beta=0.95]",
/// or "streaming-diloco[:h=50,fragments=4,delay=1,alpha=0.5,outer_lr=..,outer_momentum=..,
/// nesterov=1,compress=fp16,eager=0]" (also spelt streaming_diloco), or a gossip or asynchronous
/// one: "decentralized[:topology=ring,mixing=uniform,exchange=overlap,communication_interval=1]",
/// "low_precision_decentralized[:topology=ring,mixing=uniform,gamma=1,block=4096]",
/// "async_model_average[:warmup_steps=0,sync_interval_ms=100]" or
/// "async_gossip[:topology=ring,mixing=uniform,min_interval_ms=10]" (also spelt with '-'; a
/// torus or an edge list needs a job file's [topology]).
/// Throws comm::Error naming the key or value and what was expected.
JobAlgorithm parse_algorithm_argument(const std::string& text);

/// The name a job file uses for the algorithm ("powersgd", "decentralized", ...).
std::string job_algorithm_name(const JobAlgorithm& algorithm);

/// Whether the survivors of the algorithm train on when a rank dies: the gossip algorithms drop a
/// dead neighbour (decentralized, low_precision_decentralized, async_gossip); the others need
/// every rank in every reduction (the bucket algorithms, async_model_average). `troupe run` keeps
/// the other ranks running when one of a tolerant job dies, and stops them all otherwise.
bool tolerates_dead_ranks(const JobAlgorithm& algorithm);

}  // namespace troupe
