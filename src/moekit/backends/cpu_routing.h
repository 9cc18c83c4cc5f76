// Routing on the CPU: the (token, slot) pairs sorted by expert with a stable counting sort.
#pragma once

#include <cstdint>
#include <vector>

#include "moekit/tensor.h"

namespace moekit::cpu {

struct ExpertRouting {
  int64_t tokens = 0, top_k = 0, experts = 0;
  std::vector<int64_t> offsets;    // [E + 1]: rows of expert e are [offsets[e], offsets[e + 1])
  std::vector<int64_t> row_token;  // [rows]: the token each sorted row belongs to
  std::vector<int64_t> row_pair;   // [rows]: t * K + k of each sorted row
  std::vector<int64_t> pair_row;   // [T * K]: the sorted row of pair (t, k); -1 for a sentinel

  int64_t rows() const { return static_cast<int64_t>(row_token.size()); }
  int64_t rows_of(int64_t e) const { return offsets[e + 1] - offsets[e]; }
};

// ids [T, K] (i32 or i64, CPU). Ids >= experts are sentinels (dropped); negative ids throw, naming
// the token and slot.
ExpertRouting route_by_expert(const Tensor& top_k_index, int64_t experts);

}  // namespace moekit::cpu
