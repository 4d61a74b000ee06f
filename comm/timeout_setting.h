#pragma once
/// What every timeout message of troupe's collectives ends with: the settings that set the
/// deadline and how to change them, in a user's words (the comm layer does not know which one
/// its owner used, so it names both).
namespace troupe::comm {

inline constexpr const char* kTimeoutSetting =
    " (the deadline of troupe's collectives: troupe::RuntimeOptions::collective_timeout, 30 "
    "minutes by default, or DdpOptions::stall_timeout for a DistributedModule's reductions; raise "
    "it where a rank may take longer between two collectives, such as an evaluation on rank 0)";

}  // namespace troupe::comm
