// The q8 GEMM for K-quant weights (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and IQ4_XS: gemm_q8_iq.h): 256-weight
// super-blocks with integer sub-block scales under f16 ones, multiplied by int8 activations. Included by gemm_q8.h (after
// `Activations`, `quantise` and `idot`), whose header comment specifies the activations: x keeps its
// 32-wide blocks (d_x, sd = d_x * sum q per 32 values), so a super-block meets 8 activation blocks.
//
// y[m, n] = hsum(acc) - hsum(mins), with, per output, in this order:
//   acc (8 float32 lanes, lane l reading weights 4l..4l+3 of each 32-weight block b, b in order):
//     acc_l = fma(dd_{b,l}, float(L_{b,l}), acc_l),
//     L_{b,l} = the exact int32 sum of the lane's 4 products q_w * q_x (q_w: the unsigned stored
//       integers, 0..3 Q2_K, 0..7 Q3_K, 0..15 Q4_K, 0..31 Q5_K, 0..63 Q6_K; Q3_K's w = q_w - 4 and Q6_K's
//       w = q_w - 32 by starting the lane from -4 or -32 times the sum of its 4 q_x, as Q4_0's bias;
//       IQ4_XS: q_w the table's int8 value, gemm_q8_iq.h),
//     dd_{b,l} = fl(D_{b,l} * d_x,b), D_{b,l} = d * sc of the sub-block lane l is in (Q4_K / Q5_K:
//       sc of the 32-weight sub-block b, IQ4_XS: sc - 32; Q2_K / Q3_K (sc - 32) / Q6_K: of the
//       16-weight one, so lanes 0-3 and 4-7 differ),
//       exact in float32 (an f16 times a 6- or 8-bit integer);
//   mins (8 float32 lanes, super-blocks s in order): Q4_K / Q5_K, lane j for sub-block j,
//     mins_j = fl(mins_j + fl(M_{s,j} * sd_{8s+j})), M = dmin * mn (exact); Q2_K (a min per 16 weights,
//     16 a super-block: t = 2j + h for half h of sub-block j), lane j takes t = j, then t = 8 + j,
//     mins_j = fl(mins_j + fl(M_{s,t} * sh_{s,t})), sh the half's d_x * sum q (`Activations::sh`);
//   then `hsum` of each (simd.h) and one float32 subtraction.
// Nothing depends on M, N, the tiling or the instruction set: the integer lanes are the same from
// vpmaddubsw + vpmaddwd (AVX2; no pair saturates int16: 2 * 63 * 127 < 2^15; IQ4_XS: the sign trick) and
// from vpdpbusd (VNNI;
// the AVX-512 path runs the VNNI one-row kernel, and tiles of two weight rows a zmm), and every path
// does the float operations above on them. Against llama.cpp (ggml_vec_dot_q4_K_q8_K: x in 256-wide blocks, integer sums over a
// super-block, one float scale per super-block) this rounds x per 32 values (finer) and scales per
// sub-block in float32.
//
// Work: one row of x goes through `kgemv` (4 far-apart weight rows, unpacked and scales decoded in
// registers, as `gemv`); several through `KGemm`'s tiles, each weight tile's bytes and lane scales D
// prepared once for the 64 rows of a work item (AVX-512: `ktile_zmm`, two weight rows a register; for
// the formats with one scale a 32-weight block, Q4_K, Q5_K and IQ4_XS, the 32-weight formats' `tile_zmm`,
// the products dd formed once per row tile and 8 weight rows instead of in the tile's inner loop).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace imp_q8 {

constexpr int64_t kSuper = 256;   // weights per K-quant super-block
constexpr int64_t kSubs = kSuper / kBlock;   // activation blocks per super-block

// A K-quant format: `decode(sb, D, M)` gives a super-block's lane scales D (per 32-weight block
// j, D[j] the 8 lanes' d * sc; kBlockScale: one scale a block, its 8 lanes equal) and (kMins) its
// mins dmin * mn, kMinVecs<W> vectors of 8; `unpack(sb, w)`
// its 8 blocks of 32 unsigned weights in weight order (table formats: the indices, `unpack_k` looks
// them up). bias / sign_trick as gemm_q8.h's formats (for `idot`).
inline __m256 f16_splat(const uint8_t* p) { return _mm256_set1_ps(f16_at(p)); }

