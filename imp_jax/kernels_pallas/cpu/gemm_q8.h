// The int8-activation ("q8") GEMM for GGML block weights: llama.cpp's arithmetic, opt-in
// (`--gemm cpu_q8`), included by gemm.cc, which binds it as the imp_gemm_q8_* custom calls.
//
// y[m, n] = sum over 32-weight blocks b of  dd * isum  (+ m_w[n, b] * sd[m, b] for Q4_1 / Q5_1), where
//   x is quantised per row and block:  amax = max |x_j|,  d_x = amax / 127,
//     q_j = round_half_even(x_j * (127 / amax))  (int8; all 0 when amax = 0),  sd = d_x * sum_j q_j;
//   isum = sum_j q_w,j * q_j, exact in int32 (Q8_0: q_w the int8s; Q4_0: nibble - 8; Q4_1: nibble;
//     Q5_0: nibble + 16 * fifth bit - 16; Q5_1: nibble + 16 * fifth bit);
//   dd = d_w * d_x (one float32 rounding); every float op in float32.
// The K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: 256-weight super-blocks) meet the same activations with their
// own sums, specified in gemm_q8_k.h; the table formats (IQ4_NL and MXFP4 here, IQ4_XS as a K-quant: their
// stored integers index a table of 16 int8s) are specified in gemm_q8_iq.h.
// So outputs differ from the exact product by x's 8-bit rounding (at most half a step, 0.4% of the
// block's largest |x|), not by the weights: those are used exactly as stored.
//
// The float sums, in an order fixed whatever M, N, the tiling or the instruction set: per output, 8
// lanes each take, block by block, fma(dd, the lane's int32 sum of 4 products, lane); then the
// horizontal sum of `hsum`; then (Q4_1) plus the offsets, sum_b m_w * sd accumulated in block order
// (product and sum each rounded). A row's result therefore does not depend on the rows around it.
//
// Integer dots of 32 unsigned by 32 signed bytes: vpmaddubsw + vpmaddwd (AVX2; no pair saturates
// int16: 2 * 15 * 127 and 2 * 128 * 127 < 2^15) or vpdpbusd (AVX-512 VNNI, chosen at run time where
// the CPU has it); both give the same int32 lanes, so the same outputs. Nibbles are unsigned already.
// Signed weights are read as w + bias (Q4_0 / Q5_0: the unsigned integers; Q8_0 with VNNI: w xor 0x80), the lanes
// starting from -bias times the sums of the activations' 4-byte groups (computed at quantisation);
// Q8_0 (and the IQ4 tables) with AVX2 use llama.cpp's sign trick, |w| times x with w's sign, as w + 128
// would saturate.
//
// Work: one row of x (a batch-1 decode) goes through `gemv`, weights unpacked and scales converted
// in registers, its 4 weight rows far apart so that they are 4 long streams for the hardware
// prefetcher; several rows through `tile`s, each weight tile's nibbles unpacked to bytes and its
// scale products d_w * d_x computed once for all the tiles of rows that meet it.
//
// AVX-512 (`Isa::kAvx512`, where the CPU has F, BW, VL, DQ, VNNI, GFNI and BMI2; compiled per function with
// target attributes, so the library still runs on AVX2-only CPUs): the tiles of several rows use
// 512-bit registers, each holding two outputs' 8 lanes side by side: a weight tile's rows are stored
// in pairs with their 4-byte groups interleaved (lane 2i: row 2p's group i, lane 2i + 1: row
// 2p + 1's), each activation block with every 4-byte group twice, the scale products in pairs, so
// one vpdpbusd, one conversion and one fma advance two outputs by exactly the operations the 8-lane
// paths do; at the end both outputs' lanes are summed as `hsum` sums them, the pairs kept apart.
// The outputs are therefore the same bits as the AVX2 and VNNI paths' (tests/test_cpu_gemm_q8.py).
// Its work items span 256 rows of x (a weight tile unpacked once for them); one row keeps `gemv`.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace imp_q8 {

namespace ffi = xla::ffi;

// Loops over a tile's rows and columns, unrolled before the compiler decides where the accumulator
// arrays live (otherwise GCC keeps them in memory and stores them on every iteration).
#define IMP_Q8_UNROLL _Pragma("GCC unroll 16")

constexpr int64_t kBlock = 32;     // weights per GGML block, values per activation block
constexpr int64_t kMR = 4;         // rows of x per tile (with kNR: 8 accumulators, 4 weight vectors)
constexpr int64_t kNR = 2;         // rows of w per tile
constexpr int64_t kRowBlock = 64;  // rows of x per work item
constexpr int64_t kColBlock = 48;  // rows of w per work item
constexpr int64_t kZMR = 4;        // AVX-512: rows of x per tile
constexpr int64_t kZNP = 4;        // AVX-512: pairs of rows of w per tile (16 accumulators of 32 zmm)
constexpr int64_t kZNR = 2 * kZNP;
constexpr int64_t kZRowBlock = 256;   // AVX-512: rows of x per work item (a weight tile prepared once for them)

// The integer-dot paths (chosen at run time by the CPU; imp_gemm_q8_run forces each for tests):
// AVX2 vpmaddubsw, VNNI vpdpbusd on ymm, AVX-512 (one row: gemm_q8_gemv.h; tiles: below).
enum Isa : int { kAvx2 = 0, kVnni = 1, kAvx512 = 2 };

