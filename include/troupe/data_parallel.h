#pragma once
/// One interface for every algorithm: DataParallel and make_data_parallel, the decentralized and
/// asynchronous modules (DecentralizedModule, AsynchronousModule, GossipOptions) and ModelSwitch,
/// which changes algorithm during training.
#include "algorithms/gossip/decentralized.h"
#include "algorithms/model_switch.h"
#include "algorithms/registry.h"
