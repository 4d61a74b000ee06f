#pragma once
/// keep_group_options: what a troupe optimizer's constructor calls so that each param group keeps
/// the options its caller gave it.
///
/// LibTorch 2.x's Optimizer::add_param_group merges a group's own options into the defaults only
/// for LibTorch's own optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, LBFGS); a group of any other
/// optimizer gets a copy of the defaults, and its own options are dropped without a word (a
/// SignSGD group given lr 0.5 stepped with the default 0.1). LibTorch 1.13 kept them.
#include <torch/optim/optimizer.h>

#include <vector>

namespace troupe::optim {

/// Sets each group of `groups` (an optimizer's param_groups_ after the base constructor) to the
/// options of the same group of `given` (what the caller passed), where that one had its own.
inline void keep_group_options(std::vector<torch::optim::OptimizerParamGroup>& groups,
                               const std::vector<torch::optim::OptimizerParamGroup>& given) {
  for (size_t i = 0; i < groups.size() && i < given.size(); ++i)
    if (given[i].has_options()) groups[i].set_options(given[i].options().clone());
}

}  // namespace troupe::optim
