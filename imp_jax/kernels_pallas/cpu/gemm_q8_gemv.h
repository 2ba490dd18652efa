// The one-row path of the q8 GEMM (a batch-1 decode): one row of activations against many weight
// rows, weights unpacked and scales converted in registers. Included by gemm_q8.h (after the formats,
// `Activations` and `idot`), whose header comment specifies the arithmetic; this path keeps its
// float sums exactly (per output 8 lanes, block by block fma(dd, lanes), `hsum`, then the Q4_1
// offsets in block order), so a row's bits are the same here as in a multi-row tile, whichever of
// the kernels below computed them.
//
// Kernels ("isa", chosen at run time by the CPU, or forced by imp_gemm_q8_run for tests):
//   0 (kAvx2)    `gemv` on ymm: vpmaddubsw + vpmaddwd;
//   1 (kVnni)    `gemv` on ymm: vpdpbusd (AVX512-VNNI + VL);
//   2 (kAvx512)  `gemv_zmm`: two weight rows' blocks in one zmm, vpdpbusd on 512 bits, nibbles split
//                by one vgf2p8affineqb (GFNI; table formats, IQ4_NL / MXFP4: then looked up by one
//                vpshufb), compiled with `target` attributes (the library itself
//                is built for AVX2), so it only runs where the CPU has AVX512-F/BW/DQ/VL/VNNI + GFNI.
//                On Zen 4 (512-bit ops take two 256-bit pipes) it needs ~13% fewer cycles than 1.
// All three give the same int32 lanes and the same float operations on each lane, so the same bits.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace imp_q8 {

// One row of activations (row r) against NR weight rows, `stride` bytes apart from w (into y, ystride
// floats apart), weights and scales converted in registers. The caller spaces the rows far apart: NR
// long sequential streams are what the hardware prefetcher follows (NR adjacent rows read less than
// half the memory bandwidth).
template <class W, bool Vnni, int NR>
void gemv(const Activations& a, int64_t r, const uint8_t* w, int64_t stride, float* y, int64_t ystride) {
  __m256 acc[NR];
  __m128 offsets[NR];   // lane 1: sum_b m_w * sd, one float32 rounding per product and per sum
  IMP_Q8_UNROLL for (int c = 0; c < NR; ++c) acc[c] = _mm256_setzero_ps(), offsets[c] = _mm_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q_at(r, b)));
    const __m128 xs = _mm_unpacklo_ps(_mm_load_ss(a.d_at(r, b)), _mm_load_ss(a.sd_at(r, b)));   // [d_x, sd]
    const int32_t* init = W::bias(Vnni) ? a.lanes_at(r, b) : nullptr;
    IMP_Q8_UNROLL for (int c = 0; c < NR; ++c) {
      const uint8_t* block = w + c * stride + b * W::kBytes;
      const __m128 p = _mm_mul_ps(scales<W>(block), xs);   // [dd, m_w * sd]
      if constexpr (W::kOffset) offsets[c] = _mm_add_ps(offsets[c], p);
      const __m256i lanes = idot<W, Vnni>(W::template weights<Vnni>(block), qx, init);
      acc[c] = _mm256_fmadd_ps(_mm256_broadcastss_ps(p), _mm256_cvtepi32_ps(lanes), acc[c]);
    }
  }
  IMP_Q8_UNROLL for (int c = 0; c < NR; ++c) {
    float v = hsum(acc[c]);
    if constexpr (W::kOffset) v += _mm_cvtss_f32(_mm_movehdup_ps(offsets[c]));
    y[c * ystride] = v;
  }
}

// 2 * NP weight rows as `gemv` reads them, rows 2k and 2k + 1 sharing one zmm per block: the same
// int32 lanes (vpdpbusd) and the same float operations on each lane as `gemv`, so the same bits.
// Lane layout, in 128-bit quarters: Q8_0, [row 2k: weights 0-15, 16-31 | row 2k+1: 0-15, 16-31];
// nibbles, [2k: low nibbles (weights 0-15) | 2k+1: low | 2k: high (16-31) | 2k+1: high], which
// unpacks two rows' 16 bytes with one shift and one and; the activations and -bias lanes are laid
// out to match, and the accumulators put back in `gemv`'s order before the horizontal sums.
constexpr int64_t kLow = 0x0102040800000000, kHigh = 0x1020408000000000;   // bit matrices for vgf2p8affineqb

