// y[m, n] = sum_k x[m, k] * w[n, k]: the float32 projection GEMM on x86-64 CPUs with AVX2 + FMA,
// for weights in HF's [out, in] layout, as XLA FFI custom calls (imp_jax/kernels_pallas/cpu/gemm.py),
// one per weight format:
//   imp_gemm_f32          float32 weights [N, K];
//   imp_gemm_f32_bf16w    bfloat16 weights [N, K] (a bf16 checkpoint's matrices at half the bytes);
//   imp_gemm_f32_<fmt>w   GGML blocks, uint8 [N, K / W, block bytes], as a GGUF file stores them:
//                         W = 32 for Q8_0 (w = d * q), Q4_0 (w = d * (q - 8)), Q4_1 (w = d * q + m),
//                         Q5_0 (w = d * (q - 16)), Q5_1 (w = d * q + m); W = 256 for the K-quants
//                         Q2_K..Q6_K (super-blocks of 8 or 16 sub-blocks with integer scales under
//                         f16 ones; layouts in ggml_blocks.py) and IQ4_XS (a K-quant-like super-block
//                         whose nibbles index a table of 16 int8 values), IQ4_NL (W = 64: pairs of
//                         the file's 32-weight blocks, w = d * table[q]), MXFP4 (W = 32, 17 bytes: an
//                         E8M0 exponent e and FP4 nibbles, w = 2^(e - 128) * fp4x2[q]).
// Every format is widened to float32 as it is read, and to exactly the float32 values a dequantised
// copy holds (gguf-py's formulas: each product d * q, and each K-quant scale product d * sc, is exact
// in float32, so the one rounding of d * q + m is the same fused or not; Q6_K / Q3_K's (d * sc) * q
// is one rounding of an exact product in any grouping), so the products are the float32 kernel's,
// bit for bit.
//
// Why: XLA's CPU GEMMs pack the weight matrix on every call. At the 1-64 rows of a decode step the
// packing costs as much memory traffic as the product itself. Here nothing is packed: each output
// is a dot product along k, which is contiguous in both x and w, so a weight row streams from
// memory once per block of rows and its tile stays in L1 while the row blocks go by. Narrow
// formats stream fewer bytes: a decode step that reads 4.5-bit weights reads a seventh of float32's.
//
// Each output element is summed in the same order (8-lane partial sums over k, then a fixed
// horizontal sum) whatever M, N, the tiling or the weight format, so a row's result does not
// depend on its neighbours, and a narrow format gives the bits its float32 copy would.
//
// Narrow formats: each NR-row weight tile is first widened into a float32 scratch that stays in L1
// while its row tiles go by, so each weight is widened once per 64 rows (GGML blocks 32 weights at a
// time: a block, or a K-quant super-block's sub-block, with its scales); bf16 weights meeting at
// most kMR rows (the memory-bound case) are instead read straight into registers.
//
// gemm_q8.h is the opt-in int8-activation arithmetic for every format here: Q8_0 / Q4_0 / Q4_1 / Q5_0 /
// Q5_1 blocks, (gemm_q8_k.h) Q2_K..Q6_K super-blocks and (gemm_q8_iq.h) IQ4_XS / IQ4_NL / MXFP4
// (imp_gemm_q8_*, bound in gemm_q8.cc; cpu/gemm.py).
//
// This header holds the formats and the GEMM itself; the handlers are bound in two translation units
// compiled in parallel into one library (build.py): gemm.cc (float32, bfloat16, the 32-weight blocks)
// and gemm_k.cc (the 256-weight super-blocks, IQ4_XS, IQ4_NL, MXFP4). The opt-in q8 path is a library
// of its own (gemm_q8.cc), built only when `--gemm cpu_q8` asks for it.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace imp_gemm {
namespace {   // each translation unit keeps its own instantiations, as one file did


constexpr int64_t kMR = 4;           // rows of x per tile
constexpr int64_t kNR = 3;           // rows of w per tile: 12 accumulators + 3 weights + 1 x in 16 ymm
constexpr int64_t kRowBlock = 64;    // rows of x per work item: their slice of x stays in L2
constexpr int64_t kColBlock = 48;    // rows of w per work item
constexpr int64_t kQBlock = 32;      // weights per GGML block

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);   // exact, subnormals included
}

// A weight format: the byte offset of weight k in a row, and how weights become floats: plain
// formats give the 8 weights from k (k % 8 == 0) and single ones (the K % 8 tail); block formats
// (kBlocks, K % 32 == 0) give a whole block's 32 weights at a time from its one scale.
struct F32 {
  static constexpr const char* kName = "imp_gemm_f32";
  static constexpr bool kWide = true;     // already float32: no scratch tile
  static constexpr bool kBlocks = false;  // GGML blocks: widened a block (32 weights, one scale) at a time
  static constexpr int64_t kWeights = 1;  // weights per block
  static constexpr bool kMin = false;     // K-quants: whether a super-block has mins too
  static constexpr bool kSuper = false;   // K-quant-style 256-weight super-blocks (scales(), quants())
  static int64_t offset(int64_t k) { return 4 * k; }
  static __m256 load8(const uint8_t* w, int64_t k) { return _mm256_loadu_ps(reinterpret_cast<const float*>(w) + k); }
  static float one(const uint8_t* w, int64_t k) { return reinterpret_cast<const float*>(w)[k]; }
};

