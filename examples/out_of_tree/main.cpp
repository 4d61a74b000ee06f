// Out-of-tree consumer: find_package(troupe), one Runtime, one allreduce of a float. It includes
// only the umbrella header of the public API, as an installed troupe's users do.
#include <cstdio>
#include <exception>

#include <troupe/troupe.h>

int main() {
  try {
    // No launcher in the environment: rank 0 of a world of 1 (under `troupe launch -n N`, torchrun,
    // mpirun or srun: one rank of N). UCX transport, the default.
    troupe::Runtime rt;
    const float input = 2.5f;
    float value = input;
    rt.comm().allreduce(&value, 1, troupe::comm::DataType::float32, troupe::comm::ReduceOp::avg);
    std::printf("rank %d of %d: allreduce(avg) of %g = %g\n", rt.rank(), rt.world_size(), input,
                value);
    return value == input ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "app: %s\n", e.what());
    return 1;
  }
}