// The best path this CPU runs.
inline Isa best_isa() {
  __builtin_cpu_init();   // this may run from a static initializer, before libgcc's own
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512vl")) return kAvx2;
  const bool wide = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("gfni") && __builtin_cpu_supports("bmi2");
  return wide ? kAvx512 : kVnni;
}

// The AVX-512 path's functions (the library itself is built for AVX2: these run only where best_isa
// found the instructions).
#define IMP_Q8_ZMM __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,gfni,bmi2,avx2,fma,f16c")))


inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 2^(e - 128) as float32 for an E8M0 exponent byte e (MXFP4's scale under its doubled values), as
// ggml_e8m0_to_fp32_half builds it from bits (subnormal for e < 2).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Traits a format declares only where it has them: `table(vnni)`, a 16-entry table its 4-bit integers
// index (as the integer dot reads the values: gemm_q8_iq.h); `kE8M0`, a scale byte at 0 instead of an f16 d.
template <class W, class = void>
struct HasTable : std::false_type {};
template <class W>
struct HasTable<W, std::void_t<decltype(W::table(true), 0)>> : std::true_type {};
template <class W, class = void>
struct HasE8M0 : std::false_type {};
template <class W>
struct HasE8M0<W, std::void_t<decltype(W::kE8M0)>> : std::true_type {};

// A 32-weight block's scale d as float32.
template <class W>
inline float block_d(const uint8_t* b) {
  if constexpr (HasE8M0<W>::value) return e8m0_half(b[0]);
  return f16_at(b);
}

// 32 indices 0..15 as the table's bytes (vpshufb: the table in both 128-bit halves).
template <class W, bool Vnni>
inline __m256i lookup(__m256i idx) {
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(W::table(Vnni)), idx);
}

using imp_simd::hsum;
using imp_simd::hmax;

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

// Weight formats: a block's bytes; `weights`, its 32 weights as the integer dot reads them, which
// is as unsigned bytes w + bias(vnni) (nibbles are already), or for Q8_0 without VNNI the int8s
// themselves for the sign trick; `kOffset`: an offset m at byte 2 (Q4_1, Q5_1); `kUnpack`: worth
// unpacking once into bytes when a weight tile meets several rows; `kNibbles`: the block ends in
// its 16 bytes of nibbles and has nothing else to unpack (the AVX-512 paths split them directly);
// `kFifth`: where a Q5_x block keeps its fifth bits (the nibbles end it too; the AVX-512 paths split
// those directly and add 16 under a mask of the fifth bits), else 0. (The table formats,
// whose nibbles index 16 int8 values, and MXFP4's E8M0 scale: gemm_q8_iq.h, with the traits below.)
struct Q8_0 {
  static constexpr const char* kName = "imp_gemm_q8_q8_0w";
  static constexpr int64_t kBytes = 34;
  static constexpr bool kOffset = false, kNibbles = false, kUnpack = false;
  static constexpr int kFifth = 0;
  static constexpr int32_t bias(bool vnni) { return vnni ? 128 : 0; }
  static constexpr bool sign_trick(bool vnni) { return !vnni; }   // vpmaddubsw's pairs would saturate
  template <bool Vnni>
  static __m256i weights(const uint8_t* b) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    return Vnni ? _mm256_xor_si256(w, _mm256_set1_epi8(-128)) : w;   // xor 0x80: w + 128 as uint8
  }
};

// A block's 32 nibbles as bytes in weight order: low nibbles are weights 0-15, high ones 16-31.
inline __m256i nibbles(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

struct Q4_0 {   // w = nibble - 8: the nibbles are w + 8
  static constexpr const char* kName = "imp_gemm_q8_q4_0w";
  static constexpr int64_t kBytes = 18;
  static constexpr bool kOffset = false, kNibbles = true, kUnpack = true;
  static constexpr int kFifth = 0;
  static constexpr int32_t bias(bool) { return 8; }
  static constexpr bool sign_trick(bool) { return false; }
  template <bool Vnni>
  static __m256i weights(const uint8_t* b) { return nibbles(b + 2); }
};

struct Q4_1 {   // w = d * nibble + m
  static constexpr const char* kName = "imp_gemm_q8_q4_1w";
  static constexpr int64_t kBytes = 20;
  static constexpr bool kOffset = true, kNibbles = true, kUnpack = true;
  static constexpr int kFifth = 0;
  static constexpr int32_t bias(bool) { return 0; }
  static constexpr bool sign_trick(bool) { return false; }
  template <bool Vnni>
  static __m256i weights(const uint8_t* b) { return nibbles(b + 4); }
};

// A block's 32 fifth bits (a little-endian uint32 at p, bit j for weight j) as bytes 16 or 0.
inline __m256i fifth_bits(const uint8_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);   // byte j / 8 of bits
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));   // then bit j % 8 of it
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(bits), spread), bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

struct Q5_0 {   // f16 d, 4 bytes of fifth bits, 16 of nibbles: w = (nibble + 16 * bit) - 16
  static constexpr const char* kName = "imp_gemm_q8_q5_0w";
  static constexpr int64_t kBytes = 22;
  static constexpr bool kOffset = false, kNibbles = false, kUnpack = true;
  static constexpr int kFifth = 2;
  static constexpr int32_t bias(bool) { return 16; }
  static constexpr bool sign_trick(bool) { return false; }
  template <bool Vnni>
  static __m256i weights(const uint8_t* b) { return _mm256_or_si256(nibbles(b + 6), fifth_bits(b + 2)); }
};