// Vectors of 8 mins per super-block: 0, 1 (Q4_K / Q5_K: per 32 weights, against sd) or 2 (Q2_K: per
// 16 weights, against sh).
template <class W>
inline constexpr int kMinVecs = W::kMins ? 1 : 0;

template <class W, bool Vnni>
inline void unpack_k(const uint8_t* sb, __m256i w[8]) {
  W::unpack(sb, w);
  if constexpr (HasTable<W>::value)
    for (int j = 0; j < 8; ++j) w[j] = lookup<W, Vnni>(w[j]);
}

// Q4_K / Q5_K's 12 bytes of 8 6-bit scales and 8 6-bit mins as 8 bytes each.
inline void scales_k4(const uint8_t* s, uint64_t& sc, uint64_t& mn) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  const uint32_t sc_hi = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
  const uint32_t mn_hi = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
  sc = (u[0] & 0x3f3f3f3f) | static_cast<uint64_t>(sc_hi) << 32;
  mn = (u[1] & 0x3f3f3f3f) | static_cast<uint64_t>(mn_hi) << 32;
}

inline __m256 bytes_to_ps(uint64_t v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(v)))); }

// D[j] = all 8 lanes d * sc_j; M = [dmin * mn_j] (f16 d, dmin at bytes 0, 2; scales at 4).
inline void decode_k4(const uint8_t* sb, __m256 D[kSubs], __m256* M) {
  uint64_t sc, mn;
  scales_k4(sb + 4, sc, mn);
  const __m256 d8 = _mm256_mul_ps(f16_splat(sb), bytes_to_ps(sc));
  M[0] = _mm256_mul_ps(f16_splat(sb + 2), bytes_to_ps(mn));
  for (int j = 0; j < kSubs; ++j) D[j] = _mm256_permutevar8x32_ps(d8, _mm256_set1_epi32(j));
}

struct Q4_K {   // f16 d, f16 dmin, 12 scale bytes, 128 bytes of nibbles: w = d * sc * q - dmin * mn
  static constexpr const char* kName = "imp_gemm_q8_q4_kw";
  static constexpr bool kBlockScale = true;
  static constexpr int64_t kBytes = 144;
  static constexpr bool kMins = true;
  static constexpr int32_t bias(bool) { return 0; }
  static constexpr bool sign_trick(bool) { return false; }
  static void decode(const uint8_t* sb, __m256 D[kSubs], __m256* M) { decode_k4(sb, D, M); }
  static void unpack(const uint8_t* sb, __m256i w[kSubs]) {   // sub-blocks 2i, 2i + 1: low, high nibbles of 32 bytes
    const __m256i low = _mm256_set1_epi8(15);
    for (int i = 0; i < kSubs / 2; ++i) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 32 * i));
      w[2 * i] = _mm256_and_si256(raw, low);
      w[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
  }
};

struct Q5_K {   // Q4_K's fields, 32 bytes of fifth bits (bit j of byte l: weight l of sub-block j), 128 of nibbles
  static constexpr const char* kName = "imp_gemm_q8_q5_kw";
  static constexpr bool kBlockScale = true;
  static constexpr int64_t kBytes = 176;
  static constexpr bool kMins = true;
  static constexpr int32_t bias(bool) { return 0; }
  static constexpr bool sign_trick(bool) { return false; }
  static void decode(const uint8_t* sb, __m256 D[kSubs], __m256* M) { decode_k4(sb, D, M); }
  static void unpack(const uint8_t* sb, __m256i w[kSubs]) {
    const __m256i low = _mm256_set1_epi8(15), bit = _mm256_set1_epi8(16);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16));
    for (int i = 0; i < kSubs / 2; ++i) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 48 + 32 * i));
      // bit 2i of each qh byte to bit 4 (shifts of 16-bit lanes: the mask drops what crossed bytes)
      const __m256i h0 = _mm256_and_si256(2 * i <= 4 ? _mm256_slli_epi16(qh, 4 - 2 * i) : _mm256_srli_epi16(qh, 2 * i - 4), bit);
      const __m256i h1 = _mm256_and_si256(2 * i + 1 <= 4 ? _mm256_slli_epi16(qh, 3 - 2 * i) : _mm256_srli_epi16(qh, 2 * i - 3), bit);
      w[2 * i] = _mm256_or_si256(_mm256_and_si256(raw, low), h0);
      w[2 * i + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), h1);
    }
  }
};

