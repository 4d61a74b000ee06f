#pragma once
/// Saving and restoring the training state (modules and optimizers by name, the algorithm's own
/// state, torch's generator, the loader's position, the settings it depends on): one rank's file,
/// the job's checkpoint of a step every rank saved (save_step / load_last: bit-identical resume),
/// or rank 0's model for any world size and plain LibTorch (save_consolidated). The whole contract
/// is documented in the header below.
#include "rank/checkpoint.h"
