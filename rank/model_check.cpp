#include "rank/model_check.h"

#include <algorithm>
#include <vector>

namespace troupe {

comm::DataType comm_type(c10::ScalarType t, const std::string& what) {
  switch (t) {
    case torch::kFloat:
      return comm::DataType::float32;
    case torch::kDouble:
      return comm::DataType::float64;
    case torch::kHalf:
      return comm::DataType::float16;
    case torch::kBFloat16:
      return comm::DataType::bfloat16;
    case torch::kInt:
      return comm::DataType::int32;
    case torch::kLong:
      return comm::DataType::int64;
    default:
      throw comm::Error(what + " has dtype " + std::string(c10::toString(t)) +
                        " (expected float32, float64, float16, bfloat16, int32 or int64)");
  }
}

std::string shape_of(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "] " + c10::toString(t.scalar_type());
}

namespace {

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < s.size()) {
    size_t end = s.find('\n', start);
    if (end == std::string::npos) break;
    out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace

void check_same_on_every_rank(comm::Communicator& comm, std::string mine) {
  const int world = comm.world_size();
  mine.resize((mine.size() + 3) / 4 * 4, ' ');  // gathered as int32 words
  int64_t length = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lengths(static_cast<size_t>(world));
  comm.allgather(&length, lengths.data(), 1, comm::DataType::int64);
  std::vector<size_t> counts;
  size_t total = 0;
  for (int64_t l : lengths) {
    counts.push_back(static_cast<size_t>(l) / 4);
    total += static_cast<size_t>(l);
  }
  std::string all(total, '\0');
  comm.allgatherv(mine.data(), all.data(), counts, comm::DataType::int32);
  std::vector<std::string> per_rank;
  size_t at = 0;
  for (int64_t l : lengths) {
    per_rank.push_back(all.substr(at, static_cast<size_t>(l)));
    at += static_cast<size_t>(l);
  }
  auto reference = lines(per_rank[0]);
  for (int r = 1; r < world; ++r) {
    auto other = lines(per_rank[static_cast<size_t>(r)]);
    for (size_t i = 0; i < std::max(reference.size(), other.size()); ++i) {
      std::string a = i < reference.size() ? reference[i] : "(nothing)";
      std::string b = i < other.size() ? other[i] : "(nothing)";
      if (a != b)
        throw comm::Error("model mismatch between rank 0 and rank " + std::to_string(r) +
                          " at entry " + std::to_string(i) + ": rank 0 has '" + a + "', rank " +
                          std::to_string(r) + " has '" + b +
                          "' (every rank must wrap the same model)");
    }
  }
}

}  // namespace troupe