// Lane scales of 16-weight scales: block j's lanes 0-3 (its first 16 weights) take scale 2j, lanes 4-7
// scale 2j + 1, from lo (scales 0-7) and hi (8-15).
inline void pair_lanes(__m256 lo, __m256 hi, __m256 D[kSubs]) {
  for (int j = 0; j < kSubs; ++j) {
    const int at = 2 * (j % 4);
    D[j] = _mm256_permutevar8x32_ps(j < 4 ? lo : hi, _mm256_setr_epi32(at, at, at, at, at + 1, at + 1, at + 1, at + 1));
  }
}

struct Q3_K {   // 32 bytes of high bits, 64 of 2-bit pairs, 12 scale bytes, f16 d: w = d * (sc - 32) * (q - 4)
  static constexpr const char* kName = "imp_gemm_q8_q3_kw";
  static constexpr bool kBlockScale = false;
  static constexpr int64_t kBytes = 110;
  static constexpr bool kMins = false;
  static constexpr int32_t bias(bool) { return 4; }
  static constexpr bool sign_trick(bool) { return false; }
  // 16 6-bit scales t, minus 32: low 4 bits the low nibble of byte t (t < 8) or the high one of byte
  // t - 8, high 2 bits bits 2 (t / 4), 2 (t / 4) + 1 of byte 8 + t % 4
  static void decode(const uint8_t* sb, __m256 D[kSubs], __m256*) {
    uint32_t a[3];
    std::memcpy(a, sb + 96, 12);
    const uint32_t s[4] = {(a[0] & 0x0f0f0f0f) | ((a[2] & 0x03030303) << 4),
                           (a[1] & 0x0f0f0f0f) | (((a[2] >> 2) & 0x03030303) << 4),
                           ((a[0] >> 4) & 0x0f0f0f0f) | (((a[2] >> 4) & 0x03030303) << 4),
                           ((a[1] >> 4) & 0x0f0f0f0f) | (((a[2] >> 6) & 0x03030303) << 4)};
    __m128i sc;
    std::memcpy(&sc, s, 16);
    sc = _mm_sub_epi8(sc, _mm_set1_epi8(32));
    const __m256 d = f16_splat(sb + 108);
    const __m256 lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    const __m256 hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    pair_lanes(lo, hi, D);
  }
  // block 4h + k: bits 2k, 2k + 1 of qs[32h ..], and bit 4h + k of hmask[..] as bit 2
  static void unpack(const uint8_t* sb, __m256i w[kSubs]) {
    const __m256i two = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb));
    for (int h = 0; h < 2; ++h) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 32 + 32 * h));
      for (int k = 0; k < 4; ++k) {
        const int j = 4 * h + k;
        const __m256i low = _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), two);
        const __m256i high = _mm256_and_si256(j <= 2 ? _mm256_slli_epi16(hm, 2 - j) : _mm256_srli_epi16(hm, j - 2), four);
        w[j] = _mm256_or_si256(low, high);
      }
    }
  }
};

