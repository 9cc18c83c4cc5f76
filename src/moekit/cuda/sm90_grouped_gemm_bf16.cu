// The Hopper grouped GEMM with bf16/f16 operands: the run_projection instantiations of the bf16/f16 experts
// backends (deepgemm, sonicmoe) and of the GEMM alone (hopper_grouped_gemm).
#include "moekit/cuda/sm90_projection.cuh"

namespace moekit::cuda::hopper {

// The experts layer: gated or ungated first projection (deepgemm: TMA rows; sonicmoe: gathered rows), second
// projection; the GEMM alone: store, gated and activation.
template void run_projection<bf16, Epilogue::gated, false, false>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);
template void run_projection<bf16, Epilogue::gated, true, false>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);
template void run_projection<bf16, Epilogue::activation, false, false>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);
template void run_projection<bf16, Epilogue::activation, true, false>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);
template void run_projection<bf16, Epilogue::store, false, false>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);
template void run_projection<f16, Epilogue::gated, false, false>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);
template void run_projection<f16, Epilogue::gated, true, false>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);
template void run_projection<f16, Epilogue::activation, false, false>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);
template void run_projection<f16, Epilogue::activation, true, false>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);
template void run_projection<f16, Epilogue::store, false, false>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);

}  // namespace moekit::cuda::hopper
