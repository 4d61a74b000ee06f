#pragma once
/// One interface for every algorithm: DataParallel and make_data_parallel, the decentralized and
/// asynchronous modules (DecentralizedModule, AsynchronousModule, GossipOptions) and ModelSwitch,
/// which changes algorithm during training.
#include "runtime/data_parallel.h"
#include "runtime/gossip/decentralized.h"
#include "runtime/model_switch.h"
