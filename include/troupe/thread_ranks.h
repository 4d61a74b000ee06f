#pragma once
/// Ranks as threads of one process, over the in-process transport (thread_rank_options,
/// run_thread_ranks).
#include "elastic/thread_ranks.h"
