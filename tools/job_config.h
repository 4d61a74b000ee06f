#pragma once
/// JobConfig: a training job described in a TOML file, as `troupe run job.toml` reads it.
///
/// ```toml
/// [job]
/// world_size = 8
/// mode = "threads"              # "threads" (ranks as threads of one process) or "processes"
/// timeout_sec = 600             # 0: no limit
///
/// [topology]                    # only for the decentralized algorithms
/// kind = "ring"                 # ring, torus, complete, exponential, random_matching, edge_list
/// mixing = "metropolis"         # uniform or metropolis
/// # rows = 2, cols = 4          (torus)   edges = [[0, 1], [1, 2]]   (edge_list)   seed = 1
///
/// [algorithm]
/// name = "decentralized"        # allreduce, fp16, bf16, bytegrad, int4, sign, topk, randomk,
///                               # blockk, powersgd, decentralized, low_precision_decentralized,
///                               # async_model_average, async_gossip, diloco, sparseloco
/// exchange = "overlap"          # and the algorithm's other settings, by their struct field names
///
/// [trainer]
/// program = "fashion_mnist"
/// model = "cnn"
/// epochs = 1
/// batch = 64
/// lr = 0.05
///
/// [links]                       # link emulation (comm/transport/link_emulation.h)
/// all = "1gbit,5ms"
/// ranks = { 3 = "100mbit,20ms" }
/// ```
/// Every mistake — an unknown table or key, a value of the wrong type or out of range, a topology
/// that does not fit the world size or the algorithm — is a comm::Error whose message names the
/// file, the key (as "algorithm.rank"), the value and what is allowed:
///   job.toml: algorithm.rank = 0: expected an integer >= 1
/// A TOML syntax error gives the line and column instead ("job.toml:3:8: not valid TOML: ...").
/// examples/configs/ holds job files to start from.
#include <cstdint>
#include <string>
#include <variant>

#include "algorithms/job_algorithm.h"
#include "comm/transport/link_shape.h"

namespace troupe {

/// The trainer of the job: the Fashion-MNIST example (examples/fashion_mnist).
struct TrainerConfig {
  /// The program to run: "fashion_mnist" (looked up beside the troupe binary, then in PATH) or a
  /// path.
  std::string program = "fashion_mnist";
  std::string model = "cnn";  // "cnn" or "mlp"
  int epochs = 1;             // >= 1
  int batch = 64;             // per rank, >= 1
  double lr = 0.05;           // > 0
  double momentum = 0.9;      // in [0, 1)
  /// "constant", or "cosine": lr * (1 + cos(pi * step / steps)) / 2 over the whole run.
  std::string lr_schedule = "constant";
  std::string data = "/usr/share/datasets/fashion-mnist";
  int log_every = 100;  // >= 1
  uint64_t seed = 42;
  int threads = 1;  // intra-op threads per rank, >= 1
};

/// The most ranks a job file's threads mode runs in one process: the in-process transport holds a
/// channel per pair of ranks, and each rank its own actor system and copy of the training set.
constexpr int kMaxThreadRanks = 256;

struct JobConfig {
  enum class Mode { threads, processes };
  /// 1..kMaxLocalRanks (rank/env.h), as every rank runs on this host; 1..kMaxThreadRanks in
  /// threads mode.
  int world_size = 1;
  Mode mode = Mode::processes;
  double timeout_sec = 0;  // >= 0; 0 = no limit
  JobAlgorithm algorithm = comm::GradientAllReduce{};
  TrainerConfig trainer;
  comm::LinkEmulation links;
  /// The file it came from (used in error messages), or "<string>".
  std::string source;
};

/// Parses and validates a job. `source` names the text in error messages. Topologies are checked
/// against world_size (comm::Topology) and against what the algorithm needs (decentralized: doubly
/// stochastic; low-precision decentralized and async gossip: undirected and static).
JobConfig parse_job_config(const std::string& text, const std::string& source = "<string>");
/// Reads and parses a file; a file that cannot be read is an error naming it.
JobConfig load_job_config(const std::string& path);

}  // namespace troupe