struct Q2_K {   // 16 scale bytes (scale, min nibbles per 16 weights), 64 bytes of 2-bit q, f16 d, f16 dmin:
                // w = d * sc * q - dmin * mn
  static constexpr const char* kName = "imp_gemm_q8_q2_kw";
  static constexpr bool kBlockScale = false;
  static constexpr int64_t kBytes = 84;
  static constexpr bool kMins = true;
  static constexpr int32_t bias(bool) { return 0; }
  static constexpr bool sign_trick(bool) { return false; }
  // scale t (low nibble of byte t) for weights 16t..16t+15: block j's lanes 0-3 take 2j, 4-7 2j + 1; the
  // mins (high nibbles) M[0] = t 0-7, M[1] = t 8-15
  static void decode(const uint8_t* sb, __m256 D[kSubs], __m256* M) {
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb));
    const __m128i low = _mm_set1_epi8(15);
    const __m128i sc = _mm_and_si128(s, low), mn = _mm_and_si128(_mm_srli_epi16(s, 4), low);
    const __m256 d = f16_splat(sb + 80), dmin = f16_splat(sb + 82);
    const auto lanes = [](__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); };
    pair_lanes(_mm256_mul_ps(d, lanes(sc)), _mm256_mul_ps(d, lanes(_mm_srli_si128(sc, 8))), D);
    M[0] = _mm256_mul_ps(dmin, lanes(mn));
    M[1] = _mm256_mul_ps(dmin, lanes(_mm_srli_si128(mn, 8)));
  }
  // block 4h + k: bits 2k, 2k + 1 of qs[32h ..] (qs at byte 16), as Q3_K's low bits
  static void unpack(const uint8_t* sb, __m256i w[kSubs]) {
    const __m256i two = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 32 * h));
      for (int k = 0; k < 4; ++k) w[4 * h + k] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), two);
    }
  }
};
template <>
inline constexpr int kMinVecs<Q2_K> = 2;

struct Q6_K {   // 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, f16 d: w = d * sc * (q - 32)
  static constexpr const char* kName = "imp_gemm_q8_q6_kw";
  static constexpr bool kBlockScale = false;
  static constexpr int64_t kBytes = 210;
  static constexpr bool kMins = false;
  static constexpr int32_t bias(bool) { return 32; }
  static constexpr bool sign_trick(bool) { return false; }
  // block j's lanes 0-3 read its first 16 weights (scale 2j), lanes 4-7 its last 16 (scale 2j + 1)
  static void decode(const uint8_t* sb, __m256 D[kSubs], __m256*) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192));
    const __m256 d = f16_splat(sb + 208);
    const __m256 lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    const __m256 hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    pair_lanes(lo, hi, D);
  }
  // half h (128 weights): blocks 4h + k from ql[64h + 32 (k % 2) ..] (low nibbles for k < 2, high
  // ones after) and bits 2k, 2k + 1 of qh[32h ..] as bits 4, 5
  static void unpack(const uint8_t* sb, __m256i w[kSubs]) {
    const __m256i low = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * h));
      const __m256i l[4] = {_mm256_and_si256(ql0, low), _mm256_and_si256(ql1, low),
                            _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low)};
      const __m256i hb[4] = {_mm256_and_si256(qh, two), _mm256_and_si256(_mm256_srli_epi16(qh, 2), two),
                             _mm256_and_si256(_mm256_srli_epi16(qh, 4), two), _mm256_and_si256(_mm256_srli_epi16(qh, 6), two)};
      for (int k = 0; k < 4; ++k) w[4 * h + k] = _mm256_or_si256(l[k], _mm256_slli_epi16(hb[k], 4));
    }
  }
};

// The 8 activation sums a super-block's mins vector v meets: sd of its blocks (Q4_K / Q5_K), or sh of
// halves 8v..8v + 7 (Q2_K).
template <class W>
inline const float* min_x(const Activations& a, int64_t r, int64_t b0, int v) {
  if constexpr (kMinVecs<W> == 2) return a.sh_at(r, b0) + 8 * v;
  return a.sd_at(r, b0);
}

