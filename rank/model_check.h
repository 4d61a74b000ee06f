#pragma once
/// Checks that every rank wraps the same model (internal to runtime/): each rank describes its
/// model as text, one entry per line, and the descriptions are compared with rank 0's. Also the
/// dtype mapping between torch and comm.
#include <torch/types.h>

#include <string>

#include "comm/collectives/communicator.h"

namespace troupe {

/// The comm type of a tensor dtype; throws comm::Error naming `what` and the dtype when comm has
/// no such type.
comm::DataType comm_type(c10::ScalarType t, const std::string& what);

/// "[3, 4] Float": a tensor's shape and dtype as the model check compares them.
std::string shape_of(const torch::Tensor& t);

/// A collective: gathers every rank's `mine` (lines ending in '\n') and throws comm::Error naming
/// the first line where a rank differs from rank 0 ("model mismatch between rank 0 and rank 2 at
/// entry 3: rank 0 has '...', rank 2 has '...'").
void check_same_on_every_rank(comm::Communicator& comm, std::string mine);

}  // namespace troupe