struct Q5_1 {   // f16 d, f16 m, 4 bytes of fifth bits, 16 of nibbles: w = d * (nibble + 16 * bit) + m
  static constexpr const char* kName = "imp_gemm_q8_q5_1w";
  static constexpr int64_t kBytes = 24;
  static constexpr bool kOffset = true, kNibbles = false, kUnpack = true;
  static constexpr int kFifth = 4;
  static constexpr int32_t bias(bool) { return 0; }
  static constexpr bool sign_trick(bool) { return false; }
  template <bool Vnni>
  static __m256i weights(const uint8_t* b) { return _mm256_or_si256(nibbles(b + 8), fifth_bits(b + 4)); }
};

// x [M, K] quantised: q [M, K] int8; per row and block d_x and sd = d_x * sum q ([M, K / 32] each);
// and, for weights read with a bias, -bias times the sums of q's 4-byte groups ([M, K / 32, 8] int32),
// which turn the dot with w + bias back into the dot with w; and, for Q2_K's mins (one per 16 weights),
// sh = d_x * the sum of each 16-value half of q ([M, K / 32, 2]).
struct Activations {
  int64_t M, K, nb, ns;   // ns: nb rounded up to 8, the row stride of d and sd (zero padded)
  std::unique_ptr<uint8_t[]> buffer;   // q, then d, sd, lanes and sh
  int8_t* q;
  float *d, *sd;
  int32_t* lanes;
  float* sh;
  // AVX-512 tiles only (`pair`): q with each 4-byte group twice [M, nb, 64], and so the lanes [M, nb, 16].
  std::unique_ptr<uint8_t[]> paired;
  const uint8_t* q2 = nullptr;
  const int32_t* lanes2 = nullptr;

  Activations(int64_t M, int64_t K, bool biased, bool halves = false)
      : M(M), K(K), nb(K / kBlock), ns((nb + 7) / 8 * 8),
        buffer(new uint8_t[M * K + 4 * M * (2 * ns + (biased ? 8 * nb : 0) + (halves ? 2 * nb : 0))]) {
    q = reinterpret_cast<int8_t*>(buffer.get());
    d = reinterpret_cast<float*>(buffer.get() + M * K);   // K is a multiple of 32: aligned for floats
    sd = d + M * ns;
    lanes = biased ? reinterpret_cast<int32_t*>(sd + M * ns) : nullptr;
    sh = halves ? reinterpret_cast<float*>(sd + M * ns) + (biased ? 8 * M * nb : 0) : nullptr;
    std::fill(d, d + 2 * M * ns, 0.0f);
  }
  const int8_t* q_at(int64_t r, int64_t b) const { return q + r * K + b * kBlock; }
  const float* d_at(int64_t r, int64_t b) const { return d + r * ns + b; }
  const float* sd_at(int64_t r, int64_t b) const { return sd + r * ns + b; }
  const int32_t* lanes_at(int64_t r, int64_t b) const { return lanes + 8 * (r * nb + b); }
  const float* sh_at(int64_t r, int64_t b) const { return sh + 2 * (r * nb + b); }
};

// One row of K = 32 * nb floats. The rounding is the MXCSR's, round-half-even. `lanes` only if bias;
// `sh` (the halves' d_x * sum q, each product rounded once) where not null.
inline void quantise_row(const float* x, int64_t nb, int32_t bias, int8_t* q, float* d, float* sd, int32_t* lanes,
                         float* sh = nullptr) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);   // undoes the packs' lane interleave
  for (int64_t b = 0; b < nb; ++b) {
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(x + b * kBlock + 8 * j);
    const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    const float amax = hmax(a);
    const __m256 scale = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
    __m256i i[4];
    for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], scale));
    const int32_t sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3])));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    const __m256i bytes = _mm256_permutevar8x32_epi32(packed, order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), bytes);
    d[b] = amax / 127.0f;
    sd[b] = d[b] * static_cast<float>(sum);
    if (sh) {
      sh[2 * b] = d[b] * static_cast<float>(hsum_i32(_mm256_add_epi32(i[0], i[1])));
      sh[2 * b + 1] = d[b] * static_cast<float>(hsum_i32(_mm256_add_epi32(i[2], i[3])));
    }
    if (bias) {
      const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes), _mm256_set1_epi16(1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes + 8 * b), _mm256_mullo_epi32(sums, _mm256_set1_epi32(-bias)));
    }
  }
}

inline void quantise(const float* x, int32_t bias, Activations& a) {
  for (int64_t m = 0; m < a.M; ++m)
    quantise_row(x + m * a.K, a.nb, bias, a.q + m * a.K, a.d + m * a.ns, a.sd + m * a.ns,
                 bias ? a.lanes + 8 * m * a.nb : nullptr, a.sh ? a.sh + 2 * m * a.nb : nullptr);
}

// a's q and lanes with each 4-byte group (int32 lane) twice, for the AVX-512 tiles.
IMP_Q8_ZMM inline __m512i twice(__m256i v) {
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), _mm512_castsi256_si512(v));
}