// One row of activations (row r) against NR weight rows `stride` bytes apart (into y, ystride floats
// apart): the header's sums, weights and scales decoded in registers, super-block by super-block.
template <class W, bool Vnni, int NR>
void kgemv(const Activations& a, int64_t r, const uint8_t* w, int64_t stride, float* y, int64_t ystride) {
  __m256 acc[NR], mins[NR];
  IMP_Q8_UNROLL for (int c = 0; c < NR; ++c) acc[c] = _mm256_setzero_ps(), mins[c] = _mm256_setzero_ps();
  const int64_t supers = a.nb / kSubs;
  for (int64_t s = 0; s < supers; ++s) {
    const int64_t b0 = s * kSubs;
    const float* dx = a.d_at(r, b0);
    const int32_t* init = W::bias(Vnni) ? a.lanes_at(r, b0) : nullptr;
    IMP_Q8_UNROLL for (int c = 0; c < NR; ++c) {
      const uint8_t* sb = w + c * stride + s * W::kBytes;
      __m256 D[kSubs], M[2];
      __m256i wv[kSubs];
      W::decode(sb, D, M);
      unpack_k<W, Vnni>(sb, wv);
      IMP_Q8_UNROLL for (int v = 0; v < kMinVecs<W>; ++v)
        mins[c] = _mm256_add_ps(mins[c], _mm256_mul_ps(M[v], _mm256_loadu_ps(min_x<W>(a, r, b0, v))));
      IMP_Q8_UNROLL for (int j = 0; j < kSubs; ++j) {
        const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q_at(r, b0 + j)));
        const __m256i lanes = idot<W, Vnni>(wv[j], qx, init + 8 * j);
        const __m256 dd = _mm256_mul_ps(D[j], _mm256_broadcast_ss(dx + j));
        acc[c] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(lanes), acc[c]);
      }
    }
  }
  IMP_Q8_UNROLL for (int c = 0; c < NR; ++c) {
    float v = hsum(acc[c]);
    if constexpr (W::kMins) v -= hsum(mins[c]);
    y[c * ystride] = v;
  }
}

using KGemvFn = void (*)(const Activations&, int64_t, const uint8_t*, int64_t, float*, int64_t);

template <class W, bool Vnni>
struct KGemvs {   // fn[nr - 1]: one row against nr weight rows
  static constexpr KGemvFn fn[kGemvNR] = {kgemv<W, Vnni, 1>, kgemv<W, Vnni, 2>, kgemv<W, Vnni, 3>, kgemv<W, Vnni, 4>};
};

// Row r of x against weight rows [n0, n1) in kGemvNR streams, as gemv_item.
template <class W, bool Vnni>
void kgemv_item(const Activations& a, int64_t r, const uint8_t* w, int64_t ldw, int64_t n0, int64_t n1, float* y) {
  const int64_t cols = n1 - n0, span = (cols + kGemvNR - 1) / kGemvNR;
  for (int64_t j = 0; j < span; ++j) {
    const int64_t nr = std::min(kGemvNR, (cols - j + span - 1) / span);
    KGemvs<W, Vnni>::fn[nr - 1](a, r, w + (n0 + j) * ldw, span * ldw, y + n0 + j, span);
  }
}

// A weight tile as the tiles read it: its rows in pairs (2p, 2p + 1), per pair and block the two rows'
// unsigned bytes side by side [rows / 2, nb, 2, 32] and so their lane scales D [rows / 2, nb, 2, 8]
// (one 512-bit load each for `ktile_zmm`); per row (kMins) mins [nb / 8, 2, 8] (the second vector Q2_K's
// only). Zeroed at first: the missing row of an odd tile reads as finite values (not stored).
struct KTile {
  std::unique_ptr<uint8_t[]> bytes;
  std::unique_ptr<float[]> floats;
  int64_t nb;
  float *D, *M;
  KTile(int64_t rows, int64_t nb)
      : bytes(new uint8_t[(rows + 1) / 2 * 2 * nb * kBlock]()), floats(new float[((rows + 1) / 2 * 2) * nb * 10]()),
        nb(nb), D(floats.get()), M(D + (rows + 1) / 2 * 2 * nb * 8) {}
  uint8_t* bytes_at(int64_t c, int64_t b) const { return bytes.get() + ((c / 2 * nb + b) * 2 + c % 2) * kBlock; }
  float* D_at(int64_t c, int64_t b) const { return D + ((c / 2 * nb + b) * 2 + c % 2) * 8; }
  float* M_at(int64_t c) const { return M + c * nb * 2; }
};

template <class W>
inline float kmins(const Activations& a, int64_t r, const KTile& t, int64_t c);

