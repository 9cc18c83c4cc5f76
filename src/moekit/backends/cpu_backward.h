// The experts backward on the CPU (DESIGN §2b), shared by eager, batched_mm and grouped_mm: pairs sorted by
// expert, then per hit expert its forward's first projection recomputed and six products on its rows with
// oneDNN (all threads inside each product), weights read where they lie. Nothing is saved by the forward.
//
// Per expert e with sorted rows X [n, H] (inputs), D [n, H] (grad_out rows) and routing weights w [n]:
//   Z = X W1^T + b1            [n, N]   recomputed
//   G = D W2                   [n, I]   grad_w = rowdot(G, act(Z)) + rowdot(D, b2)
//   dZ = act'(Z) (w G)         [n, N]
//   dW2 = D^T (w act(Z))       [H, I],  db2 = sum_r w D
//   dW1 = dZ^T X               [N, H],  db1 = sum_r dZ
//   dX = dZ W1                 [n, H],  grad_x[t] = sum_k dX[row(t, k)] in k order
// Sums over rows run inside one product or in row order, so results do not depend on thread timing.
#pragma once

#include <cstddef>

#include "moekit/experts.h"

namespace moekit::cpu {

std::size_t sorted_backward_workspace_bytes(const ExpertsProblem& p);
// grads hold every gradient, allocated in their inputs' shapes and dtypes (experts_backward checked them).
void sorted_backward(const ExpertsProblem& p, const Tensor& grad_out, ExpertsGradients& grads, void* workspace);

}  // namespace moekit::cpu
