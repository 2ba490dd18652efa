// The q8 GEMM on weights interleaved at load, 16 rows at a time ("x16": Q8_0x16, Q5_0x16, Q4_0x16, Q4_1x16,
// Q4_Kx16, Q6_Kx16, IQ4_XSx16, IQ4_NLx16; ggml_x16.py `interleave` writes them), for CPUs with the AVX-512 path
// (gemm_q8.h's kAvx512).
// Included by gemm_q8.cc.
//
// The activations are gemm_q8.h's (x rounded to int8 per row and 32-wide block, d_x = amax / 127); the
// weights are the file's numbers; what differs is the order of the float32 sums. Per output (row m of x,
// row n of w):
//   isum_b = sum_j q_w,j * q_x,j over block b's 32 weights, exact in int32;
//   dd_b = d_w,b * d_x,b, rounded once to float32;
//   y = fma(dd_{nb-1}, isum_{nb-1}, ... fma(dd_1, isum_1, fma(dd_0, isum_0, 0))): one chain in block order.
// (gemm_q8.h's layout sums 8 lanes of 4 products per output and adds the lanes at the end; that costs a
// conversion and an fma per 4 products, this one per 32.) A row's result does not depend on the rows
// around it or on the work split: every path below computes each output by the same chain.
//
// Layout: a matrix [N, K] (N a multiple of 16) is G = N / 16 groups [G, nb, kGroupBytes]; a group's block b
// holds its 16 rows' block b, so that one 64-byte load gives a vpdpbusd the same 4 weights of 16 rows (lane
// i: row i), which meets 4 bytes of x broadcast to every lane:
//   Q8_0x16 (544 bytes): the int8 weights plus 128 (as vpdpbusd's unsigned operand) [8 k][16 rows][4]
//     (weights 4k..4k+3), then the rows' f16 d [16];
//   Q5_0x16 (352 bytes, as the file's 22 a row): the nibble bytes [4 k][16 rows][4] (bytes 4k..4k+3 of the
//     row's 16: low nibbles are weights 4k..4k+3, high ones 16 + 4k..), the fifth bits as 8 masks of 64
//     bits (mask k, bit 4i + j: row i's weight 4k + j), then the f16 d [16]; the weights are read as
//     nibble + 16 * fifth bit = w + 16.
//   Q4_0x16 (288 bytes) and Q4_1x16 (320): the nibble bytes as Q5_0x16's, then d [16] f16 (Q4_1: and m [16]
//     f16); Q4_0's weights are read as nibble = w + 8, Q4_1's are the nibbles, and Q4_1 adds a second chain
//     per output for its offsets: off = fl(off + fl(m_b * sd_b)) in block order (sd_b = d_x,b * sum_j q_x,j,
//     gemm_q8.h's), y = fl(acc + off).
// The bias (128, 16, 8) comes back out through each row's block sums: the int32 chain of block b starts at
// -bias * sum_j q_x,j.
// Q4_Kx16 (2368 bytes a super-block: the file's 144 a row plus 4, its 6-bit scales and mins kept as bytes):
//   the nibble bytes [4 p][8 k][16 rows][4] (dword k of the row's 32 bytes p: low nibbles are sub-block 2p's
//   weights 4k..4k+3, high ones sub-block 2p + 1's), then d [16] f16, dmin [16] f16, sc [8][16], mn [8][16];
//   its 32-weight sub-blocks are the blocks b above with D_b = d * sc (exact in float32) for d_w, weights
//   q_w = the nibbles (0..15, no bias), and a second chain per output for the mins, M_b = dmin * mn:
//   off = fl(off + fl(M_b * sd_b)) in block order (sd_b = d_x,b * sum_j q_x,j, gemm_q8.h's), y = fl(acc - off).
// Q6_Kx16 (3360 bytes a super-block, as the file's 210 a row): its 6-bit q as low nibbles in Q4_Kx16's order
//   [4 p][8 k][16 rows][4] (sub-block 2p low, 2p + 1 high), then the high 2 bits [2 t][8 k][16 rows][4]
//   (sub-block 4t + u at bits 2u), the int8 scales [16][16] (one per 16 weights), d [16] f16; w = q - 32.
//   Its blocks are 16 weights (the scales'): the chain runs over them, isum over 16 products from
//   -32 * the 16 q_x's sum, d_w = d * sc (exact), d_x the 32-wide activation block's.
// IQ4_XSx16 (2208 bytes a super-block, the file's 136 a row plus 2): sub-block j's 4-bit indices as Q4_0x16's
//   nibble bytes, [8 j][4 k][16 rows][4], then d [16] f16, then the 6-bit scales less 32 as int8 [8][16]. Its
//   sub-blocks are the blocks b above with D_b = d * (ls - 32) (exact) for d_w and the table's values plus 128
//   (vpshufb on the indices) for the weights: isum from -128 * sum_j q_x,j, no mins.
// IQ4_NLx16 (576 bytes a kept pair of the file's blocks, as its 36 a row): IQ4_XSx16's index bytes for its 2
//   blocks, [2 j][4 k][16 rows][4], then their d [2 j][16] f16; read as IQ4_XSx16's with D_b = d.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