IMP_Q8_ZMM inline void pair(Activations& a) {
  const int64_t blocks = a.M * a.nb;
  a.paired.reset(new uint8_t[64 * blocks * (a.lanes ? 2 : 1)]);
  uint8_t* q2 = a.paired.get();
  int32_t* lanes2 = a.lanes ? reinterpret_cast<int32_t*>(q2 + 64 * blocks) : nullptr;
  for (int64_t i = 0; i < blocks; ++i) {
    _mm512_storeu_si512(q2 + 64 * i, twice(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + kBlock * i))));
    if (lanes2) _mm512_storeu_si512(lanes2 + 16 * i, twice(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.lanes + 8 * i))));
  }
  a.q2 = q2, a.lanes2 = lanes2;
}

// [d, m, 0, 0] of a block (m only where the format has one; the lane is unused otherwise).
template <class W>
inline __m128 scales(const uint8_t* b) {
  if constexpr (HasE8M0<W>::value) return _mm_set_ss(e8m0_half(b[0]));
  uint32_t bits = 0;
  std::memcpy(&bits, b, W::kOffset ? 4 : 2);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int32_t>(bits)));
}

// acc + 8 int32 lanes, lane i the sum of the products of bytes 4i..4i+3 of u (unsigned) and s (signed).
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {   // EVEX: AVX512-VNNI + AVX512VL, checked at run time
  asm("vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
  return acc;
}

inline __m256i maddubs_lanes(__m256i u, __m256i s) {   // the same lanes (from 0) with AVX2
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// A block's int32 lanes of w . qx: w as W::weights<Vnni> gives it, `init` the block's -bias lanes
// (read only for formats with a bias). Exact: the same lanes whichever instructions.
template <class W, bool Vnni>
inline __m256i idot(__m256i w, __m256i qx, const int32_t* init) {
  if constexpr (W::sign_trick(Vnni)) {
    return maddubs_lanes(_mm256_abs_epi8(w), _mm256_sign_epi8(qx, w));
  } else if constexpr (W::bias(Vnni) != 0) {
    const __m256i acc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(init));
    if constexpr (Vnni) return dpbusd(acc, w, qx);
    return _mm256_add_epi32(maddubs_lanes(w, qx), acc);
  } else {
    if constexpr (Vnni) return dpbusd(_mm256_setzero_si256(), w, qx);
    return maddubs_lanes(w, qx);
  }
}

inline void prefetch_rows(const uint8_t* pf, int64_t rows, int64_t ldw, int64_t line) {
  for (int64_t c = 0; c < rows; ++c) _mm_prefetch(reinterpret_cast<const char*>(pf + c * ldw + line), _MM_HINT_T0);
}

}  // namespace imp_q8

#include "gemm_q8_gemv.h"   // the one-row path (gemv), on what is above

namespace imp_q8 {

// Where a tile reads its NR weight rows: for nibble formats their bytes, unpacked (32 a block,
// `stride` bytes a row); else the blocks themselves (`stride` = ldw), converted in registers.
struct WeightRows {
  const uint8_t* p;
  int64_t stride;
};

// The MR x NR block of y for activation rows [r0, r0 + MR) and NR weight rows, the same sums as
// `gemv` without the offsets (`Gemm::offsets` adds them). dd: [MR, NR, ns] products d_w * d_x.
// Each block's weights are read once for the MR rows.
template <class W, bool Vnni, int MR, int NR>
void tile(const Activations& a, int64_t r0, WeightRows w, const float* dd, float* y, int64_t ldy, const uint8_t* pf) {
  const int64_t nb = a.nb;
  const int8_t* q[MR];
  const int32_t* init[MR];
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) q[r] = a.q_at(r0 + r, 0), init[r] = W::bias(Vnni) ? a.lanes_at(r0 + r, 0) : nullptr;
  __m256 acc[MR][NR];
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r)
    IMP_Q8_UNROLL for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t next_line = 0;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wv[NR];
    if constexpr (W::kUnpack) {
      IMP_Q8_UNROLL for (int c = 0; c < NR; ++c)
        wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.p + c * w.stride + b * kBlock));
    } else {
      if (pf && (b + 1) * W::kBytes > next_line) prefetch_rows(pf, NR, w.stride, next_line), next_line += 64;
      IMP_Q8_UNROLL for (int c = 0; c < NR; ++c) wv[c] = W::template weights<Vnni>(w.p + c * w.stride + b * W::kBytes);
    }
    IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) {
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + b * kBlock));
      IMP_Q8_UNROLL for (int c = 0; c < NR; ++c) {
        const __m256 lanes = _mm256_cvtepi32_ps(idot<W, Vnni>(wv[c], qx, init[r] + 8 * b));
        acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(dd + (r * NR + c) * a.ns + b), lanes, acc[r][c]);
      }
    }
  }
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r)
    IMP_Q8_UNROLL for (int c = 0; c < NR; ++c) y[r * ldy + c] = hsum(acc[r][c]);
}

using TileFn = void (*)(const Activations&, int64_t, WeightRows, const float*, float*, int64_t, const uint8_t*);

template <class W, bool Vnni>
struct Tiles {   // fn[mr - 1][nr - 1] for an mr x nr block
  static constexpr TileFn fn[kMR][kNR] = {
      {tile<W, Vnni, 1, 1>, tile<W, Vnni, 1, 2>},
      {tile<W, Vnni, 2, 1>, tile<W, Vnni, 2, 2>},
      {tile<W, Vnni, 3, 1>, tile<W, Vnni, 3, 2>},
      {tile<W, Vnni, 4, 1>, tile<W, Vnni, 4, 2>},
  };
};

