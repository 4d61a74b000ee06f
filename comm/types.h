#pragma once
/// Element types and reduction operators understood by the collectives.
#include <cstddef>
#include <cstdint>
#include <string>

namespace troupe::comm {

/// Element type of a buffer handed to a collective.
enum class DataType : uint8_t { float32, float64, float16, bfloat16, int32, int64 };

/// Reduction applied element-wise by allreduce and reduce-scatter.
/// avg sums, then divides by the world size (integer types truncate toward zero).
enum class ReduceOp : uint8_t { sum, avg, min, max };

/// Bytes per element of `t`.
size_t element_size(DataType t);
/// "float32", "bfloat16", ...
const char* to_string(DataType t);
const char* to_string(ReduceOp op);
/// Parses the names printed by to_string; throws comm::Error naming the value otherwise.
DataType parse_data_type(const std::string& name);
ReduceOp parse_reduce_op(const std::string& name);

}  // namespace troupe::comm
