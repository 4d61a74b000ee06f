// NcclCommunicator's operations: each checks its arguments (throwing comm::Error naming the bad
// one) and queues the NCCL calls that communicator.cpp's thread enqueues on the stream.
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "comm/reduce.h"
#include "comm/transport/nccl/communicator.h"
#include "comm/transport/nccl/engine.h"
#include "cuda/reduce.h"
#include "cuda/stream.h"

namespace troupe::comm {

namespace {

// A DataType's names in NCCL and in troupe's CUDA kernels.
struct TypeNames {
  DataType type;
  ncclDataType_t nccl;
  cuda::DType cuda;
};

constexpr TypeNames kTypeNames[] = {
    {DataType::float32, ncclFloat32, cuda::DType::float32},
    {DataType::float64, ncclFloat64, cuda::DType::float64},
    {DataType::float16, ncclFloat16, cuda::DType::float16},
    {DataType::bfloat16, ncclBfloat16, cuda::DType::bfloat16},
    {DataType::int32, ncclInt32, cuda::DType::int32},
    {DataType::int64, ncclInt64, cuda::DType::int64},
};

const TypeNames& type_names(DataType type, const std::string& op) {
  for (const TypeNames& names : kTypeNames)
    if (names.type == type) return names;
  throw Error("NCCL " + op + ": data type " + std::to_string(static_cast<int>(type)) +
              " (expected float32, float64, float16, bfloat16, int32 or int64)");
}

bool is_float(DataType type) {
  return type == DataType::float32 || type == DataType::float64 || type == DataType::float16 ||
         type == DataType::bfloat16;
}

ncclRedOp_t nccl_op(ReduceOp op, const std::string& name) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclAvg;
    case ReduceOp::min:
      return ncclMin;
    case ReduceOp::max:
      return ncclMax;
  }
  throw Error("NCCL " + name + ": reduce op " + std::to_string(static_cast<int>(op)) +
              " (expected sum, avg, min or max)");
}

std::string address(const void* p) {
  char text[32];
  std::snprintf(text, sizeof(text), "%p", p);
  return text;
}

/// The checks every operation shares: its buffers are device memory of the communicator's
/// device (a null pointer only with nothing to move), its ready events are not null.
class Check {
 public:
  Check(const NcclCommunicator::Impl& impl, std::string op) : impl_(impl), op_(std::move(op)) {}

  void buffer(const void* p, size_t count, const std::string& name) const {
    if (count == 0) return;
    if (p == nullptr)
      throw Error("NCCL " + op_ + ": " + name + " is null with " + std::to_string(count) +
                  " elements (expected device memory of device " + std::to_string(impl_.device) +
                  ")");
    const int device = cuda::device_of(p);
    if (device != impl_.device)
      throw Error(
          "NCCL " + op_ + ": " + name + " at " + address(p) + " is " +
          (device < 0 ? std::string("host memory") : "on device " + std::to_string(device)) +
          " (expected device memory of device " + std::to_string(impl_.device) +
          ", the communicator's)");
  }
  void peer(int p, const std::string& name) const {
    if (p < 0 || p >= impl_.world)
      throw Error("NCCL " + op_ + ": " + name + " " + std::to_string(p) +
                  " (expected 0 <= " + name + " < " + std::to_string(impl_.world) + ")");
  }
  void ready(const ReadyEvents& events) const {
    for (size_t i = 0; i < events.size(); ++i)
      if (events[i] == nullptr)
        throw Error("NCCL " + op_ + ": ready event " + std::to_string(i) +
                    " is null (expected CUDA events recorded where the inputs are ready)");
  }

 private:
  const NcclCommunicator::Impl& impl_;
  std::string op_;
};

std::string describe(const char* op, size_t count, DataType type) {
  return std::string(op) + " of " + std::to_string(count) + " " + to_string(type);
}

// An operation that waits on `ready` and reports to `done`; issue/after are set by the caller.
NcclOperation named(const std::string& name, const ReadyEvents& ready, Callback done) {
  NcclOperation operation;
  operation.name = name;
  operation.ready = ready;
  operation.done = std::move(done);
  return operation;
}

// Integer averages sum, then divide truncating toward zero, as the CPU's avg does: returns the
// operator NCCL runs and, for an integer avg, makes `operation` divide `out` afterwards.
ncclRedOp_t with_integer_average(ReduceOp op, ncclRedOp_t o, DataType type, void* out, size_t count,
                                 int world, NcclOperation& operation) {
  if (op != ReduceOp::avg || is_float(type)) return o;
  const cuda::DType ct = type_names(type, operation.name).cuda;
  operation.after = [=](ncclComm_t, cudaStream_t stream) {
    cuda::divide(out, count, ct, world, stream);
  };
  return ncclSum;
}

/// A buffer an operation checks: `count` elements of device memory, `name`d in its errors.
struct Buffer {
  const void* data;
  size_t count;
  const char* name;
};