struct BF16 {   // the bfloat16's bits are the top half of its float32
  static constexpr const char* kName = "imp_gemm_f32_bf16w";
  static constexpr bool kWide = false;
  static constexpr bool kBlocks = false;
  static constexpr int64_t kWeights = 1;
  static constexpr bool kMin = false;
  static constexpr bool kSuper = false;
  static int64_t offset(int64_t k) { return 2 * k; }
  static __m256 load8(const uint8_t* w, int64_t k) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static float one(const uint8_t* w, int64_t k) {
    uint16_t h;
    std::memcpy(&h, w + 2 * k, 2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};

// A GGML block format of `Bytes` bytes per `Weights` weights (32, or a K-quant's 256-weight
// super-block); `block(row, k, v)` gives the 32 weights from k (k % 32 == 0) of a row. `offset`
// is where weight k's bytes are, roughly (for prefetching; exact at a block's start).
template <int64_t Bytes, int64_t Weights = kQBlock>
struct GgmlBlocks {
  static constexpr bool kWide = false;
  static constexpr bool kBlocks = true;
  static constexpr int64_t kBytes = Bytes;
  static constexpr int64_t kWeights = Weights;
  static constexpr bool kMin = false;
  static constexpr bool kSuper = Weights == 256;   // a K-quant-style super-block: scales(), quants()
  static int64_t offset(int64_t k) { return (k / kWeights) * kBytes + (k % kWeights) * kBytes / kWeights; }
  // the block holding weight k, and which of its 32-weight sub-blocks k starts
  static const uint8_t* at(const uint8_t* row, int64_t k, int& j) {
    j = static_cast<int>((k % kWeights) / kQBlock);
    return row + (k / kWeights) * kBytes;
  }
};

// 16 bytes at p in both 128-bit lanes.
inline __m256i bcast16(const uint8_t* p) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// bits [shift, shift + width) of each byte (shift + width <= 8)
inline __m256i bit_field(__m256i bytes, int shift, int width) {
  const __m256i mask = _mm256_set1_epi8(static_cast<char>((1 << width) - 1));
  return _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(shift)), mask);
}
// The 32 weights' byte values as four int32 vectors (weights 0-7, 8-15, 16-23, 24-31): half(h)
// gives weights 16h..16h+15 as 16 bytes in both lanes, which in-lane byte shuffles spread to
// 32-bit lanes (as nibbles32 below: Zen's cross-lane widening shuffles would be the bottleneck).
template <class Half>
inline void spread32(Half half, __m256i q[4]) {
  const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                         4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i second = _mm256_add_epi32(first, _mm256_set1_epi32(8));
  for (int h = 0; h < 2; ++h) {
    const __m256i raw = half(h);
    q[2 * h] = _mm256_shuffle_epi8(raw, first);
    q[2 * h + 1] = _mm256_shuffle_epi8(raw, second);
  }
}

struct Q8_0 : GgmlBlocks<34> {   // f16 d, int8 q[32]: w = d * q
  static constexpr const char* kName = "imp_gemm_f32_q8_0w";
  static void block(const uint8_t* row, int64_t k, __m256 v[4]) {   // 32 weights
    int j;
    const uint8_t* b = at(row, k, j);
    const __m256 d = _mm256_set1_ps(f16(b));
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
      v[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  }
};

// Q4_0 and Q4_1 hold weight j of a block in the low nibble of byte j (j < 16), weight j + 16 in
// its high nibble. nibbles32 gives all 32 as four int32 vectors, weights 0-7, 8-15, 16-23, 24-31:
// the 16 bytes go to both 128-bit lanes, so in-lane byte shuffles spread them to 32-bit lanes (Zen's cross-lane
// widening shuffles would be the bottleneck).
inline void nibbles32(const uint8_t* qs, __m256i q[4]) {
  const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m256i mask = _mm256_set1_epi8(15);
  const __m256i low = _mm256_and_si256(raw, mask), high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
  // byte i of the 16 into dword lane i % 8 of the (i / 8)th vector; -1 zeroes a byte
  const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                         4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i second = _mm256_add_epi32(first, _mm256_set1_epi32(8));   // bytes 8-15 (-1 + 8 keeps bit 7)
  q[0] = _mm256_shuffle_epi8(low, first);
  q[1] = _mm256_shuffle_epi8(low, second);
  q[2] = _mm256_shuffle_epi8(high, first);
  q[3] = _mm256_shuffle_epi8(high, second);
}

// Q5_0 / Q5_1: nibbles32 plus weight i's fifth bit, bit i of the little-endian uint32 at `qh`.
inline void fives32(const uint8_t* qh, const uint8_t* qs, __m256i q[4]) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  nibbles32(qs, q);
  const __m256i all = _mm256_set1_epi32(static_cast<int32_t>(bits)), one = _mm256_set1_epi32(1);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int i = 0; i < 4; ++i) {
    const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(all, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * i))), one);
    q[i] = _mm256_or_si256(q[i], _mm256_slli_epi32(bit, 4));
  }
}

