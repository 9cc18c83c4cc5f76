// Routing on the device (cuda/routing.cuh) against the same routing worked out on the host: per-expert row and
// tile offsets, the stable sort of (token, slot) pairs by expert with invalid and sentinel ids last, and its
// inverse. Expert counts from a handful to past the per-block shared-memory counts (12,288 experts and more take
// global atomics), pair counts up to the SonicMoE paper shape's 196,608, int32 and int64 ids. Needs a CUDA device;
// skips elsewhere.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "harness.h"
#include "moekit/cuda/routing.cuh"
#include "moekit/device.h"
#include "moekit/tensor.h"

namespace moekit {
namespace {

struct RoutingCase {
  const char* name;
  int64_t tokens, top_k, experts;
  int tile_rows;
  DType index_dtype;
  double invalid_fraction;  // of the pairs, with id -1 or E (either sorts last, with no row)
  int64_t used_experts;     // ids drawn from [0, used_experts): the rest receive no pair
};

class RoutingCuda : public ::testing::TestWithParam<RoutingCase> {};

std::vector<int32_t> host_ints(const Tensor& t) {
  synchronize(Device::cuda());
  const Tensor h = t.to(Device::cpu());
  return {h.data_as<int32_t>(), h.data_as<int32_t>() + h.numel()};
}

TEST_P(RoutingCuda, MatchesHostRouting) {
  if (auto why = test::device_unavailable(Device::cuda())) GTEST_SKIP() << "no CUDA device: " << *why;
  const RoutingCase c = GetParam();
  const int64_t P = c.tokens * c.top_k, E = c.experts;
  std::mt19937_64 rng(static_cast<uint64_t>(P * 131 + E));
  std::uniform_int_distribution<int64_t> expert(0, c.used_experts - 1);
  std::uniform_real_distribution<double> unit(0, 1);
  std::vector<int64_t> ids(static_cast<std::size_t>(P));
  for (auto& id : ids) id = unit(rng) < c.invalid_fraction ? (unit(rng) < 0.5 ? -1 : E) : expert(rng);

  Tensor host_ids = Tensor::empty({c.tokens, c.top_k}, c.index_dtype);
  for (int64_t i = 0; i < P; ++i) {
    if (c.index_dtype == DType::i32)
      host_ids.data_as<int32_t>()[i] = static_cast<int32_t>(ids[static_cast<std::size_t>(i)]);
    else
      host_ids.data_as<int64_t>()[i] = ids[static_cast<std::size_t>(i)];
  }
  const Tensor device_ids = host_ids.to(Device::cuda());
  cuda::ExpertsArgs a;
  a.tokens = c.tokens;
  a.top_k = c.top_k;
  a.experts = E;
  a.index_dtype = c.index_dtype;
  a.ids = device_ids.data();
  Tensor workspace =
      Tensor::empty({static_cast<int64_t>(cuda::routing_workspace_bytes(P, E))}, DType::u8, Device::cuda());
  workspace.fill_bytes(0xA5);  // nothing may rely on zeroed memory
  cuda::DeviceRouting r;
  cuda::route_on_device(a, c.tile_rows, workspace.data(), r, nullptr);
  auto view = [&](int32_t* p, int64_t n) { return Tensor::from_blob(p, {n}, DType::i32, Device::cuda()); };
  const std::vector<int32_t> offsets = host_ints(view(r.offsets, E + 1)),
                             tile_offsets = host_ints(view(r.tile_offsets, E + 1)),
                             row_pair = host_ints(view(r.row_pair, P)), pair_row = host_ints(view(r.pair_row, P));

  // The host's routing: a stable bucket sort with the invalid pairs in a last bucket.
  std::vector<std::vector<int32_t>> buckets(static_cast<std::size_t>(E + 1));
  for (int64_t i = 0; i < P; ++i) {
    const int64_t e = ids[static_cast<std::size_t>(i)];
    buckets[static_cast<std::size_t>(e < 0 || e >= E ? E : e)].push_back(static_cast<int32_t>(i));
  }
  std::vector<int32_t> want_offsets, want_tiles, want_row_pair, want_pair_row(static_cast<std::size_t>(P), -1);
  int32_t tiles = 0;
  for (int64_t e = 0; e <= E; ++e) {
    const auto& b = buckets[static_cast<std::size_t>(e)];
    want_offsets.push_back(static_cast<int32_t>(want_row_pair.size()));
    want_tiles.push_back(tiles);
    for (int32_t pair : b) {
      if (e < E) want_pair_row[static_cast<std::size_t>(pair)] = static_cast<int32_t>(want_row_pair.size());
      want_row_pair.push_back(pair);
    }
    tiles += static_cast<int32_t>((static_cast<int64_t>(b.size()) + c.tile_rows - 1) / c.tile_rows);
  }
  const int64_t valid = want_offsets.back();
  ASSERT_EQ(offsets, want_offsets);
  ASSERT_EQ(tile_offsets, want_tiles);
  ASSERT_EQ(pair_row, want_pair_row);
  // Every row of the sort, the invalid pairs' too (stable within the last bucket).
  ASSERT_EQ(row_pair, want_row_pair) << valid << " valid rows of " << P;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, RoutingCuda,
    ::testing::Values(RoutingCase{"few_experts", 37, 2, 5, 128, DType::i64, 0.1, 5},
                      RoutingCase{"one_token", 1, 8, 256, 128, DType::i32, 0.0, 256},
                      RoutingCase{"empty_experts_small_tiles", 500, 4, 64, 16, DType::i64, 0.05, 20},
                      RoutingCase{"sonicmoe_shape", 24576, 8, 128, 128, DType::i64, 0.0, 128},
                      RoutingCase{"deepseek_experts", 4096, 8, 256, 128, DType::i32, 0.02, 256},
                      RoutingCase{"runs_of_experts_a_thread", 3000, 6, 1000, 128, DType::i64, 0.03, 1000},
                      RoutingCase{"all_invalid", 50, 4, 32, 128, DType::i32, 1.0, 32},
                      RoutingCase{"global_counts", 2000, 8, 13000, 128, DType::i64, 0.01, 13000}),
    [](const ::testing::TestParamInfo<RoutingCase>& p) { return std::string(p.param.name); });

}  // namespace
}  // namespace moekit
