// deepgemm: DeepGEMM's contiguous layout on Hopper: token rows copied (FP8: quantised) into
// per-expert blocks padded to 128, then two TMA + wgmma grouped GEMMs (activation fused into the
// first) and the weighted combine. At decode sizes (few pairs, about one per expert: hopper_decode_streams)
// it runs batched_mm's weight-streaming kernels instead. CUDA kernels: src/moekit/cuda/hopper_experts.cu.
#include "moekit/backends/builtin_backends.h"
#include "moekit/backends/hopper_backend.h"

namespace moekit::backends {
namespace {

class DeepGemm final : public HopperBackend {
 public:
  DeepGemm() : HopperBackend(MOEKIT_CUDA_HOPPER_KERNELS(deepgemm)) {}
  std::string_view name() const override { return "deepgemm"; }
  std::string_view description() const override {
    return "TMA + wgmma grouped GEMM for Hopper (sm_90a), rows padded per expert to 128, activation fused; bf16 "
           "and FP8 block-scaled experts; at decode sizes batched_mm's weight-streaming kernels; backward (bf16/f16): "
           "the Hopper wgmma backward sonicmoe runs";
  }

 protected:
  bool runs_fp8() const override { return true; }
};

}  // namespace

std::shared_ptr<ExpertsBackend> make_deepgemm() {
  return std::make_shared<DeepGemm>();
}

}  // namespace moekit::backends