namespace imp_q8 {

constexpr int64_t kX16Rows = 16;   // weight rows per group: one zmm of int32 lanes
constexpr int64_t kX16MR = 8;      // rows of x per tile (8 int32 and 8 float32 accumulators)

// 16 f16 at p as float32 (the rows' scales).
IMP_Q8_ZMM inline __m512 f16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 int8 at p as float32 (the rows' int8 scales).
IMP_Q8_ZMM inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The nibble bytes [4 k][16 rows][4] of a group's block as 8 vectors of 16 rows x 4 weights: w[k] the low
// nibbles (weights 4k..4k+3), w[k + 4] the high ones (weights 16 + 4k..).
IMP_Q8_ZMM inline void split_nibbles(const uint8_t* g, __m512i w[8]) {
  const __m512i low = _mm512_set1_epi8(15);
  for (int k = 0; k < 4; ++k) {
    const __m512i p = _mm512_loadu_si512(g + 64 * k);
    w[k] = _mm512_and_si512(p, low), w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
  }
}

// A format's traits: kBlocks (32-weight blocks a group's block holds; more than one: read sub-block by
// sub-block), kHalves (16-weight blocks: Q6_K), kOffset (Q4_1's m), kMins (Q4_K's), kMR (rows of x a tile),
// kBias (the weights read as w + bias).
struct Q8_0x16 {
  static constexpr int64_t kGroupBytes = 544, kBlocks = 1;
  static constexpr bool kHalves = false, kOffset = false;
  static constexpr int kMR = kX16MR;
  static constexpr int32_t kBias = 128;
  // Block b's 8 vectors of 16 rows x 4 weights (k = 0..7: weights 4k..4k+3) and its 16 scales.
  IMP_Q8_ZMM static void weights(const uint8_t* g, __m512i w[8]) {
    for (int k = 0; k < 8; ++k) w[k] = _mm512_loadu_si512(g + 64 * k);
  }
  IMP_Q8_ZMM static __m512 scales(const uint8_t* g) { return f16x16(g + 512); }
};

struct Q5_0x16 {
  static constexpr int64_t kGroupBytes = 352, kBlocks = 1;
  static constexpr bool kHalves = false, kOffset = false;
  static constexpr int kMR = kX16MR;
  static constexpr int32_t kBias = 16;
  IMP_Q8_ZMM static void weights(const uint8_t* g, __m512i w[8]) {   // the nibbles, + 16 under mask k's bits
    split_nibbles(g, w);
    for (int k = 0; k < 8; ++k) {
      uint64_t bits;
      std::memcpy(&bits, g + 256 + 8 * k, 8);
      w[k] = _mm512_mask_add_epi8(w[k], _cvtu64_mask64(bits), w[k], _mm512_set1_epi8(16));
    }
  }
  IMP_Q8_ZMM static __m512 scales(const uint8_t* g) { return f16x16(g + 320); }
};

// Q4_0x16 / Q4_1x16: the nibbles as they are; Q4_1 with offsets, 4 rows of x a tile (4 int32, 4 float32 and 4
// offset accumulators beside the 8 weight vectors).
template <int64_t kBytes, int32_t kBiasOf, bool kOffsetOf>
struct Q4x16 {
  static constexpr int64_t kGroupBytes = kBytes, kBlocks = 1;
  static constexpr bool kHalves = false, kOffset = kOffsetOf;
  static constexpr int kMR = kOffsetOf ? 4 : kX16MR;
  static constexpr int32_t kBias = kBiasOf;
  IMP_Q8_ZMM static void weights(const uint8_t* g, __m512i w[8]) { split_nibbles(g, w); }
  IMP_Q8_ZMM static __m512 scales(const uint8_t* g) { return f16x16(g + 256); }
  IMP_Q8_ZMM static __m512 offsets(const uint8_t* g) { return f16x16(g + 288); }   // Q4_1's m
};
using Q4_0x16 = Q4x16<288, 8, false>;
using Q4_1x16 = Q4x16<320, 0, true>;

// A super-block of 8 sub-blocks, each read as a block of 32, with mins; 4 rows of x a tile
// (4 int32, 4 float32 and 4 mins accumulators).
struct Q4_Kx16 {
  static constexpr int64_t kGroupBytes = 2368, kBlocks = 8;
  static constexpr bool kHalves = false, kOffset = false, kMins = true;
  static constexpr int kMR = 4;
  static constexpr int32_t kBias = 0;
  // Sub-block j's 8 vectors of 16 rows x 4 weights.
  IMP_Q8_ZMM static __m512i weights(const uint8_t* g, int j, int k) {
    const __m512i p = _mm512_loadu_si512(g + 512 * (j / 2) + 64 * k), low = _mm512_set1_epi8(15);
    return j % 2 ? _mm512_and_si512(_mm512_srli_epi16(p, 4), low) : _mm512_and_si512(p, low);
  }
  // Sub-block j's D = d * sc and M = dmin * mn of the 16 rows.
  IMP_Q8_ZMM static void scales(const uint8_t* g, int j, __m512& D, __m512& M) {
    D = _mm512_mul_ps(f16x16(g + 2048), bytes(g + 2112 + 16 * j));
    M = _mm512_mul_ps(f16x16(g + 2080), bytes(g + 2240 + 16 * j));
  }
  IMP_Q8_ZMM static __m512 bytes(const uint8_t* p) {   // 16 unsigned bytes as float32
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};

// Super-blocks of 8 sub-blocks of 32 without mins; the weights from the table.
struct IQ4_XSx16 {
  static constexpr int64_t kGroupBytes = 2208, kBlocks = 8;
  static constexpr bool kHalves = false, kOffset = false, kMins = false;
  static constexpr int kMR = kX16MR;
  static constexpr int32_t kBias = 128;
  // Sub-block j's weights 4k..4k+3 of the 16 rows: the table's values at the indices, plus 128.
  IMP_Q8_ZMM static __m512i weights(const uint8_t* g, int j, int k) {
    const __m512i table = _mm512_broadcast_i32x4(iq4_table(true));
    const __m512i p = _mm512_loadu_si512(g + 256 * j + 64 * (k % 4));
    return _mm512_shuffle_epi8(table, _mm512_and_si512(k < 4 ? p : _mm512_srli_epi16(p, 4), _mm512_set1_epi8(15)));
  }
  IMP_Q8_ZMM static void scales(const uint8_t* g, int j, __m512& D, __m512& M) {
    D = _mm512_mul_ps(f16x16(g + 2048), i8x16(g + 2080 + 16 * j));
    M = _mm512_setzero_ps();
  }
};

// IQ4_XSx16's weights, 2 blocks a group's block, each with its own d.
struct IQ4_NLx16 : IQ4_XSx16 {
  static constexpr int64_t kGroupBytes = 576, kBlocks = 2;
  IMP_Q8_ZMM static void scales(const uint8_t* g, int j, __m512& D, __m512& M) {
    D = f16x16(g + 512 + 32 * j);
    M = _mm512_setzero_ps();
  }
};

struct Q6_Kx16 {
  static constexpr int64_t kGroupBytes = 3360, kBlocks = 8;
  static constexpr bool kHalves = true, kOffset = false;
  static constexpr int kMR = kX16MR;
  static constexpr int32_t kBias = 32;
  // Sub-block j's weights 4k..4k+3 (q, 0..63) of the 16 rows.
  IMP_Q8_ZMM static __m512i weights(const uint8_t* g, int j, int k) {
    const __m512i p = _mm512_loadu_si512(g + 512 * (j / 2) + 64 * k), h = _mm512_loadu_si512(g + 2048 + 512 * (j / 4) + 64 * k);
    const __m512i low = j % 2 ? _mm512_srli_epi16(p, 4) : p;
    const __m512i high = _mm512_srli_epi16(h, 2 * (j % 4));
    return _mm512_or_si512(_mm512_and_si512(low, _mm512_set1_epi8(15)), _mm512_slli_epi16(_mm512_and_si512(high, _mm512_set1_epi8(3)), 4));
  }
  // The d * sc of 16-weight block t (0..15) of the 16 rows.
  IMP_Q8_ZMM static __m512 scale(const uint8_t* g, int t) {
    return _mm512_mul_ps(f16x16(g + 3328), i8x16(g + 3072 + 16 * t));
  }
};

// x [M, K] for the x16 tiles: q, d_x and sd = d_x * sum q [M, nb], each block's -bias * sum q [M, nb], and
// (Q6_Kx16) -bias * the sums of its two 16-value halves [M, nb, 2].
struct X16Activations {
  int64_t M, K, nb;
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> d, sd;
  std::unique_ptr<int32_t[]> start, halves;

  X16Activations(const float* x, int64_t M, int64_t K, int32_t bias)
      : M(M), K(K), nb(K / kBlock), q(new int8_t[M * K]), d(new float[M * nb]), sd(new float[M * nb]),
        start(new int32_t[M * nb]), halves(new int32_t[2 * M * nb]) {
    for (int64_t m = 0; m < M; ++m) {
      quantise_row(x + m * K, nb, 0, q.get() + m * K, d.get() + m * nb, sd.get() + m * nb, nullptr);
      for (int64_t b = 0; b < nb; ++b) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.get() + m * K + b * kBlock));
        const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
        const int32_t all = hsum_i32(sums), low = hsum_i32(_mm256_blend_epi32(sums, _mm256_setzero_si256(), 0xf0));
        start[m * nb + b] = -bias * all;
        halves[2 * (m * nb + b)] = -bias * low, halves[2 * (m * nb + b) + 1] = -bias * (all - low);
      }
    }
  }
};

