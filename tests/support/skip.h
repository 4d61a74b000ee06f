#pragma once
// A test case that cannot run here (no GPU, one GPU where it needs two, no torchrun) calls
// skip_case instead of returning quietly: it prints kSkipMarker, which tests/CMakeLists.txt gives
// ctest as SKIP_REGULAR_EXPRESSION, so ctest's summary counts the case as skipped, not passed.
// (doctest_discover_tests runs every case as its own ctest test, so the marker names one case.)
#include <iostream>
#include <string>

namespace troupe::test {

/// The line ctest recognises as "this case did not run"; keep in step with tests/CMakeLists.txt.
inline constexpr char kSkipMarker[] = "TROUPE_TEST_SKIPPED";

/// Reports the running case as skipped, saying why; the caller returns right after.
inline void skip_case(const std::string& why) {
  std::cout << kSkipMarker << ": " << why << std::endl;
}

}  // namespace troupe::test
