#include "rank/fault.h"

#include <doctest/doctest.h>

#include <string>

#include "comm/status.h"

using troupe::Fault;
using troupe::FaultPhase;
using troupe::parse_faults;
namespace fault = troupe::fault;

namespace {

std::string error_of(const std::string& text) {
  try {
    parse_faults(text);
  } catch (const troupe::comm::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("a fault plan names the rank, the step and the phase, backward by default") {
  auto faults = parse_faults("kill:rank=2,step=100");
  REQUIRE(faults.size() == 1);
  CHECK(faults[0].rank == 2);
  CHECK(faults[0].step == 100);
  CHECK(faults[0].phase == FaultPhase::backward);

  faults = parse_faults(
      "kill:step=7,phase=optimizer,rank=0;kill:rank=3,step=0,phase=rendezvous;"
      "kill:rank=1,step=12,phase=reduce");
  REQUIRE(faults.size() == 3);
  CHECK(faults[0].rank == 0);
  CHECK(faults[0].step == 7);
  CHECK(faults[0].phase == FaultPhase::optimizer);
  CHECK(faults[1].phase == FaultPhase::rendezvous);
  CHECK(faults[1].step == 0);
  CHECK(faults[2].phase == FaultPhase::reduce);
  CHECK(parse_faults("").empty());

  faults = parse_faults("kill:rank=2,step=any,phase=heal,life=1");
  REQUIRE(faults.size() == 1);
  CHECK(faults[0].step == troupe::kAnyStep);
  CHECK(faults[0].phase == FaultPhase::heal);
  CHECK(faults[0].life == 1);
}

TEST_CASE("a bad fault plan is refused naming the variable, the value and what was expected") {
  struct Bad {
    const char* text;
    const char* says;
  };
  for (const Bad& bad :
       {Bad{"die:rank=1,step=2", "does not start with 'kill:'"}, Bad{"kill:rank=1", "lacks step="},
        Bad{"kill:step=4", "lacks rank="},
        Bad{"kill:rank=one,step=2", "rank='one' is not a non-negative integer"},
        Bad{"kill:rank=1,step=-2", "step='-2' is not a non-negative integer"},
        Bad{"kill:rank=1,step=", "step='' is not a non-negative integer"},
        Bad{"kill:rank=1,step=2,phase=forward", "phase='forward'"},
        Bad{"kill:rank=1,step=2,when=now", "unknown key 'when'"},
        Bad{"kill:rank=1,rank=2,step=2", "key 'rank' appears twice"},
        Bad{"kill:rank=1,step", "'step' in 'kill:rank=1,step' is not key=value"},
        Bad{"kill:rank=1,step=2;", "an empty fault"},
        Bad{"kill:rank=70000,step=2", "rank=70000 is out of range"},
        Bad{"kill:rank=1,step=any", "step=any in 'kill:rank=1,step=any' with phase backward"},
        Bad{"kill:rank=1,step=2,life=x", "life='x' is not a non-negative integer"}}) {
    CAPTURE(bad.text);
    const std::string what = error_of(bad.text);
    CHECK(what.find(std::string("TROUPE_FAULT='") + bad.text + "'") != std::string::npos);
    CHECK(what.find(bad.says) != std::string::npos);
    CHECK(what.find("expected") != std::string::npos);
  }
}

TEST_CASE("arming keeps this rank's earliest fault per phase of the life it is in") {
  const auto faults = parse_faults(
      "kill:rank=1,step=9;kill:rank=1,step=4;kill:rank=2,step=1;"
      "kill:rank=1,step=6,phase=reduce");
  fault::arm(faults, 1, 4, 0);
  CHECK(fault::armed_step(FaultPhase::backward) == 4);
  CHECK(fault::armed_step(FaultPhase::reduce) == 6);
  CHECK(fault::armed_step(FaultPhase::optimizer) == -1);
  CHECK(fault::armed_step(FaultPhase::rendezvous) == -1);
  fault::arm(faults, 0, 4, 0);
  CHECK(fault::armed_step(FaultPhase::backward) == -1);
  fault::arm(faults, 1, 4, 1);  // restarted once: its faults have fired
  CHECK(fault::armed_step(FaultPhase::backward) == -1);
  fault::arm(parse_faults("kill:rank=1,step=3;kill:rank=1,step=any,phase=heal,life=1"), 1, 4, 1);
  CHECK(fault::armed_step(FaultPhase::backward) == -1);
  CHECK(fault::armed_step(FaultPhase::heal) == troupe::kAnyStep);
  CHECK_THROWS_WITH_AS(
      fault::arm(faults, 0, 2, 0, "RuntimeOptions.faults"),
      doctest::Contains("RuntimeOptions.faults: a fault names rank 2 (expected 0..1"),
      troupe::comm::Error);
  fault::disarm();
  CHECK(fault::armed_step(FaultPhase::reduce) == -1);
}
