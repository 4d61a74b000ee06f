// NcclCommunicator's operations: each checks its arguments (throwing comm::Error naming the bad
// one) and queues the NCCL calls that communicator.cpp's thread enqueues on the stream.
#include <cstdint>
#include <cstdio>
#include <set>

#include "comm/reduce.h"
#include "comm/transport/nccl/communicator.h"
#include "comm/transport/nccl/engine.h"
#include "cuda/reduce.h"
#include "cuda/stream.h"

namespace troupe::comm {

namespace {

ncclDataType_t nccl_type(DataType type, const std::string& op) {
  switch (type) {
    case DataType::float32:
      return ncclFloat32;
    case DataType::float64:
      return ncclFloat64;
    case DataType::float16:
      return ncclFloat16;
    case DataType::bfloat16:
      return ncclBfloat16;
    case DataType::int32:
      return ncclInt32;
    case DataType::int64:
      return ncclInt64;
  }
  throw Error("NCCL " + op + ": data type " + std::to_string(static_cast<int>(type)) +
              " (expected float32, float64, float16, bfloat16, int32 or int64)");
}

bool is_float(DataType type) {
  return type == DataType::float32 || type == DataType::float64 || type == DataType::float16 ||
         type == DataType::bfloat16;
}

cuda::DType cuda_type(DataType type) {
  switch (type) {
    case DataType::float32:
      return cuda::DType::float32;
    case DataType::float64:
      return cuda::DType::float64;
    case DataType::float16:
      return cuda::DType::float16;
    case DataType::bfloat16:
      return cuda::DType::bfloat16;
    case DataType::int32:
      return cuda::DType::int32;
    case DataType::int64:
      return cuda::DType::int64;
  }
  return cuda::DType::float32;  // checked by nccl_type before
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
  const cuda::DType ct = cuda_type(type);
  operation.after = [=](ncclComm_t, cudaStream_t stream) {
    cuda::divide(out, count, ct, world, stream);
  };
  return ncclSum;
}

}  // namespace

void NcclCommunicator::allreduce(const void* in, void* out, size_t count, DataType type,
                                 ReduceOp op, const ReadyEvents& ready, Callback done) {
  std::string name = describe("allreduce", count, type);
  const ncclDataType_t t = nccl_type(type, name);
  ncclRedOp_t o = nccl_op(op, name);
  name += std::string(" (") + to_string(op) + ")";
  Check check(*impl_, name);
  check.buffer(in, count, "input");
  check.buffer(out, count, "output");
  check.ready(ready);
  NcclOperation operation = named(name, ready, std::move(done));
  if (count > 0) {
    o = with_integer_average(op, o, type, out, count, impl_->world, operation);
    operation.issue = [=](ncclComm_t comm, cudaStream_t stream) {
      return nccl_library().AllReduce(in, out, count, t, o, comm, stream);
    };
  }
  impl_->submit(std::move(operation));
}

void NcclCommunicator::allreduce_scaled(const void* in, void* out, size_t count, DataType type,
                                        double scale, const ReadyEvents& ready, Callback done) {
  const std::string name =
      describe("allreduce", count, type) + " (sum of " + number_text(scale) + " x)";
  const ncclDataType_t t = nccl_type(type, name);
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
  const ncclDataType_t t = nccl_type(type, name);
  Check check(*impl_, name);
  check.peer(root, "root");
  check.buffer(data, count, "data");
  check.ready(ready);
  NcclOperation operation = named(name, ready, std::move(done));
  if (count > 0)
    operation.issue = [=](ncclComm_t comm, cudaStream_t stream) {
      return nccl_library().Broadcast(data, data, count, t, root, comm, stream);
    };
  impl_->submit(std::move(operation));
}

void NcclCommunicator::allgather(const void* in, void* out, size_t count_per_rank, DataType type,
                                 const ReadyEvents& ready, Callback done) {
  const std::string name = describe("allgather", count_per_rank, type) + " per rank";
  const ncclDataType_t t = nccl_type(type, name);
  Check check(*impl_, name);
  check.buffer(in, count_per_rank, "input");
  check.buffer(out, count_per_rank * static_cast<size_t>(impl_->world), "output");
  check.ready(ready);
  NcclOperation operation = named(name, ready, std::move(done));
  if (count_per_rank > 0)
    operation.issue = [=](ncclComm_t comm, cudaStream_t stream) {
      return nccl_library().AllGather(in, out, count_per_rank, t, comm, stream);
    };
  impl_->submit(std::move(operation));
}

void NcclCommunicator::reduce_scatter(const void* in, void* out, size_t count_per_rank,
                                      DataType type, ReduceOp op, const ReadyEvents& ready,
                                      Callback done) {
  std::string name = describe("reduce_scatter", count_per_rank, type) + " per rank";
  const ncclDataType_t t = nccl_type(type, name);
  ncclRedOp_t o = nccl_op(op, name);
  name += std::string(" (") + to_string(op) + ")";
  Check check(*impl_, name);
  check.buffer(in, count_per_rank * static_cast<size_t>(impl_->world), "input");
  check.buffer(out, count_per_rank, "output");
  check.ready(ready);
  NcclOperation operation = named(name, ready, std::move(done));
  if (count_per_rank > 0) {
    o = with_integer_average(op, o, type, out, count_per_rank, impl_->world, operation);
    operation.issue = [=](ncclComm_t comm, cudaStream_t stream) {
      return nccl_library().ReduceScatter(in, out, count_per_rank, t, o, comm, stream);
    };
  }
  impl_->submit(std::move(operation));
}

void NcclCommunicator::alltoall(const void* in, void* out, size_t count_per_rank, DataType type,
                                const ReadyEvents& ready, Callback done) {
  const std::string name = describe("alltoall", count_per_rank, type) + " per rank";
  const ncclDataType_t t = nccl_type(type, name);
  const size_t total = count_per_rank * static_cast<size_t>(impl_->world);
  Check check(*impl_, name);
  check.buffer(in, total, "input");
  check.buffer(out, total, "output");
  check.ready(ready);
  NcclOperation operation = named(name, ready, std::move(done));
  if (count_per_rank > 0) {
    const int world = impl_->world;
    const size_t block = count_per_rank * element_size(type);
    operation.issue = [=](ncclComm_t comm, cudaStream_t stream) {
      ncclResult_t r = nccl_library().GroupStart();
      if (r != ncclSuccess) return r;
      for (int peer = 0; peer < world; ++peer) {
        const auto offset = static_cast<size_t>(peer) * block;
        ncclResult_t s = nccl_library().Send(static_cast<const char*>(in) + offset, count_per_rank,
                                             t, peer, comm, stream);
        if (s == ncclSuccess)
          s = nccl_library().Recv(static_cast<char*>(out) + offset, count_per_rank, t, peer, comm,
                                  stream);
        if (s != ncclSuccess) {
          nccl_library().GroupEnd();
          return s;
        }
      }
      return nccl_library().GroupEnd();
    };
  }
  impl_->submit(std::move(operation));
}

void NcclCommunicator::exchange(const void* send, size_t count, DataType type,
                                const std::vector<int>& send_to, const std::vector<int>& recv_from,
                                const std::vector<void*>& recv_buffers, const ReadyEvents& ready,
                                Callback done) {
  const std::string name = describe("exchange", count, type) + " with " +
                           std::to_string(send_to.size()) + " + " +
                           std::to_string(recv_from.size()) + " peers";
  const ncclDataType_t t = nccl_type(type, name);
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