// The tiles: rows [r0, r0 + MR) of x against one group (16 weight rows) into y (row r0's 16 outputs; rows ldy
// apart). Q4_Kx16, IQ4_XSx16, IQ4_NLx16: a group's block's sub-blocks as blocks of 32 (Q4_K: with the mins' chain).
template <class W, int MR>
IMP_Q8_ZMM void ktile_x16(const X16Activations& a, int64_t r0, const uint8_t* g, float* y, int64_t ldy) {
  const int64_t nb = a.nb, K = a.K;
  __m512 acc[MR], off[MR];
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps(), off[r] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += W::kBlocks, g += W::kGroupBytes)
    for (int j = 0; j < W::kBlocks; ++j) {
      const int64_t b = b0 + j;
      __m512i isum[MR];
      IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) isum[r] = _mm512_set1_epi32(a.start[(r0 + r) * nb + b]);
      IMP_Q8_UNROLL for (int k = 0; k < 8; ++k) {
        const __m512i w = W::weights(g, j, k);
        IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) {
          int32_t four;
          std::memcpy(&four, a.q.get() + (r0 + r) * K + b * kBlock + 4 * k, 4);
          isum[r] = _mm512_dpbusd_epi32(isum[r], w, _mm512_set1_epi32(four));
        }
      }
      __m512 D, M;
      W::scales(g, j, D, M);
      IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(D, _mm512_set1_ps(a.d[(r0 + r) * nb + b])), _mm512_cvtepi32_ps(isum[r]), acc[r]);
        if constexpr (W::kMins) off[r] = _mm512_add_ps(off[r], _mm512_mul_ps(M, _mm512_set1_ps(a.sd[(r0 + r) * nb + b])));
      }
    }
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, W::kMins ? _mm512_sub_ps(acc[r], off[r]) : acc[r]);
}

