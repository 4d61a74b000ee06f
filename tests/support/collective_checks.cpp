#include "tests/support/collective_checks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>

#include "comm/reduce.h"

namespace troupe::test {

using comm::DataType;
using comm::ReduceOp;

double input_value(int rank, size_t i, int salt) {
  return static_cast<double>(static_cast<int>((rank * 7 + i * 3 + static_cast<size_t>(salt)) % 9) -
                             4);
}

void store(DataType t, void* buf, size_t i, double v) {
  switch (t) {
    case DataType::float32:
      static_cast<float*>(buf)[i] = static_cast<float>(v);
      break;
    case DataType::float64:
      static_cast<double*>(buf)[i] = v;
      break;
    case DataType::int32:
      static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(v);
      break;
    case DataType::int64:
      static_cast<int64_t*>(buf)[i] = static_cast<int64_t>(v);
      break;
    case DataType::float16:
      static_cast<uint16_t*>(buf)[i] = comm::float_to_half(static_cast<float>(v));
      break;
    case DataType::bfloat16:
      static_cast<uint16_t*>(buf)[i] = comm::float_to_bfloat16(static_cast<float>(v));
      break;
  }
}

double load(DataType t, const void* buf, size_t i) {
  switch (t) {
    case DataType::float32:
      return static_cast<const float*>(buf)[i];
    case DataType::float64:
      return static_cast<const double*>(buf)[i];
    case DataType::int32:
      return static_cast<const int32_t*>(buf)[i];
    case DataType::int64:
      return static_cast<double>(static_cast<const int64_t*>(buf)[i]);
    case DataType::float16:
      return comm::half_to_float(static_cast<const uint16_t*>(buf)[i]);
    case DataType::bfloat16:
      return comm::bfloat16_to_float(static_cast<const uint16_t*>(buf)[i]);
  }
  return 0;
}

namespace {

bool is_integer(DataType t) { return t == DataType::int32 || t == DataType::int64; }

double reduce_ref(DataType t, ReduceOp op, int world, size_t i, int salt) {
  double acc = input_value(0, i, salt);
  for (int r = 1; r < world; ++r) {
    double v = input_value(r, i, salt);
    if (op == ReduceOp::min)
      acc = std::min(acc, v);
    else if (op == ReduceOp::max)
      acc = std::max(acc, v);
    else
      acc += v;
  }
  if (op == ReduceOp::avg) acc = is_integer(t) ? std::trunc(acc / world) : acc / world;
  return acc;
}

bool close(DataType t, ReduceOp op, double got, double want) {
  if (op != ReduceOp::avg || is_integer(t)) return got == want;
  double tol = (t == DataType::float16 || t == DataType::bfloat16) ? 1e-2 : 1e-6;
  return std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want));
}

struct Recorder {
  std::vector<std::string> failures;
  void mismatch(const std::string& what, DataType t, size_t count, size_t i, double got,
                double want) {
    if (failures.size() > 20) return;
    std::ostringstream os;
    os << what << " " << comm::to_string(t) << " count=" << count << ": element " << i << " is "
       << got << ", expected " << want;
    failures.push_back(os.str());
  }
};

void check_allreduce(comm::Communicator& comm, DataType t, ReduceOp op, size_t count, int salt,
                     Recorder& rec) {
  const int W = comm.world_size(), r = comm.rank();
  std::vector<char> buf(count * comm::element_size(t) + 1);
  for (size_t i = 0; i < count; ++i) store(t, buf.data(), i, input_value(r, i, salt));
  comm.allreduce(buf.data(), count, t, op);
  for (size_t i = 0; i < count; ++i) {
    double got = load(t, buf.data(), i), want = reduce_ref(t, op, W, i, salt);
    if (!close(t, op, got, want)) {
      rec.mismatch(std::string("allreduce ") + comm::to_string(op), t, count, i, got, want);
      break;
    }
  }
}

const DataType kTypes[] = {DataType::float32,  DataType::float64, DataType::float16,
                           DataType::bfloat16, DataType::int32,   DataType::int64};
const ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max};

}  // namespace

std::vector<std::string> check_allreduce(comm::Communicator& comm,
                                         const std::vector<size_t>& counts) {
  Recorder rec;
  int salt = 0;
  for (DataType t : kTypes)
    for (size_t count : counts) {
      ++salt;
      for (ReduceOp op : kOps) check_allreduce(comm, t, op, count, salt, rec);
    }
  return rec.failures;
}

