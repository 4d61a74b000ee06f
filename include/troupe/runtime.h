#pragma once
/// A rank of a troupe job: Runtime and RuntimeOptions, the rank environment (RankInfo: what
/// `troupe launch`, torchrun, mpirun and Slurm set) and the blocking collectives of
/// Runtime::comm().
#include "rank/env.h"
#include "rank/runtime.h"
