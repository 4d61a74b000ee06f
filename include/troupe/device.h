#pragma once
/// The device a rank trains on, from a --device option: check_device_name, training_device.
#include "rank/device.h"
