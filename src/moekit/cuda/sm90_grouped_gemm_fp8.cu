// The Hopper grouped GEMM with FP8 e4m3 operands and 128 x 128 block scales: the run_projection instantiations of
// the FP8 experts backend (deepgemm) and of the GEMM alone (hopper_grouped_gemm).
#include "moekit/cuda/sm90_projection.cuh"

namespace moekit::cuda::hopper {

// The FP8 experts layer (deepgemm): ungated first projection (float rows, quantised by a separate pass), gated
// first projection quantising its outputs, second projection; the GEMM alone also runs gated with float rows.
template void run_projection<bf16, Epilogue::activation, false, true>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);
template void run_projection<bf16, Epilogue::gated_e4m3, false, true>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);
template void run_projection<bf16, Epilogue::store, false, true>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);
template void run_projection<f16, Epilogue::activation, false, true>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);
template void run_projection<f16, Epilogue::gated_e4m3, false, true>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);
template void run_projection<f16, Epilogue::store, false, true>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);
template void run_projection<bf16, Epilogue::gated, false, true>(const ExpertsArgs&, const int32_t*, const int32_t*, int64_t, const GemmProjection&, cudaStream_t);

}  // namespace moekit::cuda::hopper