struct Q4_0 : GgmlBlocks<18> {   // f16 d, 16 bytes of nibbles: w = d * (q - 8)
  static constexpr const char* kName = "imp_gemm_f32_q4_0w";
  static void block(const uint8_t* row, int64_t k, __m256 v[4]) {
    int j;
    const uint8_t* b = at(row, k, j);
    const __m256 d = _mm256_set1_ps(f16(b));
    __m256i q[4];
    nibbles32(b + 2, q);
    for (int i = 0; i < 4; ++i) v[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], _mm256_set1_epi32(8))));
  }
};

struct Q4_1 : GgmlBlocks<20> {   // f16 d, f16 m, 16 bytes of nibbles: w = d * q + m
  static constexpr const char* kName = "imp_gemm_f32_q4_1w";
  static void block(const uint8_t* row, int64_t k, __m256 v[4]) {
    int j;
    const uint8_t* b = at(row, k, j);
    int32_t dm_bits;   // d and m side by side: one load, one conversion
    std::memcpy(&dm_bits, b, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));
    const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    __m256i q[4];
    nibbles32(b + 4, q);
    for (int i = 0; i < 4; ++i) v[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[i]), m);
  }
};

struct Q5_0 : GgmlBlocks<22> {   // f16 d, uint32 of fifth bits, 16 bytes of nibbles: w = d * (q - 16)
  static constexpr const char* kName = "imp_gemm_f32_q5_0w";
  static void block(const uint8_t* row, int64_t k, __m256 v[4]) {
    int j;
    const uint8_t* b = at(row, k, j);
    const __m256 d = _mm256_set1_ps(f16(b));
    __m256i q[4];
    fives32(b + 2, b + 6, q);
    for (int i = 0; i < 4; ++i) v[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], _mm256_set1_epi32(16))));
  }
};

struct Q5_1 : GgmlBlocks<24> {   // f16 d, f16 m, uint32 of fifth bits, 16 bytes of nibbles: w = d * q + m
  static constexpr const char* kName = "imp_gemm_f32_q5_1w";
  static void block(const uint8_t* row, int64_t k, __m256 v[4]) {
    int j;
    const uint8_t* b = at(row, k, j);
    const __m256 d = _mm256_set1_ps(f16(b)), m = _mm256_set1_ps(f16(b + 2));
    __m256i q[4];
    fives32(b + 4, b + 8, q);
    for (int i = 0; i < 4; ++i) v[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[i]), m);   // d * q exact: one rounding
  }
};

// The K-quants: 256-weight super-blocks of 8 sub-blocks of 32 (or 16 of 16) with integer scales
// under one or two f16 scales; layouts in ggml_blocks.py. Each scale product d * sc is exact in
// float32, and so is (d * sc) * q but in Q6_K (one rounding there, as in gguf-py); the subtraction
// of dmin * mn is then the one rounding, fused or not.

// Each K-quant gives `scales(b, d, m)`: per 16 weights of super-block b the float32 scale d * sc
// and (kMin) the min dmin * mn; and `quants(b, j, q)`: sub-block j's 32 integer weights as four
// int32 vectors. `ksub` makes sub-block j's floats from them, `kblock` the 32 weights from k.
template <class W>
inline void ksub(const uint8_t* b, int j, const float* d, const float* m, __m256 v[4]) {
  __m256i q[4];
  W::quants(b, j, q);
  for (int i = 0; i < 4; ++i) {
    const __m256 di = _mm256_broadcast_ss(d + 2 * j + i / 2), qi = _mm256_cvtepi32_ps(q[i]);
    if constexpr (W::kMin)
      v[i] = _mm256_fmsub_ps(di, qi, _mm256_broadcast_ss(m + 2 * j + i / 2));   // d * q exact: one rounding
    else
      v[i] = _mm256_mul_ps(di, qi);
  }
}

template <class W>
inline void kblock(const uint8_t* row, int64_t k, __m256 v[4]) {
  int j;
  const uint8_t* b = W::at(row, k, j);
  alignas(32) float d[16], m[16];
  W::scales(b, d, m);
  ksub<W>(b, j, d, m, v);
}

// Q4_K / Q5_K: f16 d, f16 dmin, then 12 bytes of 8 6-bit scales and mins (ggml_blocks.py).
inline void scales_k4(const uint8_t* b, float* d, float* m) {
  const float dd = f16(b), dm = f16(b + 2);
  const uint8_t* s = b + 4;
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    d[2 * j] = d[2 * j + 1] = dd * static_cast<float>(sc);
    m[2 * j] = m[2 * j + 1] = dm * static_cast<float>(mn);
  }
}