// The MR x NR block of y for activation rows [r0, r0 + MR) and a prepared tile's NR rows: per output
// the operations of `kgemv`, each weight block read once for the MR rows.
template <class W, bool Vnni, int MR, int NR>
void ktile(const Activations& a, int64_t r0, const KTile& t, float* y, int64_t ldy) {
  const int64_t nb = a.nb;
  __m256 acc[MR][NR];
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r)
    IMP_Q8_UNROLL for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wv[NR];
    __m256 D[NR];
    IMP_Q8_UNROLL for (int c = 0; c < NR; ++c) {
      wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.bytes_at(c, b)));
      D[c] = _mm256_loadu_ps(t.D_at(c, b));
    }
    IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) {
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q_at(r0 + r, b)));
      const __m256 dx = _mm256_broadcast_ss(a.d_at(r0 + r, b));
      const int32_t* init = W::bias(Vnni) ? a.lanes_at(r0 + r, b) : nullptr;
      IMP_Q8_UNROLL for (int c = 0; c < NR; ++c) {
        const __m256i lanes = idot<W, Vnni>(wv[c], qx, init);
        acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(D[c], dx), _mm256_cvtepi32_ps(lanes), acc[r][c]);
      }
    }
  }
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r)
    IMP_Q8_UNROLL for (int c = 0; c < NR; ++c) y[r * ldy + c] = hsum(acc[r][c]) - kmins<W>(a, r0 + r, t, c);
}

// hsum of the mins lanes of activation row r and tile row c, as `kgemv` sums them (0 without mins).
template <class W>
inline float kmins(const Activations& a, int64_t r, const KTile& t, int64_t c) {
  if constexpr (!W::kMins) return 0.0f;
  __m256 mins = _mm256_setzero_ps();
  for (int64_t s = 0; s < a.nb / kSubs; ++s)
    for (int v = 0; v < kMinVecs<W>; ++v)
      mins = _mm256_add_ps(mins, _mm256_mul_ps(_mm256_loadu_ps(t.M_at(c) + 16 * s + 8 * v), _mm256_loadu_ps(min_x<W>(a, r, kSubs * s, v))));
  return hsum(mins);
}

using KTileFn = void (*)(const Activations&, int64_t, const KTile&, float*, int64_t);

// `ktile` on 512 bits (the AVX-512 path): each zmm holds two tile rows' 8 lanes side by side (rows 2p,
// 2p + 1 of NP pairs, as the tile stores them; `ncols` of the tile's rows real, a missing last one's
// lanes not stored), lane for lane the same vpdpbusd, scale product, conversion and fma, then each
// half's `hsum`: the same bits.
constexpr int64_t kZKR = 8;   // tile rows per AVX-512 K-quant tile (as the 32-weight formats' kZNR)

template <class W, int MR, int NP>
IMP_Q8_ZMM void ktile_zmm(const Activations& a, int64_t r0, const KTile& t, float* y, int64_t ldy, int64_t ncols) {
  constexpr bool kBias = W::bias(true) != 0;
  const int64_t nb = a.nb;
  __m512 acc[MR][NP];
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r)
    IMP_Q8_UNROLL for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i wv[NP];
    __m512 D[NP];
    IMP_Q8_UNROLL for (int p = 0; p < NP; ++p) {
      wv[p] = _mm512_loadu_si512(t.bytes_at(2 * p, b));
      D[p] = _mm512_loadu_ps(t.D_at(2 * p, b));
    }
    IMP_Q8_UNROLL for (int r = 0; r < MR; ++r) {
      const __m512i qx = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q_at(r0 + r, b))));
      const __m512i start = kBias ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.lanes_at(r0 + r, b))))
                                  : _mm512_setzero_si512();
      const __m512 dx = _mm512_set1_ps(*a.d_at(r0 + r, b));
      IMP_Q8_UNROLL for (int p = 0; p < NP; ++p) {
        const __m512i lanes = _mm512_dpbusd_epi32(start, wv[p], qx);
        acc[r][p] = _mm512_fmadd_ps(_mm512_mul_ps(D[p], dx), _mm512_cvtepi32_ps(lanes), acc[r][p]);
      }
    }
  }
  IMP_Q8_UNROLL for (int r = 0; r < MR; ++r)
    IMP_Q8_UNROLL for (int p = 0; p < NP; ++p) {
      y[r * ldy + 2 * p] = hsum(_mm512_castps512_ps256(acc[r][p])) - kmins<W>(a, r0 + r, t, 2 * p);
      if (2 * p + 1 < ncols) y[r * ldy + 2 * p + 1] = hsum(_mm512_extractf32x8_ps(acc[r][p], 1)) - kmins<W>(a, r0 + r, t, 2 * p + 1);
    }
}