template <class W, int NP>
IMP_Q8_ZMM void gemv_zmm(const Activations& a, int64_t r, const uint8_t* w, int64_t stride, float* y,
                            int64_t ystride) {
  constexpr bool kBias = W::bias(true) != 0;
  constexpr bool kSplit = W::kNibbles || W::kFifth;   // the nibble layout (Q5_x: plus the fifth bits)
  constexpr int kQuarters = kSplit ? 0x50 : 0x44;   // vshufi64x2: [0, 0, 1, 1] or [0, 1, 0, 1]
  // dd of row 2k (lane 0 of the products) and of row 2k+1 (lane 2) to their quarters
  const __m512i spread = kSplit ? _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2)
                                     : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  // GF(2) affine maps of each byte: qwords 0-3 keep the low nibble (x & 15), 4-7 the high one (x >> 4)
  const __m512i split = _mm512_setr_epi64(kLow, kLow, kLow, kLow, kHigh, kHigh, kHigh, kHigh);
  __m512i table = _mm512_setzero_si512();   // IQ4_NL / MXFP4: the indices' values, in every 128-bit quarter
  if constexpr (HasTable<W>::value) table = _mm512_broadcast_i32x4(W::table(true));
  __m512 acc[NP];
  __m128 offsets[NP];   // lanes 1 and 3: rows 2k and 2k+1's sum_b m_w * sd, as `gemv`'s lane 1
  IMP_Q8_UNROLL for (int k = 0; k < NP; ++k) acc[k] = _mm512_setzero_ps(), offsets[k] = _mm_setzero_ps();
  const int8_t* q = a.q_at(r, 0);
  const int32_t* lanes0 = kBias ? a.lanes_at(r, 0) : nullptr;
  const float *dx = a.d_at(r, 0), *sdx = a.sd_at(r, 0);
  for (int64_t b = 0; b < a.nb; ++b) {
    const __m512i q2 = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock)));
    const __m512i qx = _mm512_shuffle_i64x2(q2, q2, kQuarters);
    __m512i init = _mm512_setzero_si512();
    if constexpr (kBias) {
      const __m512i i2 = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes0 + 8 * b)));
      init = _mm512_shuffle_i64x2(i2, i2, kQuarters);
    }
    const __m128 x2 = _mm_setr_ps(dx[b], sdx[b], dx[b], sdx[b]);   // [d_x, sd, d_x, sd]
    IMP_Q8_UNROLL for (int k = 0; k < NP; ++k) {
      const uint8_t* b0 = w + (2 * k) * stride + b * W::kBytes;
      const uint8_t* b1 = b0 + stride;
      __m128 s;   // [d, m] (Q4_1) or [d, two bytes of weights] (unused) of each row
      if constexpr (HasE8M0<W>::value) {
        s = _mm_setr_ps(e8m0_half(b0[0]), 0.0f, e8m0_half(b1[0]), 0.0f);
      } else {
        int32_t s0, s1;
        std::memcpy(&s0, b0, 4), std::memcpy(&s1, b1, 4);
        s = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(s0), s1, 1));
      }
      const __m128 p = _mm_mul_ps(s, x2);   // [dd0, ms0, dd1, ms1]
      if constexpr (W::kOffset) offsets[k] = _mm_add_ps(offsets[k], p);
      __m512i wv;
      if constexpr (kSplit) {
        constexpr int kAt = W::kBytes - 16;   // the nibbles end the block
        const __m512i raw = _mm512_mask_broadcast_i32x4(   // [row 2k, 2k+1, 2k, 2k+1]'s 16 bytes
            _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + kAt))), 0xf0f0,
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + kAt)));
        wv = _mm512_gf2p8affine_epi64_epi8(raw, split, 0);
        if constexpr (HasTable<W>::value) wv = _mm512_shuffle_epi8(table, wv);
        if constexpr (W::kFifth != 0) {   // + 16 where the fifth bit is set, the bits in the quarters' order
          uint32_t h0, h1;
          std::memcpy(&h0, b0 + W::kFifth, 4), std::memcpy(&h1, b1 + W::kFifth, 4);
          const uint64_t bits = ((h0 & 0xffffu) | (h1 << 16)) | static_cast<uint64_t>((h0 >> 16) | (h1 & 0xffff0000u)) << 32;
          wv = _mm512_mask_add_epi8(wv, _cvtu64_mask64(bits), wv, _mm512_set1_epi8(16));
        }
      } else {
        wv = _mm512_inserti64x4(_mm512_castsi256_si512(W::template weights<true>(b0)), W::template weights<true>(b1), 1);
      }
      const __m512i lanes = _mm512_dpbusd_epi32(init, wv, qx);
      const __m512 dd = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(p));
      acc[k] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(lanes), acc[k]);
    }
  }
  IMP_Q8_UNROLL for (int k = 0; k < NP; ++k) {
    // back to [row 2k's 8 lanes | row 2k+1's 8 lanes]
    const __m512 v = kSplit ? _mm512_shuffle_f32x4(acc[k], acc[k], 0xd8) : acc[k];   // quarters [0, 2, 1, 3]
    float v0 = hsum(_mm512_castps512_ps256(v)), v1 = hsum(_mm512_extractf32x8_ps(v, 1));
    if constexpr (W::kOffset) {
      v0 += _mm_cvtss_f32(_mm_movehdup_ps(offsets[k]));
      v1 += _mm_cvtss_f32(_mm_shuffle_ps(offsets[k], offsets[k], 3));
    }
    y[(2 * k) * ystride] = v0;
    y[(2 * k + 1) * ystride] = v1;
  }
}