struct Q4_K : GgmlBlocks<144, 256> {   // f16 d, f16 dmin, 12 scale bytes, 128 of nibbles
  static constexpr const char* kName = "imp_gemm_f32_q4_kw";
  static constexpr bool kMin = true;
  static void scales(const uint8_t* b, float* d, float* m) { scales_k4(b, d, m); }
  static void quants(const uint8_t* b, int j, __m256i q[4]) {
    const uint8_t* qs = b + 16 + 32 * (j / 2);
    spread32([&](int h) { return bit_field(bcast16(qs + 16 * h), 4 * (j % 2), 4); }, q);
  }
  static void block(const uint8_t* row, int64_t k, __m256 v[4]) { kblock<Q4_K>(row, k, v); }
};

struct Q5_K : GgmlBlocks<176, 256> {   // Q4_K's fields, 32 bytes of fifth bits, 128 of nibbles
  static constexpr const char* kName = "imp_gemm_f32_q5_kw";
  static constexpr bool kMin = true;
  static void scales(const uint8_t* b, float* d, float* m) { scales_k4(b, d, m); }
  static void quants(const uint8_t* b, int j, __m256i q[4]) {
    const uint8_t *qs = b + 48 + 32 * (j / 2), *qh = b + 16;
    spread32([&](int h) {
      return _mm256_or_si256(bit_field(bcast16(qs + 16 * h), 4 * (j % 2), 4),
                             _mm256_slli_epi16(bit_field(bcast16(qh + 16 * h), j, 1), 4));
    }, q);
  }
  static void block(const uint8_t* row, int64_t k, __m256 v[4]) { kblock<Q5_K>(row, k, v); }
};

struct Q6_K : GgmlBlocks<210, 256> {   // 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, f16 d
  static constexpr const char* kName = "imp_gemm_f32_q6_kw";
  static constexpr bool kMin = false;
  static void scales(const uint8_t* b, float* d, float*) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m256 dd = _mm256_set1_ps(f16(b + 208));
    _mm256_storeu_ps(d, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_storeu_ps(d + 8, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
  }
  static void quants(const uint8_t* b, int j, __m256i q[4]) {
    const int h = j / 4, jj = j % 4;   // half of the super-block, 32-weight quarter of it
    const uint8_t *ql = b + 64 * h + 32 * (jj % 2), *qh = b + 128 + 32 * h;
    spread32([&](int i) {
      return _mm256_or_si256(bit_field(bcast16(ql + 16 * i), 4 * (jj / 2), 4),
                             _mm256_slli_epi16(bit_field(bcast16(qh + 16 * i), 2 * jj, 2), 4));
    }, q);
    for (int i = 0; i < 4; ++i) q[i] = _mm256_sub_epi32(q[i], _mm256_set1_epi32(32));
  }
  static void block(const uint8_t* row, int64_t k, __m256 v[4]) { kblock<Q6_K>(row, k, v); }
};

struct Q3_K : GgmlBlocks<110, 256> {   // 32 bytes of high-bit mask, 64 of 2-bit q, 12 scale bytes, f16 d
  static constexpr const char* kName = "imp_gemm_f32_q3_kw";
  static constexpr bool kMin = false;
  static void scales(const uint8_t* b, float* d, float*) {   // 16 6-bit scales, minus 32
    // scale t: low 4 bits from byte t's low nibble (t < 8) or byte t - 8's high one, high 2 bits
    // from bits 2 (t / 4) of byte 8 + t % 4
    const uint8_t* s = b + 96;
    const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)));
    int32_t hb;
    std::memcpy(&hb, s + 8, 4);
    const __m256i high = _mm256_cvtepu8_epi32(_mm_set1_epi32(hb));   // bytes 8-11, twice
    const __m256 dd = _mm256_set1_ps(f16(b + 108));
    const __m256i three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
    for (int half = 0; half < 2; ++half) {
      const __m256i lo = half ? _mm256_srli_epi32(low, 4) : _mm256_and_si256(low, _mm256_set1_epi32(15));
      const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
      const __m256i by = _mm256_add_epi32(shift, _mm256_set1_epi32(4 * half));
      const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(high, by), three);
      const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), bias);
      _mm256_storeu_ps(d + 8 * half, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(sc)));
    }
  }
  static void quants(const uint8_t* b, int j, __m256i q[4]) {
    const int h = j / 4, jj = j % 4;
    const uint8_t* qs = b + 32 + 32 * h;
    spread32([&](int i) {   // a set mask bit: q as is; clear: q - 4
      return _mm256_or_si256(bit_field(bcast16(qs + 16 * i), 2 * jj, 2),
                             _mm256_slli_epi16(bit_field(bcast16(b + 16 * i), j, 1), 2));
    }, q);
    for (int i = 0; i < 4; ++i) q[i] = _mm256_sub_epi32(q[i], _mm256_set1_epi32(4));
  }
  static void block(const uint8_t* row, int64_t k, __m256 v[4]) { kblock<Q3_K>(row, k, v); }
};