std::vector<std::string> check_collectives(comm::Communicator& comm,
                                           const std::vector<size_t>& counts) {
  const int W = comm.world_size(), r = comm.rank();
  Recorder rec;
  int salt = 0;
  for (DataType t : kTypes) {
    const size_t es = comm::element_size(t);
    for (size_t count : counts) {
      ++salt;
      for (ReduceOp op : kOps) {
        check_allreduce(comm, t, op, count, salt, rec);
        // reduce_scatter
        std::vector<char> in(count * es + 1);
        for (size_t i = 0; i < count; ++i) store(t, in.data(), i, input_value(r, i, salt));
        comm::Range mine = comm::block_range(count, W, r);
        std::vector<char> out(mine.size() * es + 1);
        comm.reduce_scatter(in.data(), out.data(), count, t, op);
        for (size_t i = 0; i < mine.size(); ++i) {
          double got = load(t, out.data(), i), want = reduce_ref(t, op, W, mine.begin + i, salt);
          if (!close(t, op, got, want)) {
            rec.mismatch(std::string("reduce_scatter ") + comm::to_string(op), t, count, i, got,
                         want);
            break;
          }
        }
        for (size_t i = 0; i < count; ++i)
          if (load(t, in.data(), i) != input_value(r, i, salt)) {
            rec.mismatch("reduce_scatter modified its input", t, count, i, load(t, in.data(), i),
                         input_value(r, i, salt));
            break;
          }
      }
      // allgather: rank k contributes count elements with value input_value(k, i, salt)
      {
        std::vector<char> in(count * es + 1), out(count * es * W + 1);
        for (size_t i = 0; i < count; ++i) store(t, in.data(), i, input_value(r, i, salt));
        comm.allgather(in.data(), out.data(), count, t);
        for (int k = 0; k < W; ++k)
          for (size_t i = 0; i < count; ++i) {
            double got = load(t, out.data(), k * count + i), want = input_value(k, i, salt);
            if (got != want) {
              rec.mismatch("allgather", t, count, k * count + i, got, want);
              k = W;
              break;
            }
          }
      }
      // allgatherv: rank k contributes (count + k) % (count + 1) elements, some of them 0
      {
        std::vector<size_t> counts_v(static_cast<size_t>(W));
        size_t total = 0;
        for (int k = 0; k < W; ++k) total += counts_v[k] = (count + k * 5) % (count + 1);
        std::vector<char> in(counts_v[r] * es + 1), out(total * es + 1);
        for (size_t i = 0; i < counts_v[r]; ++i) store(t, in.data(), i, input_value(r, i, salt));
        comm.allgatherv(in.data(), out.data(), counts_v, t);
        size_t at = 0;
        for (int k = 0; k < W; ++k)
          for (size_t i = 0; i < counts_v[k]; ++i, ++at) {
            double got = load(t, out.data(), at), want = input_value(k, i, salt);
            if (got != want) {
              rec.mismatch("allgatherv", t, count, at, got, want);
              k = W;
              break;
            }
          }
      }
      // alltoall: block j of rank r's input holds input_value(r * W + j, ...)
      {
        std::vector<char> in(count * es * W + 1), out(count * es * W + 1);
        for (int j = 0; j < W; ++j)
          for (size_t i = 0; i < count; ++i)
            store(t, in.data(), j * count + i, input_value(r * W + j, i, salt));
        comm.alltoall(in.data(), out.data(), count, t);
        for (int j = 0; j < W; ++j)
          for (size_t i = 0; i < count; ++i) {
            double got = load(t, out.data(), j * count + i), want = input_value(j * W + r, i, salt);
            if (got != want) {
              rec.mismatch("alltoall", t, count, j * count + i, got, want);
              j = W;
              break;
            }
          }
      }
      // broadcast from every root
      for (int root = 0; root < W; ++root) {
        std::vector<char> buf(count * es + 1);
        for (size_t i = 0; i < count; ++i) store(t, buf.data(), i, input_value(r, i, salt));
        comm.broadcast(buf.data(), count, t, root);
        for (size_t i = 0; i < count; ++i) {
          double got = load(t, buf.data(), i), want = input_value(root, i, salt);
          if (got != want) {
            rec.mismatch("broadcast from root " + std::to_string(root), t, count, i, got, want);
            break;
          }
        }
      }
    }
  }
  comm.barrier();
  return rec.failures;
}

}  // namespace troupe::test
