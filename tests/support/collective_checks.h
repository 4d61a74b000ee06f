#pragma once
// Test support: runs every collective x op x dtype on a Communicator and compares each result with
// a reference computed in this process from the (deterministic) inputs of every rank.
#include <string>
#include <vector>

#include "comm/collectives/communicator.h"

namespace troupe::test {

/// Value of element i of rank `rank`'s input: a small integer, exact in every dtype, so sums,
/// minima and maxima of up to 8 ranks are exact and results can be compared bit for bit.
double input_value(int rank, size_t i, int salt);
void store(comm::DataType t, void* buf, size_t i, double v);
double load(comm::DataType t, const void* buf, size_t i);

/// allreduce alone, every op x dtype x count; one line per mismatch.
std::vector<std::string> check_allreduce(comm::Communicator& comm,
                                         const std::vector<size_t>& counts);

/// Runs the whole matrix; returns one line per mismatch (empty when everything matched).
std::vector<std::string> check_collectives(comm::Communicator& comm,
                                           const std::vector<size_t>& counts);

}  // namespace troupe::test