struct Q2_K : GgmlBlocks<84, 256> {   // 16 scale bytes (scale | min << 4), 64 of 2-bit q, f16 d, f16 dmin
  static constexpr const char* kName = "imp_gemm_f32_q2_kw";
  static constexpr bool kMin = true;
  static void scales(const uint8_t* b, float* d, float* m) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(sc, mask), hi = _mm_and_si128(_mm_srli_epi16(sc, 4), mask);
    const __m256 dd = _mm256_set1_ps(f16(b + 80)), dm = _mm256_set1_ps(f16(b + 82));
    _mm256_storeu_ps(d, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo))));
    _mm256_storeu_ps(d + 8, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)))));
    _mm256_storeu_ps(m, _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi))));
    _mm256_storeu_ps(m + 8, _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))));
  }
  static void quants(const uint8_t* b, int j, __m256i q[4]) {
    const uint8_t* qs = b + 16 + 32 * (j / 4);
    spread32([&](int i) { return bit_field(bcast16(qs + 16 * i), 2 * (j % 4), 2); }, q);
  }
  static void block(const uint8_t* row, int64_t k, __m256 v[4]) { kblock<Q2_K>(row, k, v); }
};

// IQ4_NL / IQ4_XS: 16 bytes of nibbles (weight i < 16 low, i + 16 high) -> the 32 weights' table
// values (llama.cpp's kvalues_iq4nl) as four int32 vectors: the table plus 128 (each then fits a
// byte) looked up by nibble with an in-lane byte shuffle, spread, and the 128 taken off.
inline void iq4_table32(const uint8_t* qs, __m256i q[4]) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_setr_epi8(
      1, 24, 45, 63, 79, 93, 106, 118, static_cast<char>(129), static_cast<char>(141), static_cast<char>(153),
      static_cast<char>(166), static_cast<char>(181), static_cast<char>(197), static_cast<char>(217),
      static_cast<char>(241)));
  spread32([&](int h) { return _mm256_shuffle_epi8(table, bit_field(bcast16(qs), 4 * h, 4)); }, q);
  for (int i = 0; i < 4; ++i) q[i] = _mm256_sub_epi32(q[i], _mm256_set1_epi32(128));
}

// IQ4_XS: f16 d, a uint16 of the 8 sub-block scales' high 2 bits, 4 bytes of their low nibbles, then
// per 32-weight sub-block 16 bytes of nibbles (weight i < 16 low, i + 16 high) indexing IQ4_NL's
// table of 16 int8 values. w = (d * (sc - 32)) * table[q]: both products exact in float32.
struct IQ4_XS : GgmlBlocks<136, 256> {
  static constexpr const char* kName = "imp_gemm_f32_iq4_xsw";
  static constexpr bool kMin = false;
  static void scales(const uint8_t* b, float* d, float*) {
    const float dd = f16(b);
    const int high = b[2] | (b[3] << 8);
    for (int j = 0; j < 8; ++j) {
      const int sc = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4);
      d[2 * j] = d[2 * j + 1] = dd * static_cast<float>(sc - 32);
    }
  }
  static void quants(const uint8_t* b, int j, __m256i q[4]) { iq4_table32(b + 8 + 16 * j, q); }
  static void block(const uint8_t* row, int64_t k, __m256 v[4]) { kblock<IQ4_XS>(row, k, v); }
};

// IQ4_NL, kept as pairs of the file's 18-byte blocks (64 weights; ggml_blocks.py): each block an f16 d
// and 16 bytes of nibbles (weight i < 16 low, i + 16 high) indexing the table; w = d * table[q], exact.
struct IQ4_NL : GgmlBlocks<36, 64> {
  static constexpr const char* kName = "imp_gemm_f32_iq4_nlw";
  static void block(const uint8_t* row, int64_t k, __m256 v[4]) {
    int j;
    const uint8_t* b = at(row, k, j) + 18 * j;
    const __m256 d = _mm256_set1_ps(f16(b));
    __m256i q[4];
    iq4_table32(b + 2, q);
    for (int i = 0; i < 4; ++i) v[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q[i]));
  }
};

// MXFP4: an E8M0 exponent byte e, then 16 bytes of nibbles (weight i < 16 low, i + 16 high) indexing
// the doubled E2M1 values; w = 2^(e - 128) * fp4x2[q], a power of two times an integer of at most 4
// bits: exact (subnormal for the smallest e, inf past float32's range, as gguf-py's).
struct MXFP4 : GgmlBlocks<17> {
  static constexpr const char* kName = "imp_gemm_f32_mxfp4w";
  static float scale(uint8_t e) {   // GGML's ggml_e8m0_to_fp32_half
    const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  static void block(const uint8_t* row, int64_t k, __m256 v[4]) {
    int j;
    const uint8_t* b = at(row, k, j);
    // the table plus 16 (each entry then a non-negative byte), spread, and the 16 taken off
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_setr_epi8(16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4));
    __m256i q[4];
    spread32([&](int h) { return _mm256_shuffle_epi8(table, bit_field(bcast16(b + 1), 4 * h, 4)); }, q);
    const __m256 d = _mm256_set1_ps(scale(b[0]));
    for (int i = 0; i < 4; ++i) v[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], _mm256_set1_epi32(16))));
  }
};

using imp_simd::hsum;

