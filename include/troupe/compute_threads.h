#pragma once
/// The threads a rank computes with: set_compute_threads (torch's and OpenBLAS's), and what a
/// launcher gives the ranks of a host (compute_threads).
#include "rank/compute_threads.h"