// Q6_Kx16: blocks of 16 weights (2 a sub-block), no mins.
template <class W, int MR>
IMP_Q8_ZMM void ktile16_x16(const X16Activations& a, int64_t r0, const uint8_t* g, float* y, int64_t ldy) {
  const int64_t nb = a.nb, K = a.K;
  __m512 acc[MR];
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += W::kBlocks, g += W::kGroupBytes)
    for (int j = 0; j < W::kBlocks; ++j) {
      const int64_t b = b0 + j;
      IMP_Q8_UNROLL for (int h = 0; h < 2; ++h) {
        __m512i isum[MR];
        IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) isum[r] = _mm512_set1_epi32(a.halves[2 * ((r0 + r) * nb + b) + h]);
        IMP_Q8_UNROLL for (int k = 4 * h; k < 4 * h + 4; ++k) {
          const __m512i w = W::weights(g, j, k);
          IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) {
            int32_t four;
            std::memcpy(&four, a.q.get() + (r0 + r) * K + b * kBlock + 4 * k, 4);
            isum[r] = _mm512_dpbusd_epi32(isum[r], w, _mm512_set1_epi32(four));
          }
        }
        const __m512 D = W::scale(g, 2 * j + h);
        IMP_Q8_UNROLL for (int r = 0; r < MR; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(D, _mm512_set1_ps(a.d[(r0 + r) * nb + b])), _mm512_cvtepi32_ps(isum[r]), acc[r]);
      }
    }
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// The 32-weight formats: one block a step (Q4_1: and its offsets' chain).
template <class W, int MR>
IMP_Q8_ZMM void btile_x16(const X16Activations& a, int64_t r0, const uint8_t* g, float* y, int64_t ldy) {
  const int64_t nb = a.nb, K = a.K;
  __m512 acc[MR], off[MR];
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps(), off[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, g += W::kGroupBytes) {
    __m512i w[8];
    W::weights(g, w);
    __m512i isum[MR];
    IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) isum[r] = _mm512_set1_epi32(a.start[(r0 + r) * nb + b]);
    IMP_Q8_UNROLL for (int k = 0; k < 8; ++k)
      IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) {
        int32_t four;   // x's bytes 4k..4k+3 of this block, in every lane
        std::memcpy(&four, a.q.get() + (r0 + r) * K + b * kBlock + 4 * k, 4);
        isum[r] = _mm512_dpbusd_epi32(isum[r], w[k], _mm512_set1_epi32(four));
      }
    const __m512 dw = W::scales(g);
    IMP_Q8_UNROLL for (int r = 0; r < MR; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a.d[(r0 + r) * nb + b])), _mm512_cvtepi32_ps(isum[r]), acc[r]);
    if constexpr (W::kOffset) {
      const __m512 m = W::offsets(g);
      IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) off[r] = _mm512_add_ps(off[r], _mm512_mul_ps(m, _mm512_set1_ps(a.sd[(r0 + r) * nb + b])));
    }
  }
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, W::kOffset ? _mm512_add_ps(acc[r], off[r]) : acc[r]);
}