/// allreduce, broadcast, allgather, reduce_scatter and alltoall: one NCCL call (or group) between
/// buffers, as submit() checks and queues it.
struct Collective {
  Collective(std::string name, DataType type, std::optional<ReduceOp> op = std::nullopt,
             std::optional<int> root = std::nullopt)
      : name(std::move(name)), type(type), op(op), root(root) {}

  std::string name;  // describe()'s; a reduction's operator is added to it
  DataType type;
  std::optional<ReduceOp> op;  // a reduction's; an integer avg sums, then divides its result
  std::optional<int> root;     // broadcast's
};

/// Enqueues a collective's NCCL calls, given its NCCL data type and (a reduction's) operator.
using Call = std::function<ncclResult_t(ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t)>;

// Checks the collective's arguments and `buffers`, in order (comm::Error naming the bad one,
// nothing queued), and queues `call` on `impl`'s thread: it moves `count` elements per rank (0:
// nothing to issue, the operation completes in order), its result in the last buffer.
void submit(NcclCommunicator::Impl& impl, Collective c, const std::vector<Buffer>& buffers,
            size_t count, const ReadyEvents& ready, Callback done, Call call) {
  const ncclDataType_t t = type_names(c.type, c.name).nccl;
  ncclRedOp_t o = ncclSum;
  if (c.op) {
    o = nccl_op(*c.op, c.name);
    c.name += std::string(" (") + to_string(*c.op) + ")";
  }
  Check check(impl, c.name);
  if (c.root) check.peer(*c.root, "root");
  for (const Buffer& b : buffers) check.buffer(b.data, b.count, b.name);
  check.ready(ready);
  NcclOperation operation = named(c.name, ready, std::move(done));
  if (count > 0) {
    void* out = const_cast<void*>(buffers.back().data);
    if (c.op) o = with_integer_average(*c.op, o, c.type, out, count, impl.world, operation);
    operation.issue = [call = std::move(call), t, o](ncclComm_t comm, cudaStream_t stream) {
      return call(t, o, comm, stream);
    };
  }
  impl.submit(std::move(operation));
}

}  // namespace

void NcclCommunicator::allreduce(const void* in, void* out, size_t count, DataType type,
                                 ReduceOp op, const ReadyEvents& ready, Callback done) {
  submit(*impl_, {describe("allreduce", count, type), type, op},
         {{in, count, "input"}, {out, count, "output"}}, count, ready, std::move(done),
         [=](ncclDataType_t t, ncclRedOp_t o, ncclComm_t comm, cudaStream_t stream) {
           return nccl_library().AllReduce(in, out, count, t, o, comm, stream);
         });
}

void NcclCommunicator::allreduce_scaled(const void* in, void* out, size_t count, DataType type,
                                        double scale, const ReadyEvents& ready, Callback done) {
  const std::string name =
      describe("allreduce", count, type) + " (sum of " + number_text(scale) + " x)";
  const ncclDataType_t t = type_names(type, name).nccl;
  if (!is_float(type))
    throw Error("NCCL " + name + ": a scaled sum needs a float type (got " + to_string(type) + ")");
  if (!(scale == scale) || scale == 1.0 / 0.0 || scale == -1.0 / 0.0)
    throw Error("NCCL " + name + ": scale " + number_text(scale) + " (expected a finite number)");
  Check check(*impl_, name);
  check.buffer(in, count, "input");
  check.buffer(out, count, "output");
  check.ready(ready);
  NcclOperation operation = named(name, ready, std::move(done));
  if (count > 0) {
    auto op = std::make_shared<ncclRedOp_t>(ncclSum);
    auto created = std::make_shared<bool>(false);
    operation.issue = [=](ncclComm_t comm, cudaStream_t stream) {
      // The scalar, in the buffer's type, is read before ncclRedOpCreatePreMulSum returns.
      float f = static_cast<float>(scale);
      uint16_t h = type == DataType::float16 ? float_to_half(f) : float_to_bfloat16(f);
      void* scalar = type == DataType::float64   ? static_cast<void*>(const_cast<double*>(&scale))
                     : type == DataType::float32 ? static_cast<void*>(&f)
                                                 : static_cast<void*>(&h);
      ncclResult_t r =
          nccl_library().RedOpCreatePreMulSum(op.get(), scalar, t, ncclScalarHostImmediate, comm);
      if (r != ncclSuccess) return r;
      *created = true;
      return nccl_library().AllReduce(in, out, count, t, *op, comm, stream);
    };
    operation.after = [=](ncclComm_t comm, cudaStream_t) {
      if (*created) nccl_library().RedOpDestroy(*op, comm);
    };
  }
  impl_->submit(std::move(operation));
}

void NcclCommunicator::broadcast(void* data, size_t count, DataType type, int root,
                                 const ReadyEvents& ready, Callback done) {
  const std::string name =
      describe("broadcast", count, type) + " from rank " + std::to_string(root);
  submit(*impl_, {name, type, std::nullopt, root}, {{data, count, "data"}}, count, ready,
         std::move(done), [=](ncclDataType_t t, ncclRedOp_t, ncclComm_t comm, cudaStream_t stream) {
           return nccl_library().Broadcast(data, data, count, t, root, comm, stream);
         });
}

