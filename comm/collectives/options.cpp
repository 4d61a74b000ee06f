#include <algorithm>
#include <functional>

#include "comm/collectives/collectives.h"

namespace troupe::comm {

CollectiveOptions for_layout(CollectiveOptions options, const std::vector<int>& real_hosts) {
  if (options.chunk_bytes == 0) {
    const bool across_hosts = std::adjacent_find(real_hosts.begin(), real_hosts.end(),
                                                 std::not_equal_to<int>()) != real_hosts.end();
    options.chunk_bytes = across_hosts ? kChunkBytesAcrossHosts : kChunkBytesOneHost;
  }
  return options;
}

}  // namespace troupe::comm
