#pragma once
/// Starting the ranks of a job from a program: what `troupe launch` runs (LaunchOptions, launch).
#include "elastic/launch.h"
