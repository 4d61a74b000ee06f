#pragma once
// Elastic Fashion-MNIST: under `troupe launch --elastic`, the ranks train through an
// ElasticTrainer (<troupe/elastic.h>), so the run goes on when a rank dies and takes a restarted
// rank back.
#include <troupe/algorithms.h>
#include <troupe/distributed_module.h>
#include <troupe/runtime.h>

#include <cstdint>
#include <string>

#include "fashion_mnist/dataset.h"

namespace troupe::examples {

/// The trainer's settings the elastic run uses.
struct ElasticRun {
  std::string data;
  std::string model = "mlp";
  int epochs = 1;
  int64_t batch = 64;  // per rank of the first world: the global batch is batch x world
  double lr = 0.05;
  double momentum = 0.9;
  int64_t log_every = 50;
  uint64_t seed = 1;
  /// Any algorithm of a job: ElasticTrainer runs them all (<troupe/elastic.h>).
  JobAlgorithm algorithm = comm::Compression{};
  DdpOptions ddp;
};

/// The training and test sets. Loaded before the Runtime joins the job, so that a hot spare
/// (`troupe launch --spares`) waits with them loaded and heals at once when it is taken.
struct ElasticData {
  FashionMnist train, test;
};
/// `subset` > 0: only the first `subset` training images (--subset).
ElasticData load_elastic_data(const std::string& dir, int64_t subset = 0);

/// Trains and, at each epoch's end, prints rank 0's test accuracy. Returns when the run is done.
void train_elastic(Runtime& rt, const ElasticRun& run, const ElasticData& data);

}  // namespace troupe::examples
