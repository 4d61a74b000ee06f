#pragma once
/// Elastic training, for a job started by `troupe launch --elastic`: ElasticTrainer goes on when
/// ranks die and takes restarted ranks (and hot spares) back without restarting any survivor, and
/// ElasticSampler cuts the training set into global batches that are the same whatever the world
/// size, so that a step redone after the world changed trains on the same images.
/// examples/fashion_mnist/elastic.cpp trains with both; the contract is in the header below.
#include "elastic/elastic.h"