using KZTileFn = void (*)(const Activations&, int64_t, const KTile&, float*, int64_t, int64_t);

template <class W>
struct KZTiles {   // fn[mr - 1][np - 1]
  static constexpr KZTileFn fn[kMR][kZKR / 2] = {
      {ktile_zmm<W, 1, 1>, ktile_zmm<W, 1, 2>, ktile_zmm<W, 1, 3>, ktile_zmm<W, 1, 4>},
      {ktile_zmm<W, 2, 1>, ktile_zmm<W, 2, 2>, ktile_zmm<W, 2, 3>, ktile_zmm<W, 2, 4>},
      {ktile_zmm<W, 3, 1>, ktile_zmm<W, 3, 2>, ktile_zmm<W, 3, 3>, ktile_zmm<W, 3, 4>},
      {ktile_zmm<W, 4, 1>, ktile_zmm<W, 4, 2>, ktile_zmm<W, 4, 3>, ktile_zmm<W, 4, 4>},
  };
};

template <class W, bool Vnni>
struct KTiles {   // fn[mr - 1][nr - 1]
  static constexpr KTileFn fn[kMR][kNR] = {
      {ktile<W, Vnni, 1, 1>, ktile<W, Vnni, 1, 2>},
      {ktile<W, Vnni, 2, 1>, ktile<W, Vnni, 2, 2>},
      {ktile<W, Vnni, 3, 1>, ktile<W, Vnni, 3, 2>},
      {ktile<W, Vnni, 4, 1>, ktile<W, Vnni, 4, 2>},
  };
};

// y [M, N] = the q8 product of x [M, K] and K-quant super-blocks w [N, K / 256, W::kBytes]; the work
// items as Gemm's (one row: gemv_split's streams; else 64 rows by 48 weight rows).
template <class W, Isa I>
struct KGemm {
  static constexpr bool Vnni = I != kAvx2;
  static constexpr int64_t kTileRows = I == kAvx512 ? kZKR : kNR;   // weight rows prepared at a time
  // AVX-512 and one scale a 32-weight block: the 32-weight formats' tiles (`tile_zmm`) on the weights
  // prepared as theirs (`prepare_blocks`), each lane scale D as their d_w, so the products D * d_x are
  // formed once per row tile and 8 weight rows (`products_zmm`) instead of once per tile row pair
  // and block; then the mins subtracted (`subtract_mins`). The same operations per output as `kgemv`.
  static constexpr bool kBlocks = I == kAvx512 && W::kBlockScale;
  Activations a;
  const uint8_t* w;
  float* y;
  int64_t N, ldw;
  std::vector<int64_t> starts;
  int64_t col_blocks, items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  KGemm(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t workers)
      : a(M, K, W::bias(Vnni) != 0, kMinVecs<W> == 2), w(w), y(y), N(N), ldw((K / kSuper) * W::kBytes),
        starts(M == 1 ? gemv_split(N, ldw, workers) : std::vector<int64_t>()),
        col_blocks((N + kColBlock - 1) / kColBlock),
        items(M == 1 ? starts.size() - 1 : col_blocks * ((M + kRowBlock - 1) / kRowBlock)) {
    quantise(x, W::bias(Vnni), a);
    if (kBlocks && M > 1) pair(a);
  }

