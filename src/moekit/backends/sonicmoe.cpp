// sonicmoe: the fused routed forward on Hopper: the first GEMM gathers the token rows straight into
// shared memory (no permuted copy), the gated activation is fused into its epilogue, the second GEMM's
// epilogue applies the routing weight, and the combine adds each token's k rows in order.
// CUDA kernels: src/moekit/cuda/hopper_experts.cu.
#include "moekit/backends/builtin_backends.h"
#include "moekit/backends/hopper_backend.h"

namespace moekit::backends {
namespace {

class SonicMoe final : public HopperBackend {
 public:
  SonicMoe() : HopperBackend(MOEKIT_CUDA_HOPPER_KERNELS(sonicmoe)) {}
  std::string_view name() const override { return "sonicmoe"; }
  std::string_view description() const override {
    return "fused routed forward for Hopper: gather in the operand load, activation and routing weight fused; "
           "at decode sizes batched_mm's weight-streaming kernels; backward: the Hopper wgmma backward (gathers in "
           "the operand loads, the activation's backward in an epilogue)";
  }
};

}  // namespace

std::shared_ptr<ExpertsBackend> make_sonicmoe() {
  return std::make_shared<SonicMoe>();
}

}  // namespace moekit::backends
