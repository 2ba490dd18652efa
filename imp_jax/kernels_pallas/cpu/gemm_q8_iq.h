// The q8 GEMM's table formats: weights whose stored 4-bit integers index a table of 16 int8 values,
// llama.cpp's kvalues_iq4nl (IQ4_NL, IQ4_XS) or kvalues_mxfp4 (MXFP4: E2M1 doubled). Included by
// gemm_q8.h (after the K-quants); the arithmetic is that of its header comment (32-weight blocks) or of
// gemm_q8_k.h's (IQ4_XS's super-blocks), with q_w = table[index]:
//   IQ4_NL  a kept 64-weight block is two of the file's 18-byte blocks (f16 d, 16 bytes of indices), read
//           as 32-weight blocks: w = d * table[q];
//   MXFP4   E8M0 exponent byte e, 16 bytes of indices: w = 2^(e - 128) * table[q], d_w = e8m0_half(e)
//           (as ggml_vec_dot_mxfp4_q8_0: GGML_E8M0_TO_FP32_HALF(e) times the activation block's d);
//   IQ4_XS  f16 d, 8 6-bit scales, per 32-weight sub-block 16 bytes of indices: D = d * (sc - 32).
// The dot reads table[q] as the integer dot needs it (`table(vnni)`): with vpdpbusd the values plus
// the bias as unsigned bytes, the lanes starting from -bias times the activations' 4-byte sums (IQ4:
// 128; MXFP4: 12, values 0..24); IQ4 with vpmaddubsw the signed values and the sign trick (w + 128 would
// saturate a pair: 2 * 241 * 127 > 2^15; |w| <= 127 does not). Every path gets the same int32 lanes,
// so the same bits; the AVX-512 paths split the indices with GFNI / shifts and look them up with one
// vpshufb on 512 bits.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace imp_q8 {

inline __m128i iq4_table(bool vnni) {   // kvalues_iq4nl, + 128 (as uint8) for vpdpbusd
  const __m128i v = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
  return vnni ? _mm_xor_si128(v, _mm_set1_epi8(-128)) : v;
}

struct IQ4_NL {   // a file block: f16 d, 16 bytes of indices (weight j < 16 low nibble of byte j, j + 16 high)
  static constexpr const char* kName = "imp_gemm_q8_iq4_nlw";
  static constexpr int64_t kBytes = 18;       // as read: the file's 32-weight blocks
  static constexpr int64_t kKeptBytes = 36;   // as kept (ggml_blocks.py): two of them, 64 weights
  static constexpr bool kOffset = false, kNibbles = true, kUnpack = true;
  static constexpr int kFifth = 0;
  static constexpr int32_t bias(bool vnni) { return vnni ? 128 : 0; }
  static constexpr bool sign_trick(bool vnni) { return !vnni; }
  static __m128i table(bool vnni) { return iq4_table(vnni); }
  template <bool Vnni>
  static __m256i weights(const uint8_t* b) { return lookup<IQ4_NL, Vnni>(nibbles(b + 2)); }
};

struct MXFP4 {   // E8M0 e, 16 bytes of indices: w = 2^(e - 128) * kvalues_mxfp4[q]
  static constexpr const char* kName = "imp_gemm_q8_mxfp4w";
  static constexpr int64_t kBytes = 17;
  static constexpr bool kOffset = false, kNibbles = true, kUnpack = true, kE8M0 = true;
  static constexpr int kFifth = 0;
  static constexpr int32_t bias(bool) { return 12; }
  static constexpr bool sign_trick(bool) { return false; }
  static __m128i table(bool) {   // 0, 1, 2, 3, 4, 6, 8, 12, 0 (-0), -1, ..., -12; + 12
    return _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  }
  template <bool Vnni>
  static __m256i weights(const uint8_t* b) { return lookup<MXFP4, Vnni>(nibbles(b + 1)); }
};

struct IQ4_XS {   // f16 d, uint16 of the scales' high 2 bits, 4 bytes of their low nibbles, 128 of indices:
                  // w = d * (sc - 32) * kvalues_iq4nl[q]
  static constexpr const char* kName = "imp_gemm_q8_iq4_xsw";
  static constexpr bool kBlockScale = true;
  static constexpr int64_t kBytes = 136;
  static constexpr bool kMins = false;
  static constexpr int32_t bias(bool vnni) { return vnni ? 128 : 0; }
  static constexpr bool sign_trick(bool vnni) { return !vnni; }
  static __m128i table(bool vnni) { return iq4_table(vnni); }
  // scale j: low nibble of byte 4 + j / 2 (the low one for even j), high 2 bits bits 2j, 2j + 1 of the uint16 at 2
  static void decode(const uint8_t* sb, __m256 D[kSubs], __m256*) {
    uint16_t high;
    std::memcpy(&high, sb + 2, 2);
    uint64_t sc = 0;
    for (int j = 0; j < kSubs; ++j)
      sc |= static_cast<uint64_t>(((sb[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4)) << (8 * j);
    const __m128i s = _mm_sub_epi8(_mm_cvtsi64_si128(static_cast<int64_t>(sc)), _mm_set1_epi8(32));
    const __m256 d8 = _mm256_mul_ps(f16_splat(sb), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s)));
    for (int j = 0; j < kSubs; ++j) D[j] = _mm256_permutevar8x32_ps(d8, _mm256_set1_epi32(j));
  }
  static void unpack(const uint8_t* sb, __m256i w[kSubs]) {   // the indices; unpack_k looks them up
    for (int j = 0; j < kSubs; ++j) w[j] = nibbles(sb + 8 + 16 * j);
  }
};

}  // namespace imp_q8
