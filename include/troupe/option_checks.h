#pragma once
/// Option checks of a command-line program, shared by the `troupe` tool and the examples: CLI11
/// validators whose messages name the flag, the value and what is allowed (number_above,
/// number_at_least, number_in, integer_in), byte sizes with units (parse_byte_size), and the
/// check that a size fits in this host's memory.
///
///   app.add_option("--lr", lr, "Learning rate")->check(troupe::cli::number_above(0));
///   // program: --lr: nan is not a finite number (expected a number > 0)
///
/// Header-only, on CLI11 (CLI::Validator), which the program brings itself (find_package(CLI11),
/// CLI11::CLI11): troupe's package does not. So troupe.h does not include it.
#include "tools/cli/option_checks.h"
