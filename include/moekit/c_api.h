/* moekit's C ABI: the experts interface (experts.h) for callers that are not C++, such as the Python
 * package (python/moekit, through ctypes). Plain C structs and functions, no C++ type crosses it, so one
 * libmoekit_c.so serves every Python version and every torch build.
 *
 * Every function returns 0 on success and non-zero on failure; moekit_last_error() then holds the message
 * (the same text the C++ API throws, naming what was wrong), per thread. Strings written into caller
 * buffers are truncated to fit and always NUL-terminated.
 *
 * Memory is the caller's: tensors are views (data pointer, shape, strides in elements); the workspace is
 * a block of at least moekit_experts_workspace_bytes() bytes on the problem's device. On CUDA the calls
 * queue work on the given stream (a cudaStream_t; NULL is the legacy default stream) and return without
 * waiting, except the eager backend, which reads per-expert counts back. */
#ifndef MOEKIT_C_API_H
#define MOEKIT_C_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a struct below changes; the Python package refuses a library of another version. */
#define MOEKIT_C_ABI_VERSION 1
#define MOEKIT_C_MAX_DIMS 4

/* Weights whose derived data (the CPU backends' packed copies) should outlive one call: register their
 * memory once and pass the handle with each view of it; call moekit_storage_modified after writing the
 * bytes (an optimizer step) so the derived data is rebuilt. Views without a storage get a fresh one per
 * call, so their weights are packed again each time. */
typedef struct moekit_storage moekit_storage;

typedef struct moekit_tensor {
  void* data; /* NULL: an undefined (absent) tensor, e.g. no bias */
  int32_t ndim;
  int32_t device_type;  /* 0 cpu, 1 cuda */
  int32_t device_index; /* CUDA ordinal */
  int32_t reserved;
  const char* dtype; /* "f32", "f16", "bf16", "i32", "i64", "u8", "f8_e4m3", "f4_e2m1", "ue8m0" */
  int64_t shape[MOEKIT_C_MAX_DIMS];
  int64_t strides[MOEKIT_C_MAX_DIMS]; /* in elements */
  moekit_storage* storage;            /* optional; data must lie inside it */
} moekit_tensor;

/* The fields of moekit::ExpertsProblem and its ExpertsConfig (experts.h, DESIGN §2 and §3). */
typedef struct moekit_experts_problem {
  moekit_tensor hidden_states;
  moekit_tensor top_k_index;
  moekit_tensor top_k_weights;
  moekit_tensor gate_up_proj; /* or up_proj when has_gate == 0 */
  moekit_tensor down_proj;
  moekit_tensor gate_up_proj_bias;
  moekit_tensor down_proj_bias;
  moekit_tensor gate_up_proj_scale_inv;
  moekit_tensor down_proj_scale_inv;
  const char* activation; /* "silu", "gelu", "gelu_pytorch_tanh", "relu", "relu2" */
  int32_t has_gate;
  int32_t has_bias;
  int32_t is_transposed;
  int32_t is_concatenated;
  int32_t has_swiglu_limit; /* GPT-OSS clamped SwiGLU */
  float swiglu_limit;
  float swiglu_alpha;
  int32_t reserved;
  const char* weight_format;     /* "none", "fp8_e4m3", "fp4_e2m1" */
  const char* activation_scheme; /* "dynamic", "static" */
  int64_t block_size;            /* 0: the format's own */
} moekit_experts_problem;

/* The gradients of moekit::ExpertsGradients; each a contiguous view the caller allocated in its input's
 * shape and dtype (biases only with has_bias). */
typedef struct moekit_experts_gradients {
  moekit_tensor hidden_states;
  moekit_tensor top_k_weights;
  moekit_tensor gate_up_proj;
  moekit_tensor down_proj;
  moekit_tensor gate_up_proj_bias;
  moekit_tensor down_proj_bias;
} moekit_experts_gradients;

int moekit_c_abi_version(void);
const char* moekit_last_error(void);

/* The registered backend names, one per line, in registration order. *needed gets the bytes the whole
 * list takes with its NUL. */
int moekit_backend_names(char* buffer, size_t capacity, size_t* needed);
/* *ok = whether the backend runs on this device in this build and machine; reason says why not. */
int moekit_backend_supports_device(const char* backend, int32_t device_type, int32_t device_index, int32_t* ok,
                                   char* reason, size_t capacity);
/* Validates the problem (an error if it breaks the contract) and asks the backend whether it runs it,
 * forward (backward == 0) or backward: *ok and the reason. */
int moekit_experts_supports(const moekit_experts_problem* problem, const char* backend, int32_t backward, int32_t* ok,
                            char* reason, size_t capacity);
int moekit_experts_workspace_bytes(const moekit_experts_problem* problem, const char* backend, int32_t backward,
                                   size_t* bytes);
/* out: [T, H] in the dtype of hidden_states, contiguous, on the problem's device. */
int moekit_experts_forward(const moekit_experts_problem* problem, const char* backend, const moekit_tensor* out,
                           void* workspace, size_t workspace_bytes, void* stream);
/* grad_out: [T, H] in the dtype of hidden_states, contiguous. */
int moekit_experts_backward(const moekit_experts_problem* problem, const char* backend, const moekit_tensor* grad_out,
                            const moekit_experts_gradients* grads, void* workspace, size_t workspace_bytes,
                            void* stream);

/* Activations kept from the forward for the backward (experts.h: experts_forward_saving), for a problem whose
 * backward the backend runs: *saved_bytes what it keeps (0: nothing, its backward recomputes), and the workspaces of
 * the forward that keeps them and of the backward that reads them. */
int moekit_experts_saved_bytes(const moekit_experts_problem* problem, const char* backend, size_t* saved_bytes,
                               size_t* forward_workspace_bytes, size_t* backward_workspace_bytes);
/* The forward of a training step: out, and `saved` (at least *saved_bytes bytes on the problem's device; null
 * where that is 0) written for moekit_experts_backward_saved. */
int moekit_experts_forward_saving(const moekit_experts_problem* problem, const char* backend, const moekit_tensor* out,
                                  void* saved, size_t saved_bytes, void* workspace, size_t workspace_bytes,
                                  void* stream);
/* moekit_experts_backward reading what moekit_experts_forward_saving kept for the same problem and inputs. */
int moekit_experts_backward_saved(const moekit_experts_problem* problem, const char* backend,
                                  const moekit_tensor* grad_out, const moekit_experts_gradients* grads,
                                  const void* saved, size_t saved_bytes, void* workspace, size_t workspace_bytes,
                                  void* stream);

/* [data, data + bytes) on a device, registered so that derived data can be attached to it; the memory
 * stays the caller's. */
int moekit_storage_create(void* data, size_t bytes, int32_t device_type, int32_t device_index,
                          moekit_storage** storage);
int moekit_storage_modified(moekit_storage* storage);
void moekit_storage_release(moekit_storage* storage);

#ifdef __cplusplus
}
#endif

#endif /* MOEKIT_C_API_H */