// The MR x NR block of y at (x, w); x and y rows are K and ldy floats apart, w rows ldw bytes. A
// non-null `pf` (the next NR rows of w) is prefetched along the way: the first row block of a
// weight tile reads it from memory, the later ones from L1.
template <class W, int MR, int NR>
void tile(const float* x, const uint8_t* w, int64_t ldw, float* y, int64_t K, int64_t ldy, const uint8_t* pf) {
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0, next_line = 0;
  for (; k + 8 <= K; k += 8) {   // hold the shorter side in registers and stream the other
    if (pf && W::offset(k + 8) > next_line) {   // one prefetch per 64-byte line
      for (int c = 0; c < kNR; ++c) _mm_prefetch(reinterpret_cast<const char*>(pf + c * ldw + next_line), _MM_HINT_T0);
      next_line += 64;
    }
    if constexpr (NR <= MR) {
      __m256 wv[NR];
      for (int c = 0; c < NR; ++c) wv[c] = W::load8(w + c * ldw, k);
      for (int r = 0; r < MR; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * K + k);
        for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    } else {
      __m256 xv[MR];
      for (int r = 0; r < MR; ++r) xv[r] = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < NR; ++c) {
        const __m256 wv = W::load8(w + c * ldw, k);
        for (int r = 0; r < MR; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
      }
    }
  }
  if (k < K) {  // the last K % 8 columns, masked: the lanes past K add 0 * 0
    alignas(32) static const int32_t ramp[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(K - k)),
                                            _mm256_load_si256(reinterpret_cast<const __m256i*>(ramp)));
    __m256 wv[NR];
    for (int c = 0; c < NR; ++c) {
      alignas(32) float tail[8] = {};
      for (int64_t j = k; j < K; ++j) tail[j - k] = W::one(w + c * ldw, j);
      wv[c] = _mm256_load_ps(tail);
    }
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_maskload_ps(x + r * K + k, mask);
      for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) y[r * ldy + c] = hsum(acc[r][c]);
}

// One row of x against NR rows of w (a decode step of one sequence): NR independent accumulators
// keep both FMA pipes busy where a 1 x 3 tile would wait on its three dependency chains, and each
// weight is widened in registers, never stored. The same per-element summation order as `tile`.
template <class W, int NR>
void gemv(const float* x, const uint8_t* w, int64_t ldw, float* y, int64_t K, int64_t, const uint8_t* pf) {
  __m256 acc[NR];
  for (int c = 0; c < NR; ++c) acc[c] = _mm256_setzero_ps();
  int64_t k = 0, next_line = 0;
  if constexpr (W::kSuper) {   // K-quants: a super-block's scales decoded once
    for (; k + W::kWeights <= K; k += W::kWeights) {
      for (; pf && W::offset(k + W::kWeights) > next_line; next_line += 64)
        for (int c = 0; c < NR; ++c) _mm_prefetch(reinterpret_cast<const char*>(pf + c * ldw + next_line), _MM_HINT_T0);
      const uint8_t* b[NR];
      alignas(32) float d[NR][16], m[NR][16];
      for (int c = 0; c < NR; ++c) {
        int j;
        b[c] = W::at(w + c * ldw, k, j);
        W::scales(b[c], d[c], m[c]);
      }
      for (int s = 0; s < W::kWeights / kQBlock; ++s) {   // the rows' NR accumulators interleaved, as below
        const float* xs = x + k + kQBlock * s;
        const __m256 x0 = _mm256_loadu_ps(xs), x1 = _mm256_loadu_ps(xs + 8);
        const __m256 x2 = _mm256_loadu_ps(xs + 16), x3 = _mm256_loadu_ps(xs + 24);
        for (int c = 0; c < NR; ++c) {
          __m256 v[4];
          ksub<W>(b[c], s, d[c], m[c], v);
          acc[c] = _mm256_fmadd_ps(x0, v[0], acc[c]);
          acc[c] = _mm256_fmadd_ps(x1, v[1], acc[c]);
          acc[c] = _mm256_fmadd_ps(x2, v[2], acc[c]);
          acc[c] = _mm256_fmadd_ps(x3, v[3], acc[c]);
        }
      }
    }
    for (int c = 0; c < NR; ++c) y[c] = hsum(acc[c]);
    return;
  }
  constexpr int64_t kStep = W::kBlocks ? kQBlock : 8;
  for (; k + kStep <= K; k += kStep) {
    if (pf && W::offset(k + kStep) > next_line) {
      for (int c = 0; c < NR; ++c) _mm_prefetch(reinterpret_cast<const char*>(pf + c * ldw + next_line), _MM_HINT_T0);
      next_line += 64;
    }
    if constexpr (W::kBlocks) {
      const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
      const __m256 x2 = _mm256_loadu_ps(x + k + 16), x3 = _mm256_loadu_ps(x + k + 24);
      for (int c = 0; c < NR; ++c) {
        __m256 v[4];
        W::block(w + c * ldw, k, v);
        acc[c] = _mm256_fmadd_ps(x0, v[0], acc[c]);
        acc[c] = _mm256_fmadd_ps(x1, v[1], acc[c]);
        acc[c] = _mm256_fmadd_ps(x2, v[2], acc[c]);
        acc[c] = _mm256_fmadd_ps(x3, v[3], acc[c]);
      }
    } else {
      const __m256 xv = _mm256_loadu_ps(x + k);
      for (int c = 0; c < NR; ++c) acc[c] = _mm256_fmadd_ps(xv, W::load8(w + c * ldw, k), acc[c]);
    }
  }
  if constexpr (!W::kBlocks) {
    if (k < K) {  // the last K % 8 columns, as in `tile`
      alignas(32) static const int32_t ramp[8] = {0, 1, 2, 3, 4, 5, 6, 7};
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(K - k)),
                                              _mm256_load_si256(reinterpret_cast<const __m256i*>(ramp)));
      const __m256 xv = _mm256_maskload_ps(x + k, mask);
      for (int c = 0; c < NR; ++c) {
        alignas(32) float tail[8] = {};
        for (int64_t j = k; j < K; ++j) tail[j - k] = W::one(w + c * ldw, j);
        acc[c] = _mm256_fmadd_ps(xv, _mm256_load_ps(tail), acc[c]);
      }
    }
  }
  for (int c = 0; c < NR; ++c) y[c] = hsum(acc[c]);
}

