#include "comm/types.h"

#include "comm/status.h"

namespace troupe::comm {

size_t element_size(DataType t) {
  switch (t) {
    case DataType::float32:
      return 4;
    case DataType::float64:
      return 8;
    case DataType::float16:
      return 2;
    case DataType::bfloat16:
      return 2;
    case DataType::int32:
      return 4;
    case DataType::int64:
      return 8;
  }
  throw Error("element_size: unknown DataType " + std::to_string(static_cast<int>(t)));
}

const char* to_string(DataType t) {
  switch (t) {
    case DataType::float32:
      return "float32";
    case DataType::float64:
      return "float64";
    case DataType::float16:
      return "float16";
    case DataType::bfloat16:
      return "bfloat16";
    case DataType::int32:
      return "int32";
    case DataType::int64:
      return "int64";
  }
  return "unknown";
}

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::min:
      return "min";
    case ReduceOp::max:
      return "max";
  }
  return "unknown";
}

DataType parse_data_type(const std::string& name) {
  for (auto t : {DataType::float32, DataType::float64, DataType::float16, DataType::bfloat16,
                 DataType::int32, DataType::int64})
    if (name == to_string(t)) return t;
  throw Error("data type '" + name +
              "' is not one of float32, float64, float16, bfloat16, int32, int64");
}

ReduceOp parse_reduce_op(const std::string& name) {
  for (auto op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max})
    if (name == to_string(op)) return op;
  throw Error("reduce op '" + name + "' is not one of sum, avg, min, max");
}

}  // namespace troupe::comm
