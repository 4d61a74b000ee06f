#pragma once
/// The communication algorithms, as plain structs: the bucket algorithms of DistributedModule
/// (GradientAllReduce, HalfPrecision, ByteGrad, Int4Quantization, SignCompression, Sparsification,
/// PowerSGD), the decentralized and asynchronous ones (Decentralized, LowPrecisionDecentralized,
/// AsyncModelAverage, AsyncGossip), the local-update ones (DiLoCo, StreamingDiLoCo, SparseLoCo),
/// and JobAlgorithm, any one of them.
#include "algorithms/gossip/algorithms.h"
#include "algorithms/job_algorithm.h"
#include "comm/compression/algorithms.h"