// The int32 lanes of start + u . s (4 byte products a lane) on 512 bits: `start` from a zeroing idiom
// when it is 0 (GCC would copy a zero register, an executed move, for each product), else copied.
template <bool kZero>
IMP_Q8_ZMM inline __m512i dpbusd_zmm(__m512i start, __m512i u, __m512i s) {
  __m512i acc;
  if constexpr (kZero) {
    asm("vpxord %0, %0, %0\n\tvpdpbusd %2, %1, %0" : "=&v"(acc) : "v"(u), "v"(s));
  } else {
    acc = _mm512_dpbusd_epi32(start, u, s);
  }
  return acc;
}

// The AVX-512 MR x 2NP block of y for activation rows [r0, r0 + MR) and NP pairs of weight rows
// (`ncols` of them real: an odd last row pairs with zeros, its outputs not stored): `w`, the pairs'
// interleaved blocks [nb, kZNP, 64] (as `Gemm::prepare_zmm` stores them), `dd` the pairs' scale
// products [ns, kZMR, kZNP, 2] (one pointer and constant offsets for all the tile's operands). Each zmm accumulator holds two outputs' lanes, even lanes the first
// row's, odd the second's; lane for lane the same fma of the same operands as `tile`.
template <class W, int MR, int NP>
IMP_Q8_ZMM void tile_zmm(const Activations& a, int64_t r0, const uint8_t* w, const float* dd, float* y, int64_t ldy,
                         int64_t ncols) {
  constexpr bool kBias = W::bias(true) != 0;
  const int64_t nb = a.nb;
  const uint8_t* q[MR];
  const int32_t* init[MR];
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) q[r] = a.q2 + 64 * (r0 + r) * nb, init[r] = kBias ? a.lanes2 + 16 * (r0 + r) * nb : nullptr;
  __m512 acc[MR][NP];
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r)
    IMP_Q8_UNROLL for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i wv[NP];
    IMP_Q8_UNROLL for (int p = 0; p < NP; ++p) wv[p] = _mm512_loadu_si512(w + 64 * (kZNP * b + p));
    IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) {
      const __m512i qx = _mm512_loadu_si512(q[r] + 64 * b);
      const __m512i start = kBias ? _mm512_loadu_si512(init[r] + 16 * b) : _mm512_setzero_si512();
      IMP_Q8_UNROLL for (int p = 0; p < NP; ++p) {
        double both;   // [dd of the pair's first row, of its second]
        std::memcpy(&both, dd + kZMR * kZNR * b + kZNR * r + 2 * p, 8);
        const __m512 lanes = _mm512_cvtepi32_ps(dpbusd_zmm<!kBias>(start, wv[p], qx));
        acc[r][p] = _mm512_fmadd_ps(_mm512_castpd_ps(_mm512_set1_pd(both)), lanes, acc[r][p]);
      }
    }
  }
  // `hsum` of both outputs at once, the interleaved lanes kept apart: lanes i + (i + 4), then those
  // i + (i + 2), then 0 + 1, the same additions of the same operands.
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r)
    IMP_Q8_UNROLL for (int p = 0; p < NP; ++p) {
      const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc[r][p]), _mm512_extractf32x8_ps(acc[r][p], 1));
      const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      const __m128 both = _mm_add_ps(q, _mm_movehl_ps(q, q));   // [first output, second]
      float* out = y + r * ldy + 2 * p;
      if (2 * p + 1 < ncols)
        _mm_storel_pi(reinterpret_cast<__m64*>(out), both);
      else
        _mm_store_ss(out, both);
    }
}

using ZTileFn = void (*)(const Activations&, int64_t, const uint8_t*, const float*, float*, int64_t, int64_t);

template <class W>
struct ZTiles {   // fn[mr - 1][np - 1] for an mr x 2np block
  static constexpr ZTileFn fn[kZMR][kZNP] = {
      {tile_zmm<W, 1, 1>, tile_zmm<W, 1, 2>, tile_zmm<W, 1, 3>, tile_zmm<W, 1, 4>},
      {tile_zmm<W, 2, 1>, tile_zmm<W, 2, 2>, tile_zmm<W, 2, 3>, tile_zmm<W, 2, 4>},
      {tile_zmm<W, 3, 1>, tile_zmm<W, 3, 2>, tile_zmm<W, 3, 3>, tile_zmm<W, 3, 4>},
      {tile_zmm<W, 4, 1>, tile_zmm<W, 4, 2>, tile_zmm<W, 4, 3>, tile_zmm<W, 4, 4>},
  };
};

// A work item's scratch for tiles of several rows: a weight tile's scales d (float32) and unpacked
// bytes, a row tile's products d_w * d_x, and the item's offsets m.
// (AVX-512: the scales d in pairs [ns, kZNP, 2], the bytes in interleaved pairs [nb, kZNP, 64], the
// products [ns, kZMR, kZNP, 2].)
struct Scratch {
  static constexpr int64_t kW = std::max(kNR, kZNR), kDD = std::max(kMR * kNR, kZMR * kZNR);
  std::unique_ptr<float[]> floats;
  std::unique_ptr<uint8_t[]> bytes;
  float *dw, *dd, *mt;   // [kNR, ns], [kMR * kNR, ns], [nb, kColBlock]

  Scratch(int64_t nb, int64_t ns)
      : floats(new float[(kW + kDD) * ns + kColBlock * nb]()), bytes(new uint8_t[kW * nb * kBlock]()),
        dw(floats.get()), dd(dw + kW * ns), mt(dd + kDD * ns) {}
};

