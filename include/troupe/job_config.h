#pragma once
/// Job files: a training job described in TOML, as `troupe run job.toml` reads it (JobConfig,
/// load_job_config, parse_job_config): the world size, whether the ranks are threads of one
/// process or processes, the algorithm and its topology, the trainer's settings and the link
/// emulation. Every mistake is an error naming the file, the key, the value and what is allowed.
/// examples/configs/ holds job files to start from; the schema is in the header below.
#include "tools/job_config.h"