using GemvFn = void (*)(const Activations&, int64_t, const uint8_t*, int64_t, float*, int64_t);

constexpr int64_t kGemvNR = 4;     // rows of w per pass (weight streams) when a work item has one row of x
constexpr int64_t kStreamBytes = 32 << 10;   // one row of x: each of kGemvNR weight streams this long

template <class W, bool Vnni>
struct Gemvs {   // fn[isa][nr - 1]: one row against nr weight rows
  static constexpr GemvFn fn[2][kGemvNR] = {
      {gemv<W, Vnni, 1>, gemv<W, Vnni, 2>, gemv<W, Vnni, 3>, gemv<W, Vnni, 4>},
      {gemv<W, true, 1>, gemv_zmm<W, 1>, gemv<W, true, 3>, gemv_zmm<W, 2>},
  };
};

constexpr int64_t kGemvMinRows = 16;   // the smallest work item: 4 passes of kGemvNR rows

// Where the work items of one row of x start, then N. Items of kGemvNR streams of about
// kStreamBytes each while much is left; then each about 1 / (2 * workers) of what is left, down to
// kGemvMinRows: a helper that joins late takes what is left in small pieces, and no thread waits at
// the end on more than a small item of the other's.
inline std::vector<int64_t> gemv_split(int64_t N, int64_t ldw, int64_t workers) {
  const int64_t streams = kGemvNR * ((kStreamBytes + ldw - 1) / ldw);
  std::vector<int64_t> starts{0};
  for (int64_t n = 0; n < N;) {
    const int64_t rows = workers == 1 ? streams : std::max(kGemvMinRows, std::min(streams, (N - n) / (2 * workers)));
    starts.push_back(n = std::min(N, n + rows));
  }
  return starts;
}

// Row r of x against weight rows [n0, n1) (w: row 0, ldw bytes a row) into y (row 0 of y's row r):
// kGemvNR streams of `span` rows each. `isa`: kAvx512 for gemv_zmm (Vnni must then be true).
template <class W, bool Vnni>
void gemv_item(const Activations& a, int64_t r, const uint8_t* w, int64_t ldw, int64_t n0, int64_t n1, float* y,
               Isa isa) {
  const GemvFn* fn = Gemvs<W, Vnni>::fn[Vnni && isa >= kAvx512];
  const int64_t cols = n1 - n0, span = (cols + kGemvNR - 1) / kGemvNR;
  for (int64_t j = 0; j < span; ++j) {
    const int64_t nr = std::min(kGemvNR, (cols - j + span - 1) / span);
    fn[nr - 1](a, r, w + (n0 + j) * ldw, span * ldw, y + n0 + j, span);
  }
}

}  // namespace imp_q8
