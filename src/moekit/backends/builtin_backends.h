// Factories of the built-in backends, one per file in this folder; registry.cpp is the only place
// that lists them.
#pragma once

#include <memory>

#include "moekit/experts.h"

namespace moekit::backends {

std::shared_ptr<ExpertsBackend> make_eager();
std::shared_ptr<ExpertsBackend> make_batched_mm();
std::shared_ptr<ExpertsBackend> make_grouped_mm();
std::shared_ptr<ExpertsBackend> make_deepgemm();
std::shared_ptr<ExpertsBackend> make_deepgemm_megamoe();
std::shared_ptr<ExpertsBackend> make_sonicmoe();

}  // namespace moekit::backends
