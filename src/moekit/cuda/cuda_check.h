// Host-side checks of CUDA runtime and cuBLAS calls: throw moekit::Error with the call and the error.
#pragma once

#include <cuda_runtime.h>

#include "moekit/error.h"

#define MOEKIT_CUDA_CHECK(call)                                                                          \
  do {                                                                                                   \
    const cudaError_t moekit_status_ = (call);                                                           \
    MOEKIT_CHECK(moekit_status_ == cudaSuccess, #call, " failed: ", cudaGetErrorString(moekit_status_)); \
  } while (0)

// After a kernel launch: a bad configuration shows here, not at the next synchronisation.
#define MOEKIT_CUDA_CHECK_LAUNCH() MOEKIT_CUDA_CHECK(cudaGetLastError())