// Rows [r0, r0 + MR) of x (MR up to W::kMR) against one group of format W.
template <class W, int MR>
IMP_Q8_ZMM void tile_x16(const X16Activations& a, int64_t r0, const uint8_t* g, float* y, int64_t ldy) {
  if constexpr (MR > W::kMR) {
    return;   // not called: GemmX16 steps by W::kMR
  } else if constexpr (W::kHalves) {
    ktile16_x16<W, MR>(a, r0, g, y, ldy);
  } else if constexpr (W::kBlocks > 1) {
    ktile_x16<W, MR>(a, r0, g, y, ldy);
  } else {
    btile_x16<W, MR>(a, r0, g, y, ldy);
  }
}

template <class W>
struct X16Tiles {
  using Fn = void (*)(const X16Activations&, int64_t, const uint8_t*, float*, int64_t);
  static constexpr Fn fn[kX16MR] = {tile_x16<W, 1>, tile_x16<W, 2>, tile_x16<W, 3>, tile_x16<W, 4>,
                                    tile_x16<W, 5>, tile_x16<W, 6>, tile_x16<W, 7>, tile_x16<W, 8>};
};

// The work: items of kX16Groups groups by up to kX16RowBlock rows of x, taken from an atomic counter.
constexpr int64_t kX16Groups = 4;        // 64 weight rows an item
constexpr int64_t kX16RowBlock = 256;    // rows of x an item

template <class W>
struct GemmX16 {
  X16Activations a;
  const uint8_t* w;
  float* y;
  int64_t N, groups, group_items, items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  GemmX16(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y)
      : a(x, M, K, W::kBias), w(w), y(y), N(N), groups(N / kX16Rows),
        group_items((groups + kX16Groups - 1) / kX16Groups),
        items(group_items * ((M + kX16RowBlock - 1) / kX16RowBlock)) {}

  void item(int64_t i) const {
    const int64_t m0 = (i / group_items) * kX16RowBlock, m1 = std::min(a.M, m0 + kX16RowBlock);
    const int64_t g0 = (i % group_items) * kX16Groups, g1 = std::min(groups, g0 + kX16Groups);
    const int64_t gbytes = a.nb / W::kBlocks * W::kGroupBytes;
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t m = m0; m < m1; m += W::kMR)
        X16Tiles<W>::fn[std::min<int64_t>(W::kMR, m1 - m) - 1](a, m, w + g * gbytes, y + m * N + g * kX16Rows, N);
  }

  void work() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      item(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// y [M, N] = the x16 q8 product of x [M, K] and interleaved groups w [N / 16, K / (32 W::kBlocks),
// W::kGroupBytes], with XLA's pool (or on this thread alone when `pool` is null). Only where best_isa() is kAvx512.
template <class W>
void run_x16(ffi::ThreadPool* pool, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y) {
  if (M == 0 || N == 0) return;
  const int64_t threads = !pool || 2 * M * N * K < (1 << 18) ? 1 : std::max<int64_t>(1, pool->num_threads());
  auto g = std::make_shared<GemmX16<W>>(x, M, K, w, N, y);
  const int64_t helpers = std::min(threads, g->items) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool->Schedule([g] { g->work(); });
  g->work();
  while (g->done.load(std::memory_order_acquire) < g->items) _mm_pause();
}

}  // namespace imp_q8