void NcclCommunicator::allgather(const void* in, void* out, size_t count_per_rank, DataType type,
                                 const ReadyEvents& ready, Callback done) {
  const size_t total = count_per_rank * static_cast<size_t>(impl_->world);
  submit(*impl_, {describe("allgather", count_per_rank, type) + " per rank", type},
         {{in, count_per_rank, "input"}, {out, total, "output"}}, count_per_rank, ready,
         std::move(done), [=](ncclDataType_t t, ncclRedOp_t, ncclComm_t comm, cudaStream_t stream) {
           return nccl_library().AllGather(in, out, count_per_rank, t, comm, stream);
         });
}

void NcclCommunicator::reduce_scatter(const void* in, void* out, size_t count_per_rank,
                                      DataType type, ReduceOp op, const ReadyEvents& ready,
                                      Callback done) {
  const size_t total = count_per_rank * static_cast<size_t>(impl_->world);
  submit(*impl_, {describe("reduce_scatter", count_per_rank, type) + " per rank", type, op},
         {{in, total, "input"}, {out, count_per_rank, "output"}}, count_per_rank, ready,
         std::move(done),
         [=](ncclDataType_t t, ncclRedOp_t o, ncclComm_t comm, cudaStream_t stream) {
           return nccl_library().ReduceScatter(in, out, count_per_rank, t, o, comm, stream);
         });
}

void NcclCommunicator::alltoall(const void* in, void* out, size_t count_per_rank, DataType type,
                                const ReadyEvents& ready, Callback done) {
  const int world = impl_->world;
  const size_t total = count_per_rank * static_cast<size_t>(world);
  submit(*impl_, {describe("alltoall", count_per_rank, type) + " per rank", type},
         {{in, total, "input"}, {out, total, "output"}}, count_per_rank, ready, std::move(done),
         [=](ncclDataType_t t, ncclRedOp_t, ncclComm_t comm, cudaStream_t stream) {
           const size_t block = count_per_rank * element_size(type);
           ncclResult_t r = nccl_library().GroupStart();
           if (r != ncclSuccess) return r;
           for (int peer = 0; peer < world; ++peer) {
             const auto offset = static_cast<size_t>(peer) * block;
             ncclResult_t s = nccl_library().Send(static_cast<const char*>(in) + offset,
                                                  count_per_rank, t, peer, comm, stream);
             if (s == ncclSuccess)
               s = nccl_library().Recv(static_cast<char*>(out) + offset, count_per_rank, t, peer,
                                       comm, stream);
             if (s != ncclSuccess) {
               nccl_library().GroupEnd();
               return s;
             }
           }
           return nccl_library().GroupEnd();
         });
}

void NcclCommunicator::exchange(const void* send, size_t count, DataType type,
                                const std::vector<int>& send_to, const std::vector<int>& recv_from,
                                const std::vector<void*>& recv_buffers, const ReadyEvents& ready,
                                Callback done) {
  const std::string name = describe("exchange", count, type) + " with " +
                           std::to_string(send_to.size()) + " + " +
                           std::to_string(recv_from.size()) + " peers";
  const ncclDataType_t t = type_names(type, name).nccl;
  Check check(*impl_, name);
  if (recv_buffers.size() != recv_from.size())
    throw Error("NCCL " + name + ": " + std::to_string(recv_buffers.size()) +
                " receive buffers for " + std::to_string(recv_from.size()) +
                " peers (expected one per peer of recv_from)");
  for (const auto* list : {&send_to, &recv_from}) {
    const std::string what = list == &send_to ? "send_to peer" : "recv_from peer";
    std::set<int> seen;
    for (int p : *list) {
      check.peer(p, what);
      if (p == impl_->rank)
        throw Error("NCCL " + name + ": " + what + " " + std::to_string(p) +
                    " is this rank (expected other ranks)");
      if (!seen.insert(p).second)
        throw Error("NCCL " + name + ": " + what + " " + std::to_string(p) +
                    " appears twice (expected distinct peers)");
    }
  }
  if (!send_to.empty()) check.buffer(send, count, "send buffer");
  for (size_t i = 0; i < recv_buffers.size(); ++i)
    check.buffer(recv_buffers[i], count, "receive buffer " + std::to_string(i));
  check.ready(ready);
  NcclOperation operation = named(name, ready, std::move(done));
  if (count > 0 && (!send_to.empty() || !recv_from.empty()))
    operation.issue = [=](ncclComm_t comm, cudaStream_t stream) {
      ncclResult_t r = nccl_library().GroupStart();
      if (r != ncclSuccess) return r;
      for (int peer : send_to)
        if ((r = nccl_library().Send(send, count, t, peer, comm, stream)) != ncclSuccess) break;
      for (size_t i = 0; r == ncclSuccess && i < recv_from.size(); ++i)
        r = nccl_library().Recv(recv_buffers[i], count, t, recv_from[i], comm, stream);
      const ncclResult_t end = nccl_library().GroupEnd();
      return r != ncclSuccess ? r : end;
    };
  impl_->submit(std::move(operation));
}

}  // namespace troupe::comm
