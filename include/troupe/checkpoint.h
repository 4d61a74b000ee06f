#pragma once
/// Saving and restoring a rank's whole training state (model, optimizer, the algorithm's own
/// state, torch's generator, the loader's position): bit-identical resume.
#include "runtime/checkpoint.h"
