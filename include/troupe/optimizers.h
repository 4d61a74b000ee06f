#pragma once
/// Optimizers that communicate themselves (centralized, 1-bit/sign, sparsified, PowerSGD, fp16
/// master weights).
#include "algorithms/optim/centralized.h"
#include "algorithms/optim/fp16_optimizer.h"
#include "algorithms/optim/power_sgd.h"
#include "algorithms/optim/sign_sgd.h"
#include "algorithms/optim/sparsified_sgd.h"
