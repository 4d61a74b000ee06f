#pragma once
/// Ranks as threads of one process: every rank a Runtime on its own thread, over the in-process
/// transport, meeting at rank 0's directory on a free local port. What a program runs to try a
/// job without processes (fashion_mnist's "threads" mode), and what troupe's own tests run.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/transport/inproc/transport.h"
#include "rank/runtime.h"

namespace troupe {

/// The options of rank `rank` of a job of `world` ranks that are threads of this process: the
/// in-process transport over `fabric` (shared by the ranks, world_size() == world), rank 0's
/// directory at `port` on this host (pick_free_port(), <troupe/launch.h>), one scheduler thread.
/// Adjust the rest (timeouts, link emulation) before the Runtime starts.
RuntimeOptions thread_rank_options(int rank, int world, int port,
                                   std::shared_ptr<comm::InprocFabric> fabric);

/// Starts a Runtime with each entry of `ranks` on a thread of its own and runs body(i, runtime)
/// there (i: the entry's index). Returns, by entry, what the Runtime or the body threw ("" where
/// nothing), once every thread has ended.
std::vector<std::string> run_thread_ranks(const std::vector<RuntimeOptions>& ranks,
                                          const std::function<void(int, Runtime&)>& body);

}  // namespace troupe
