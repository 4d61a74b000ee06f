// Not a test program: the ctest compile.no_sync_discarded builds this file and expects the
// compiler to refuse it (-Werror=unused-result): `ddp.no_sync();` drops the guard at the
// semicolon, so it would accumulate nothing, and [[nodiscard]] makes that a warning.
#include "ddp/distributed_module.h"

void discards_the_guard(troupe::DistributedModule& ddp) { ddp.no_sync(); }
