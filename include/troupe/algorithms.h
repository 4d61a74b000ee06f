#pragma once
/// The communication algorithms, as plain structs: the bucket algorithms of DistributedModule
/// (GradientAllReduce, HalfPrecision, ByteGrad, SignCompression, Sparsification, PowerSGD), the
/// decentralized and asynchronous ones (Decentralized, LowPrecisionDecentralized,
/// AsyncModelAverage, AsyncGossip), and JobAlgorithm, any one of them.
#include "comm/compression/algorithms.h"
#include "runtime/gossip/algorithms.h"
#include "runtime/job_algorithm.h"