using TileFn = void (*)(const float*, const uint8_t*, int64_t, float*, int64_t, int64_t, const uint8_t*);

constexpr int64_t kGemvRows = 8;
template <class W>
struct Gemvs {   // Gemvs<W>::fn[nr - 1] for 1 x nr blocks
  static constexpr TileFn fn[kGemvRows] = {gemv<W, 1>, gemv<W, 2>, gemv<W, 3>, gemv<W, 4>,
                                           gemv<W, 5>, gemv<W, 6>, gemv<W, 7>, gemv<W, 8>};
};

// Tiles<W>::fn[mr - 1][nr - 1] handles an mr x nr block (the full 4 x 3 one, and the edges).
template <class W>
struct Tiles {
  static constexpr TileFn fn[kMR][kNR] = {
      {tile<W, 1, 1>, tile<W, 1, 2>, tile<W, 1, 3>},
      {tile<W, 2, 1>, tile<W, 2, 2>, tile<W, 2, 3>},
      {tile<W, 3, 1>, tile<W, 3, 2>, tile<W, 3, 3>},
      {tile<W, 4, 1>, tile<W, 4, 2>, tile<W, 4, 3>},
  };
};

template <class W>
struct Gemm {
  const float* x;
  const uint8_t* w;
  float* y;
  int64_t M, N, K, ldw;   // ldw: bytes per weight row
  int64_t col_blocks, items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Item i: rows [m0, m1) of x against rows [n0, n1) of w; each w tile serves every row block.
  // `scratch` (kNR * K floats) holds a widened weight tile when a narrow format meets several row tiles.
  void item(int64_t i, float* scratch) const {
    const int64_t m0 = (i / col_blocks) * kRowBlock, m1 = std::min(M, m0 + kRowBlock);
    const int64_t n0 = (i % col_blocks) * kColBlock, n1 = std::min(N, n0 + kColBlock);
    if (m1 - m0 == 1) {   // one row: gemv, weights widened in registers
      for (int64_t n = n0; n < n1; n += kGemvRows) {
        const int64_t nr = std::min(kGemvRows, n1 - n);
        const uint8_t* pf = n + 2 * kGemvRows <= N ? w + (n + kGemvRows) * ldw : nullptr;
        Gemvs<W>::fn[nr - 1](x + m0 * K, w + n * ldw, ldw, y + m0 * N + n, K, N, pf);
      }
      return;
    }
    for (int64_t n = n0; n < n1; n += kNR) {
      const int64_t nr = std::min(kNR, n1 - n);
      const uint8_t* pf = n + 2 * kNR <= N ? w + (n + kNR) * ldw : nullptr;
      if constexpr (!W::kBlocks) {
        if (W::kWide || m1 - m0 <= kMR) {   // straight from w
          for (int64_t m = m0; m < m1; m += kMR) {
            const int64_t mr = std::min(kMR, m1 - m);
            Tiles<W>::fn[mr - 1][nr - 1](x + m * K, w + n * ldw, ldw, y + m * N + n, K, N, m == m0 ? pf : nullptr);
          }
          continue;
        }
      }
      widen(w + n * ldw, nr, scratch, pf);   // through the float32 scratch tile
      for (int64_t m = m0; m < m1; m += kMR) {
        const int64_t mr = std::min(kMR, m1 - m);
        Tiles<F32>::fn[mr - 1][nr - 1](x + m * K, reinterpret_cast<const uint8_t*>(scratch), 4 * K,
                                       y + m * N + n, K, N, nullptr);
      }
    }
  }