  // nr weight rows from w into t: bytes, lane scales, mins.
  void prepare(const uint8_t* w, int64_t nr, KTile& t) const {
    for (int64_t c = 0; c < nr; ++c)
      for (int64_t s = 0; s < a.nb / kSubs; ++s) {
        const uint8_t* sb = w + c * ldw + s * W::kBytes;
        __m256 D[kSubs], M[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        __m256i wv[kSubs];
        W::decode(sb, D, M);
        unpack_k<W, Vnni>(sb, wv);
        for (int j = 0; j < kSubs; ++j) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.bytes_at(c, kSubs * s + j)), wv[j]);
          _mm256_storeu_ps(t.D_at(c, kSubs * s + j), D[j]);
        }
        for (int v = 0; v < 2; ++v) _mm256_storeu_ps(t.M_at(c) + 16 * s + 8 * v, M[v]);
      }
  }

  // `prepare` for kBlocks: the rows' bytes in interleaved pairs and their block scales into s as
  // `Gemm::prepare_zmm` stores them ([nb, kZNP, 64] and [nb, kZNR]), the mins into t.
  IMP_Q8_ZMM void prepare_blocks(const uint8_t* w, int64_t nr, Scratch& s, KTile& t) const {
    const int64_t ldw = this->ldw;
    const __m512i mix = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    uint8_t* bytes = s.bytes.get();
    for (int64_t p = 0; 2 * p < nr; ++p)
      for (int64_t sup = 0; sup < a.nb / kSubs; ++sup) {
        __m256i wv[2][kSubs];
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t c = std::min(2 * p + h, nr - 1);   // a missing row: the one before it (not stored)
          const uint8_t* sb = w + c * ldw + sup * W::kBytes;
          __m256 D[kSubs], M[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
          W::decode(sb, D, M);
          unpack_k<W, true>(sb, wv[h]);
          for (int j = 0; j < kSubs; ++j) s.dw[kZNR * (kSubs * sup + j) + 2 * p + h] = _mm256_cvtss_f32(D[j]);
          for (int v = 0; v < 2; ++v) _mm256_storeu_ps(t.M_at(2 * p + h) + 16 * sup + 8 * v, M[v]);
        }
        for (int j = 0; j < kSubs; ++j)
          _mm512_storeu_si512(bytes + 64 * (kZNP * (kSubs * sup + j) + p),
                              _mm512_permutex2var_epi32(_mm512_castsi256_si512(wv[0][j]), mix, _mm512_castsi256_si512(wv[1][j])));
      }
  }

  // y[m + r, n + c] -= the mins of activation row m + r and tile row c (kMins), as `ktile` subtracts them.
  void subtract_mins(int64_t m, int64_t mr, int64_t n, int64_t nr, const KTile& t) const {
    if constexpr (W::kMins)
      for (int64_t r = 0; r < mr; ++r)
        for (int64_t c = 0; c < nr; ++c) y[(m + r) * N + n + c] -= kmins<W>(a, m + r, t, c);
  }

  void item(int64_t i, std::unique_ptr<KTile>& tile, std::unique_ptr<Scratch>& scratch) const {
    if (a.M == 1) return kgemv_item<W, Vnni>(a, 0, w, ldw, starts[i], starts[i + 1], y);
    const int64_t m0 = (i / col_blocks) * kRowBlock, m1 = std::min(a.M, m0 + kRowBlock);
    const int64_t n0 = (i % col_blocks) * kColBlock, n1 = std::min(N, n0 + kColBlock);
    if (!tile) tile = std::make_unique<KTile>(kTileRows, a.nb);
    if (kBlocks && !scratch) scratch = std::make_unique<Scratch>(a.nb, a.ns);
    for (int64_t n = n0; n < n1; n += kTileRows) {
      const int64_t nr = std::min(kTileRows, n1 - n);
      if constexpr (kBlocks) {
        prepare_blocks(w + n * ldw, nr, *scratch, *tile);
        for (int64_t m = m0; m < m1; m += kZMR) {
          const int64_t mr = std::min(kZMR, m1 - m);
          products_zmm(a, m, mr, *scratch);
          ZTiles<W>::fn[mr - 1][(nr + 1) / 2 - 1](a, m, scratch->bytes.get(), scratch->dd, y + m * N + n, N, nr);
          subtract_mins(m, mr, n, nr, *tile);
        }
        continue;
      }
      prepare(w + n * ldw, nr, *tile);
      for (int64_t m = m0; m < m1; m += kMR) {
        const int64_t mr = std::min(kMR, m1 - m);
        if constexpr (I == kAvx512)
          KZTiles<W>::fn[mr - 1][(nr + 1) / 2 - 1](a, m, *tile, y + m * N + n, N, nr);
        else
          KTiles<W, Vnni>::fn[mr - 1][nr - 1](a, m, *tile, y + m * N + n, N);
      }
    }
  }

  void work() {
    std::unique_ptr<KTile> tile;
    std::unique_ptr<Scratch> scratch;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      item(i, tile, scratch);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

}  // namespace imp_q8
