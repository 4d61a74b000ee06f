#pragma once
// LibTorch (Debian's build) includes glog, whose CHECK macros collide with doctest's: include
// torch first, drop glog's macros, then doctest.
#include <torch/torch.h>

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LE
#undef CHECK_LT
#undef CHECK_GE
#undef CHECK_GT
#undef CHECK_NOTNULL

#include <doctest/doctest.h>
