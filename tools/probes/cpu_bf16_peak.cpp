// The machine's bf16 arithmetic ceiling: independent AVX512-BF16 dot-product chains (vdpbf16ps, 64
// FLOP each) on every core. The CPU backends' GFLOP/s are judged against this, not against a
// datasheet. Built only where the compiler can target AVX512-BF16; run it on an idle machine.
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

namespace {

__attribute__((target("avx512bf16,avx512f"))) double chain_gflops(long iterations) {
  // Twelve accumulators with distinct starting values: enough independent chains to cover the
  // instruction's latency, and distinct so the compiler cannot merge them.
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80));
  const auto start = std::chrono::steady_clock::now();
  for (long n = 0; n < iterations; ++n) {
    acc[0] = _mm512_dpbf16_ps(acc[0], a, a);
    acc[1] = _mm512_dpbf16_ps(acc[1], a, a);
    acc[2] = _mm512_dpbf16_ps(acc[2], a, a);
    acc[3] = _mm512_dpbf16_ps(acc[3], a, a);
    acc[4] = _mm512_dpbf16_ps(acc[4], a, a);
    acc[5] = _mm512_dpbf16_ps(acc[5], a, a);
    acc[6] = _mm512_dpbf16_ps(acc[6], a, a);
    acc[7] = _mm512_dpbf16_ps(acc[7], a, a);
    acc[8] = _mm512_dpbf16_ps(acc[8], a, a);
    acc[9] = _mm512_dpbf16_ps(acc[9], a, a);
    acc[10] = _mm512_dpbf16_ps(acc[10], a, a);
    acc[11] = _mm512_dpbf16_ps(acc[11], a, a);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  __m512 sum = acc[0];
  for (int i = 1; i < 12; ++i) sum = _mm512_add_ps(sum, acc[i]);
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  return static_cast<double>(iterations) * 12.0 * 64.0 / seconds / 1e9;
}

}  // namespace

int main() {
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::printf("this CPU has no AVX512-BF16\n");
    return 1;
  }
  constexpr long kIterations = 200'000'000;
  std::printf("bf16 peak, 1 thread: %.0f GFLOP/s\n", chain_gflops(kIterations));
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<double> rates(threads);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) pool.emplace_back([&, t] { rates[t] = chain_gflops(kIterations); });
  for (auto& t : pool) t.join();
  double total = 0;
  for (double r : rates) total += r;
  std::printf("bf16 peak, %u threads: %.0f GFLOP/s\n", threads, total);
  return 0;
}
