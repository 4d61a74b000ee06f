#pragma once
/// Optimizers that communicate themselves (centralized, 1-bit/sign, sparsified, PowerSGD, fp16
/// master weights).
#include "runtime/optim/centralized.h"
#include "runtime/optim/fp16_optimizer.h"
#include "runtime/optim/power_sgd.h"
#include "runtime/optim/sign_sgd.h"
#include "runtime/optim/sparsified_sgd.h"
