#include "moekit/backends/cpu_routing.h"

namespace moekit::cpu {

ExpertRouting route_by_expert(const Tensor& top_k_index, int64_t experts) {
  ExpertRouting r;
  r.tokens = top_k_index.size(0);
  r.top_k = top_k_index.size(1);
  r.experts = experts;
  const int64_t pairs = r.tokens * r.top_k;
  std::vector<int64_t> ids(static_cast<std::size_t>(pairs));
  visit_index_dtype(top_k_index.dtype(), [&](auto tag) {
    using I = typename decltype(tag)::type;
    const I* p = static_cast<const I*>(top_k_index.data());
    for (int64_t i = 0; i < pairs; ++i) {
      MOEKIT_CHECK(p[i] >= 0, "top_k_index[", i / r.top_k, ", ", i % r.top_k, "] = ", static_cast<int64_t>(p[i]),
                   " is negative; ids must be in [0, E) or >= E for an expert-parallel sentinel");
      ids[static_cast<std::size_t>(i)] = static_cast<int64_t>(p[i]);
    }
  });
  r.offsets.assign(static_cast<std::size_t>(experts + 1), 0);
  for (int64_t id : ids)
    if (id < experts) ++r.offsets[static_cast<std::size_t>(id + 1)];
  for (int64_t e = 0; e < experts; ++e) r.offsets[e + 1] += r.offsets[e];
  const int64_t rows = r.offsets[experts];
  r.row_token.resize(static_cast<std::size_t>(rows));
  r.row_pair.resize(static_cast<std::size_t>(rows));
  r.pair_row.assign(static_cast<std::size_t>(pairs), -1);
  std::vector<int64_t> cursor(r.offsets.begin(), r.offsets.end() - 1);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t id = ids[static_cast<std::size_t>(i)];
    if (id >= experts) continue;
    const int64_t row = cursor[static_cast<std::size_t>(id)]++;
    r.row_token[static_cast<std::size_t>(row)] = i / r.top_k;
    r.row_pair[static_cast<std::size_t>(row)] = i;
    r.pair_row[static_cast<std::size_t>(i)] = row;
  }
  return r;
}

}  // namespace moekit::cpu