// AVX-512: s.dd[b, r, :] = s.dw[b, :] * d_x[m + r, b] for a row tile's mr rows (each rounded once, as
// `Gemm::products`).
IMP_Q8_ZMM inline void products_zmm(const Activations& a, int64_t m, int64_t mr, Scratch& s) {
  const int64_t nb = a.nb, ns = a.ns;
  const float *d = a.d_at(m, 0), *dw = s.dw;
  float* dd = s.dd;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 w = _mm256_loadu_ps(dw + kZNR * b);
    for (int64_t r = 0; r < mr; ++r)
      _mm256_storeu_ps(dd + kZMR * kZNR * b + kZNR * r, _mm256_mul_ps(w, _mm256_broadcast_ss(d + r * ns + b)));
  }
}

}  // namespace imp_q8

#include "gemm_q8_k.h"      // the K-quants (their own one-row path and tiles), on what is above
#include "gemm_q8_iq.h"     // the table formats (IQ4_NL, MXFP4; IQ4_XS as a K-quant)

namespace imp_q8 {

template <class W, Isa I>
struct Gemm {
  static constexpr bool Vnni = I != kAvx2;
  static constexpr int64_t kRows = I == kAvx512 ? kZRowBlock : kRowBlock;   // rows of x per work item
  Activations a;
  const uint8_t* w;
  float* y;
  int64_t N, ldw;
  std::vector<int64_t> starts;   // one row of x: where its items start (gemv_split); else empty
  int64_t cols_per_item, col_blocks, items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // `workers`: the threads that will take items.
  Gemm(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t workers)
      : a(M, K, W::bias(Vnni) != 0), w(w), y(y), N(N), ldw((K / kBlock) * W::kBytes),
        starts(M == 1 ? gemv_split(N, ldw, workers) : std::vector<int64_t>()), cols_per_item(kColBlock),
        col_blocks((N + cols_per_item - 1) / cols_per_item),
        items(M == 1 ? starts.size() - 1 : col_blocks * ((M + kRows - 1) / kRows)) {
    quantise(x, W::bias(Vnni), a);
    if (I == kAvx512 && M > 1) pair(a);
  }

  // Item i: activation rows [m0, m1) against weight rows [n0, n1). One row goes through `gemv`;
  // more go through tiles, each weight tile's scales converted (and nibbles unpacked) once for all
  // the rows.
  void item(int64_t i, std::unique_ptr<Scratch>& scratch) const {
    if (a.M == 1) return gemv_item<W, Vnni>(a, 0, w, ldw, starts[i], starts[i + 1], y, I);
    const int64_t nb = a.nb;
    const int64_t m0 = (i / col_blocks) * kRows, m1 = std::min(a.M, m0 + kRows);
    const int64_t n0 = (i % col_blocks) * cols_per_item, n1 = std::min(N, n0 + cols_per_item);
    if (m1 - m0 == 1) return gemv_item<W, Vnni>(a, m0, w, ldw, n0, n1, y + m0 * N, I);   // a last row alone
    if (!scratch) scratch = std::make_unique<Scratch>(nb, a.ns);
    Scratch& s = *scratch;
    if constexpr (I == kAvx512) {
      item_zmm(m0, m1, n0, n1, s);
      return;
    }
    for (int64_t n = n0; n < n1; n += kNR) {
      const int64_t nr = std::min(kNR, n1 - n);
      const uint8_t* pf = n + 2 * kNR <= N ? w + (n + kNR) * ldw : nullptr;
      const WeightRows rows = prepare(w + n * ldw, nr, s, pf);
      for (int64_t m = m0; m < m1; m += kMR) {
        const int64_t mr = std::min(kMR, m1 - m);
        products(m, mr, nr, s);
        Tiles<W, Vnni>::fn[mr - 1][nr - 1](a, m, rows, s.dd, y + m * N + n, N, m == m0 ? pf : nullptr);
      }
    }
    if constexpr (W::kOffset) offsets(m0, m1, n0, n1, s.mt);
  }

  // `item`'s tiles of several rows with AVX-512: 8 weight rows at a time, in pairs.
  IMP_Q8_ZMM void item_zmm(int64_t m0, int64_t m1, int64_t n0, int64_t n1, Scratch& s) const {
    for (int64_t n = n0; n < n1; n += kZNR) {
      const int64_t nr = std::min(kZNR, n1 - n), np = (nr + 1) / 2;
      const uint8_t* pf = n + 2 * kZNR <= N ? w + (n + kZNR) * ldw : nullptr;
      prepare_zmm(w + n * ldw, nr, s, pf, s.mt + (n - n0));
      for (int64_t m = m0; m < m1; m += kZMR) {
        const int64_t mr = std::min(kZMR, m1 - m);
        products_zmm(a, m, mr, s);
        ZTiles<W>::fn[mr - 1][np - 1](a, m, s.bytes.get(), s.dd, y + m * N + n, N, nr);
      }
    }
    if constexpr (W::kOffset) offsets_zmm(m0, m1, n0, n1, s.mt);
  }