  // Rows [0, nr) of w as float32 into out (rows K apart), prefetching pf (the next tile) on the way.
  void widen(const uint8_t* w, int64_t nr, float* out, const uint8_t* pf) const {
    if constexpr (W::kSuper) {   // K-quants: a super-block's scales decoded once
      for (int64_t c = 0; c < nr; ++c) {
        int64_t next_line = 0;
        for (int64_t k = 0; k < K; k += W::kWeights) {
          for (; pf && W::offset(k + W::kWeights) > next_line; next_line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(pf + c * ldw + next_line), _MM_HINT_T0);
          int j;
          const uint8_t* b = W::at(w + c * ldw, k, j);
          alignas(32) float d[16], m[16];
          W::scales(b, d, m);
          for (int s = 0; s < W::kWeights / kQBlock; ++s) {
            __m256 v[4];
            ksub<W>(b, s, d, m, v);
            for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + c * K + k + kQBlock * s + 8 * i, v[i]);
          }
        }
      }
    } else if constexpr (W::kBlocks) {
      for (int64_t c = 0; c < nr; ++c) {
        int64_t next_line = 0;
        for (int64_t k = 0; k < K; k += kQBlock) {
          if (pf && W::offset(k + kQBlock) > next_line) {
            _mm_prefetch(reinterpret_cast<const char*>(pf + c * ldw + next_line), _MM_HINT_T0);
            next_line += 64;
          }
          __m256 v[4];
          W::block(w + c * ldw, k, v);
          for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + c * K + k + 8 * j, v[j]);
        }
      }
    } else {
      for (int64_t c = 0; c < nr; ++c) {
        int64_t k = 0, next_line = 0;
        for (; k + 8 <= K; k += 8) {
          if (pf && W::offset(k + 8) > next_line) {
            _mm_prefetch(reinterpret_cast<const char*>(pf + c * ldw + next_line), _MM_HINT_T0);
            next_line += 64;
          }
          _mm256_storeu_ps(out + c * K + k, W::load8(w + c * ldw, k));
        }
        for (; k < K; ++k) out[c * K + k] = W::one(w + c * ldw, k);
      }
    }
  }

  void work() {
    std::unique_ptr<float[]> scratch;
    if (W::kBlocks || (!W::kWide && M > kMR)) scratch.reset(new float[kNR * K]);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      item(i, scratch.get());
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// x [..., K] float32; w [N, ldw bytes] in format W; y [..., N].
template <class W>
ffi::Error Run(ffi::ThreadPool& pool, const float* x, int64_t x_elements, const void* w, int64_t N,
               int64_t K, int64_t ldw, float* y) {
  const int64_t M = K ? x_elements / K : 0;
  if (M == 0 || N == 0) return ffi::Error::Success();
  auto g = std::make_shared<Gemm<W>>();
  g->x = x;
  g->w = static_cast<const uint8_t*>(w);
  g->y = y;
  g->M = M, g->N = N, g->K = K, g->ldw = ldw;
  g->col_blocks = (N + kColBlock - 1) / kColBlock;
  g->items = g->col_blocks * ((M + kRowBlock - 1) / kRowBlock);
  // Helpers pay off past ~256 KFLOP (a 576 x 576 matrix-vector product gains). A helper that
  // starts after the work is gone finds no item and returns; it holds its own reference to `g`,
  // so it never touches freed memory.
  const int64_t helpers = 2 * M * N * K < (1 << 18) ? 0 : std::min(pool.num_threads(), g->items) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([g] { g->work(); });
  g->work();
  while (g->done.load(std::memory_order_acquire) < g->items) _mm_pause();
  return ffi::Error::Success();
}

// The handlers: Plain<W, T> for [N, K] weights of element type T, Blocks<W> for GGML blocks.
template <class W, ffi::DataType T>
ffi::Error Plain(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<T> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() < 1 || wd.size() != 2 || xd.back() != wd[1])
    return ffi::Error::InvalidArgument(std::string(W::kName) + ": x [..., K] and w [N, K] expected");
  return Run<W>(pool, x.typed_data(), x.element_count(), w.untyped_data(), wd[0], wd[1],
                W::offset(wd[1]), y->typed_data());
}

template <class W>
ffi::Error Blocks(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() < 1 || wd.size() != 3 || wd[2] != W::kBytes || xd.back() != wd[1] * W::kWeights)
    return ffi::Error::InvalidArgument(std::string(W::kName) + ": x [..., K] and w [N, K / " + std::to_string(W::kWeights) +
                                       ", " + std::to_string(W::kBytes) + "] uint8 expected");
  return Run<W>(pool, x.typed_data(), x.element_count(), w.untyped_data(), wd[0], xd.back(),
                wd[1] * W::kBytes, y->typed_data());
}

}  // namespace
}  // namespace imp_gemm

// One binding per weight type: float32 x, the weights, float32 y, and XLA's thread pool.
#define IMP_GEMM_HANDLER(symbol, impl, wtype)                                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl,                                                      \
                                ffi::Ffi::Bind()                                                   \
                                    .Ctx<ffi::ThreadPool>()                                        \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                  \
                                    .Arg<ffi::Buffer<wtype>>()                                     \
                                    .Ret<ffi::Buffer<ffi::F32>>())
