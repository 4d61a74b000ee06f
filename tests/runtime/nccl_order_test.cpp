// NcclOrder: the NCCL reductions of a module's buckets are issued in bucket order whatever
// order the buckets fill in (NCCL matches operations by issue order), round after round, and a
// failure lets every waiting bucket through at once.
#include <doctest/doctest.h>

#include <future>
#include <thread>
#include <vector>

#include "ddp/gradient_path/nccl_order.h"

using troupe::NcclOrder;

TEST_CASE("buckets that fill out of order are issued in bucket order, round after round") {
  NcclOrder order(3);
  std::vector<int> issued;
  for (int round = 0; round < 2; ++round) {
    order.submit(2, [&] { issued.push_back(2); });
    CHECK(issued.size() == static_cast<size_t>(3 * round));  // bucket 2 waits for 0 and 1
    order.submit(0, [&] { issued.push_back(0); });
    CHECK(issued.size() == static_cast<size_t>(3 * round + 1));  // 0 goes, 2 still waits for 1
    order.submit(1, [&] { issued.push_back(1); });
  }
  CHECK(issued == std::vector<int>{0, 1, 2, 0, 1, 2});
}

TEST_CASE("buckets submitted from several threads are issued in bucket order") {
  const int buckets = 16;
  NcclOrder order(buckets);
  std::vector<int> issued;  // written only inside submit, which serialises the issues
  std::vector<std::future<void>> threads;
  for (int b = buckets - 1; b >= 0; --b)
    threads.push_back(std::async(
        std::launch::async, [&, b] { order.submit(b, [&issued, b] { issued.push_back(b); }); }));
  for (auto& t : threads) t.get();
  REQUIRE(issued.size() == static_cast<size_t>(buckets));
  for (int b = 0; b < buckets; ++b) CHECK(issued[static_cast<size_t>(b)] == b);
}

TEST_CASE("after a failure, waiting buckets and later ones are issued at once") {
  NcclOrder order(4);
  std::vector<int> issued;
  order.submit(3, [&] { issued.push_back(3); });
  order.submit(2, [&] { issued.push_back(2); });
  CHECK(issued.empty());  // both wait for buckets 0 and 1
  order.release();
  CHECK(issued.size() == 2);
  order.submit(1, [&] { issued.push_back(1); });
  CHECK(issued.size() == 3);  // no waiting any more: the communicator is aborted anyway
}