  // nr weight rows from w into the scratch in pairs (a missing last row as the one before it: its
  // outputs are not stored): their blocks as bytes w + bias with the pair's 4-byte groups interleaved,
  // their scales d side by side, and (Q4_1) their offsets m into mt's columns [0, nr) (rows kColBlock
  // apart); prefetching pf (the next tile, whole) on the way, one line per row and block.
  IMP_Q8_ZMM void prepare_zmm(const uint8_t* w, int64_t nr, Scratch& s, const uint8_t* pf, float* mt) const {
    const int64_t nb = a.nb, ldw = this->ldw;   // locals: the stores below may alias any member
    const __m512i mix = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i nibble_order = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 0, 16, 1, 17, 2, 18, 3, 19);
    const __m512i split = _mm512_setr_epi64(kLow, kLow, kLow, kLow, kHigh, kHigh, kHigh, kHigh);   // x & 15, x >> 4
    uint8_t* bytes = s.bytes.get();
    scales_zmm(w, nr, s.dw, mt);
    for (int64_t p = 0; 2 * p < nr; ++p) {
      const uint8_t* w0 = w + 2 * p * ldw;
      const uint8_t* w1 = 2 * p + 1 < nr ? w0 + ldw : w0;
      const uint8_t* pf0 = pf ? pf + 2 * p * ldw : nullptr;
      for (int64_t b = 0; b < nb; ++b) {
        if (pf0) {
          _mm_prefetch(reinterpret_cast<const char*>(pf0 + b * W::kBytes), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(pf0 + ldw + b * W::kBytes), _MM_HINT_T0);
        }
        const uint8_t *b0 = w0 + b * W::kBytes, *b1 = w1 + b * W::kBytes;
        __m512i pairs;
        if constexpr (W::kNibbles || W::kFifth) {   // [row 0's nibbles, row 1's] to dwords in pair order, high nibbles in the upper half
          const __m512i spread = _mm512_permutex2var_epi32(
              _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + W::kBytes - 16))), nibble_order,
              _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + W::kBytes - 16))));
          pairs = _mm512_gf2p8affine_epi64_epi8(spread, split, 0);
          if constexpr (HasTable<W>::value) pairs = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(W::table(true)), pairs);
          if constexpr (W::kFifth != 0) {   // + 16 where the fifth bit is set: byte 4i + j of the pair order is
            uint32_t h0, h1;                // bit 4 (i / 2) + j of row i % 2, so the rows' bits go to alternate nibbles
            std::memcpy(&h0, b0 + W::kFifth, 4), std::memcpy(&h1, b1 + W::kFifth, 4);
            const uint64_t bits = _pdep_u64(h0, 0x0f0f0f0f0f0f0f0full) | _pdep_u64(h1, 0xf0f0f0f0f0f0f0f0ull);
            pairs = _mm512_mask_add_epi8(pairs, _cvtu64_mask64(bits), pairs, _mm512_set1_epi8(16));
          }
        } else {
          pairs = _mm512_permutex2var_epi32(_mm512_castsi256_si512(W::template weights<true>(b0)), mix,
                                            _mm512_castsi256_si512(W::template weights<true>(b1)));
        }
        _mm512_storeu_si512(bytes + 64 * (kZNP * b + p), pairs);
      }
    }
  }

  // The scales d of a tile's nr weight rows from w into dw [nb, kZNR] (row c at column c; a row c >= nr
  // reads row nr - 1 again) and (Q4_1 / Q5_1) their offsets m into mt's columns (rows kColBlock apart):
  // per block one gather of the 8 rows' first 4 bytes, f16 d (and m) converted 8 at a time.
  IMP_Q8_ZMM void scales_zmm(const uint8_t* w, int64_t nr, float* dw, float* mt) const {
    const int64_t nb = a.nb, ldw = this->ldw;
    if constexpr (HasE8M0<W>::value) {
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t c = 0; c < kZNR; ++c) dw[kZNR * b + c] = e8m0_half(w[std::min(c, nr - 1) * ldw + b * W::kBytes]);
    } else {
      const __m256i rows = _mm256_mullo_epi32(_mm256_min_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(nr - 1)),
                                              _mm256_set1_epi32(static_cast<int32_t>(ldw)));
      for (int64_t b = 0; b < nb; ++b) {
        const __m256i h = _mm256_i32gather_epi32(reinterpret_cast<const int*>(w + b * W::kBytes), rows, 1);   // [d, m] as f16
        _mm256_storeu_ps(dw + kZNR * b, _mm256_cvtph_ps(_mm256_cvtepi32_epi16(h)));
        if constexpr (W::kOffset) _mm256_storeu_ps(mt + b * kColBlock, _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(h, 16))));
      }
    }
  }

  // `offsets` with 16 columns to a vector, mt filled by prepare_zmm: the same operations per column.
  IMP_Q8_ZMM void offsets_zmm(int64_t m0, int64_t m1, int64_t n0, int64_t n1, const float* mt) const {
    constexpr int kGroups = kColBlock / 16;
    static_assert(kColBlock % 16 == 0);
    const int64_t nb = a.nb, cols = n1 - n0;
    for (int64_t m = m0; m < m1; ++m) {
      const float* sd = a.sd_at(m, 0);
      __m512 acc[kGroups];
      IMP_Q8_UNROLL for (int g = 0; g < kGroups; ++g) acc[g] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const __m512 s = _mm512_set1_ps(sd[b]);
        IMP_Q8_UNROLL for (int g = 0; g < kGroups; ++g)
          acc[g] = _mm512_add_ps(acc[g], _mm512_mul_ps(_mm512_loadu_ps(mt + b * kColBlock + 16 * g), s));
      }
      alignas(64) float sums[kColBlock];
      IMP_Q8_UNROLL for (int g = 0; g < kGroups; ++g) _mm512_store_ps(sums + 16 * g, acc[g]);
      float* row = y + m * N + n0;
      for (int64_t c = 0; c < cols; ++c) row[c] += sums[c];
    }
  }

  // The scales d of nr weight rows from w as floats into s.dw and, for nibbles, the weights as bytes
  // into s.bytes (prefetching pf, the next rows, on the way); where the tiles read the weights.
  WeightRows prepare(const uint8_t* w, int64_t nr, Scratch& s, const uint8_t* pf) const {
    const int64_t nb = a.nb, ns = a.ns;   // locals: the stores below may alias any member
    float* dw = s.dw;
    uint8_t* bytes = s.bytes.get();
    for (int64_t c = 0; c < nr; ++c) {
      int64_t next_line = 0;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = w + c * ldw + b * W::kBytes;
        dw[c * ns + b] = block_d<W>(block);
        if constexpr (W::kUnpack) {
          if (pf && (b + 1) * W::kBytes > next_line) prefetch_rows(pf + c * ldw, 1, 0, next_line), next_line += 64;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(bytes + (c * nb + b) * kBlock), W::template weights<Vnni>(block));
        }
      }
    }
    if constexpr (W::kUnpack) return {bytes, nb * kBlock};
    return {w, ldw};
  }

  // s.dd[r, c, :] = s.dw[c, :] * d_x[m + r, :] for a row tile's mr rows and nr weight rows, each
  // product rounded to float32 as `gemv` rounds it (rows ns long, zero padded: no tail).
  void products(int64_t m, int64_t mr, int64_t nr, Scratch& s) const {
    const int64_t ns = a.ns;
    const float *d = a.d_at(m, 0), *dw = s.dw;
    float* dd = s.dd;
    for (int64_t b = 0; b < ns; b += 8)
      for (int64_t r = 0; r < mr; ++r) {
        const __m256 dx = _mm256_loadu_ps(d + r * ns + b);
        for (int64_t c = 0; c < nr; ++c) _mm256_storeu_ps(dd + (r * nr + c) * ns + b, _mm256_mul_ps(_mm256_loadu_ps(dw + c * ns + b), dx));
      }
  }

  // y[m, n] += sum_b m_w[n, b] * sd[m, b] for the item's rows and columns, summed as `gemv` does (in
  // block order, product and sum each rounded to float32), all the item's columns at once (8 to a
  // vector; independent chains). mt: [nb, kColBlock].
  void offsets(int64_t m0, int64_t m1, int64_t n0, int64_t n1, float* mt) const {
    constexpr int kGroups = kColBlock / 8;
    const int64_t nb = a.nb, cols = n1 - n0;
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t b = 0; b < nb; ++b) mt[b * kColBlock + c] = f16_at(w + (n0 + c) * ldw + b * W::kBytes + 2);
    for (int64_t m = m0; m < m1; ++m) {
      const float* sd = a.sd_at(m, 0);
      __m256 acc[kGroups];
      IMP_Q8_UNROLL for (int g = 0; g < kGroups; ++g) acc[g] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const __m256 s = _mm256_broadcast_ss(sd + b);
        IMP_Q8_UNROLL for (int g = 0; g < kGroups; ++g)
          acc[g] = _mm256_add_ps(acc[g], _mm256_mul_ps(_mm256_loadu_ps(mt + b * kColBlock + 8 * g), s));
      }
      alignas(32) float sums[kColBlock];
      IMP_Q8_UNROLL for (int g = 0; g < kGroups; ++g) _mm256_store_ps(sums + 8 * g, acc[g]);
      float* row = y + m * N + n0;
      for (int64_t c = 0; c < cols; ++c) row[c] += sums[c];
    }
  }

  void work() {
    std::unique_ptr<Scratch> scratch;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      item(i, scratch);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// The work of format W on path I: Gemm for 32-weight blocks, KGemm for K-quant super-blocks.
template <class W, Isa I, class = void>
struct GemmFor {
  using type = Gemm<W, I>;
};
template <class W, Isa I>
struct GemmFor<W, I, std::void_t<decltype(W::kMins)>> {
  using type = KGemm<W, I>;
};

// y [M, N] = the q8 product of x [M, K] and blocks w [N, K / 32, W::kBytes] (K-quants: super-blocks
// [N, K / 256, W::kBytes]), with XLA's pool (or on this thread alone when `pool` is null).
template <class W, Isa I>
void run(ffi::ThreadPool* pool, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y) {
  if (M == 0 || N == 0) return;
  // As the float32 path: helpers past ~256 KFLOP; each holds its own reference to `g`.
  const int64_t threads = !pool || 2 * M * N * K < (1 << 18) ? 1 : std::max<int64_t>(1, pool->num_threads());
  auto g = std::make_shared<typename GemmFor<W, I>::type>(x, M, K, w, N, y, threads);
  const int64_t helpers = std::min(threads, g->items) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool->Schedule([g] { g->work(); });
  g->work();
  while (g->done.load(std::memory_order_acquire) < g->items) _mm_pause();
}

template <class W>
void dispatch(ffi::ThreadPool* pool, Isa isa, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
              float* y) {
  switch (isa) {
    case kAvx512: run<W, kAvx512>(pool, x, M, K, w, N, y); break;
    case kVnni: run<W, kVnni>(pool, x, M, K, w, N, y); break;
    default: run<W, kAvx2>(pool, x, M, K, w, N, y);
  }
}

}  // namespace imp_q8
