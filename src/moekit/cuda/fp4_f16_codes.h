// FP4 (e2m1) weights for the f16 tensor cores, by integer arithmetic only (host and device, so the CPU
// tests check every code): the bits of an f16 that holds e2m1 code n times 2^-14, the f16 bits of powers
// of two that bring them back, and the order in which activation codes are stored so that both sides of
// an mma pair the same values.
#pragma once

#include <cstdint>

#include "moekit/cuda/experts_cuda.h"

namespace moekit::cuda {

// e2m1 code n (bits s e1 e0 m) placed as f16 bits ((n & 7) << 9) | ((n & 8) << 12) reads as its value
// times 2^-14: f16's exponent field is then e1 e0, its top mantissa bit m, and both e2m1 normals
// (2^(e - 1) (1 + m / 2)) and its one subnormal (m / 2) come out 2^-14 times too small, exactly.
// For a 32-bit word of 8 packed codes (code i in bits 4i..4i+3) this returns, for j < 4, the f16x2 of
// codes j (low half) and j + 4 (high half), each times 2^-14.
MOEKIT_HOST_DEVICE inline uint32_t e2m1_pair_as_f16x2(uint32_t word, int j) {
  const uint32_t magnitude = (j < 3 ? word << (9 - 4 * j) : word >> 3) & 0x0e000e00u;
  const uint32_t sign = (word << (12 - 4 * j)) & 0x80008000u;
  return magnitude | sign;
}

// The f16 bits of 2^e: normal for e >= -14, subnormal down to 2^-24, zero below; e <= 15.
MOEKIT_HOST_DEVICE inline uint16_t f16_power_of_two(int e) {
  if (e >= -14) return static_cast<uint16_t>((e + 15) << 10);
  if (e >= -24) return static_cast<uint16_t>(1u << (e + 24));
  return 0;
}

// Where value k of a row of activation codes stored as f16 goes: within each block of 8, values j and
// j + 4 side by side (the pairing of e2m1_pair_as_f16x2), so one 32-bit load of the activations matches
// one converted word of weights.
MOEKIT_HOST_DEVICE inline int64_t f16_code_position(int64_t k) {
  const int64_t r = k % 8;
  return k - r + 2 * (r % 4) + r / 4;
}

}  // namespace moekit::cuda
