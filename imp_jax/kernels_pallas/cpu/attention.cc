// Ragged paged attention on x86-64 CPUs with AVX2 + FMA, float32 queries over float32 or bfloat16
// caches (computed in float32), as an XLA FFI custom call
// (imp_jax/kernels_pallas/cpu/attention.py). Same contract as the attention oracle
// (xla/oracle.py), which every test compares it against.
//
// Why: the XLA backend (xla/attention.py) gathers each row's pages into a fresh array and
// transposes it before two einsums, so a decode step moves every cached key and value through
// memory three times. Here one work item is a query token: it walks its sequence's block table
// and reads each key and value once, straight from the cache, with an online softmax over chunks
// of at most 16 keys of one page. Items are shared through XLA's intra-op thread pool.
//
// A token's result depends only on its own query, its sequence's pages, its position and its key
// limit (bidirectional image spans: it also sees keys up to key_limit, -1 = causal), never on the
// other tokens of the step.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kChunk = 16;   // keys per online-softmax step (never past the end of a page): 2 vectors
// Chunks whose keys and values are prefetched ahead of the one computed: one left the memory's latency
// exposed at decode (a chunk's arithmetic is shorter than its fetch); two cut the kernel's time by a
// quarter there, more gained nothing (scripts/bench_attention_ab.py, docs/PERF.md).
constexpr int64_t kPrefetchChunks = 2;

using imp_simd::hsum;
using imp_simd::hmax;

// The four horizontal sums of a0..a3, in order.
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// e^x for x <= 0 (Cephes' polynomial after a range reduction by ln 2; ~2 ulp). Lanes below
// -87 (and -inf) give 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// Eight cache elements as float32: float32 as is, bfloat16 (its bits, uint16) shifted into the
// high half of a float32, which is exact.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// C: the caches' element type, float (float32) or uint16_t (bfloat16 bits).
template <typename C>
struct Attention {
  const float* q;          // [T, H, D]
  const C* k_cache;        // [L, NB, BS, KVH, D]
  const C* v_cache;
  const int32_t* qsl;      // [S + 1]
  const int32_t* seq_lens; // [S]
  const int32_t* tables;   // [S, MB]
  const float* sinks;      // [H] attention-sink logits (gpt-oss), or nullptr: none
  const int32_t* key_limit;  // [T] the last key each token sees besides its own past, or nullptr: causal
  float* out;              // [T, H, D]
  int64_t T, H, D, KVH, G, NB, BS, MB, layer, num_seqs, window;
  float sm_scale, soft_cap;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Item t: query token t against its sequence's keys, every head. A key's row of the page holds
  // all KVH heads side by side, so the item streams through each page once, in order.
  void item(int64_t t, std::vector<float>& scratch) const {
    float* o = out + t * H * D;
    const int64_t s = std::upper_bound(qsl + 1, qsl + num_seqs + 1, static_cast<int32_t>(t)) - (qsl + 1);
    if (s >= num_seqs) {   // a padding token
      std::fill(o, o + H * D, 0.0f);
      return;
    }
    const int64_t pos = static_cast<int64_t>(seq_lens[s]) - (qsl[s + 1] - t);
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    // the last key it attends: its own position, or further inside its sequence's KV by its key limit
    const int64_t last =
        key_limit ? std::max<int64_t>(pos, std::min<int64_t>(key_limit[t], seq_lens[s] - 1)) : pos;
    scratch.assign(H * D * 2 + H * kChunk + 2 * H, 0.0f);
    float* qs = scratch.data();            // [H, D]: q * sm_scale
    float* acc = qs + H * D;               // [H, D]
    float* p = acc + H * D;                // [H, kChunk]: this chunk's scores, then weights
    float* m = p + H * kChunk;             // [H]: running max
    float* l = m + H;                      // [H]: running sum of weights
    std::fill(m, m + H, -std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < H * D; ++j) qs[j] = q[t * H * D + j] * sm_scale;
    const int64_t stride = KVH * D;        // between consecutive keys of a page
    const int32_t* table = tables + s * MB;
    // Where the chunk of keys starting at kp lies in the caches, and how many keys it holds.
    const auto chunk = [&](int64_t kp, int64_t& n) {
      const int64_t col = kp / BS, off = kp % BS;
      n = std::min({kChunk, BS - off, last + 1 - kp});
      const int64_t block = col < MB ? std::clamp<int64_t>(table[col], 0, NB - 1) : 0;
      return ((layer * NB + block) * BS + off) * stride;
    };
    // At decode the caches come from memory (the step's weights went through the caches since
    // this layer last ran), and a page is scattered: the keys and values of the next kPrefetchChunks
    // chunks are fetched while this one computes (`fetched`: the first key not yet asked for).
    // Prefetching changes no result.
    int64_t fetched = lo;
    const auto prefetch = [&] {
      if (fetched > last) return;
      int64_t n;
      const int64_t base = chunk(fetched, n);
      const char* kb = reinterpret_cast<const char*>(k_cache + base);
      const char* vb = reinterpret_cast<const char*>(v_cache + base);
      const int64_t bytes = n * stride * static_cast<int64_t>(sizeof(C));
      for (int64_t b = 0; b < bytes; b += 64) {
        _mm_prefetch(kb + b, _MM_HINT_T0);
        _mm_prefetch(vb + b, _MM_HINT_T0);
      }
      fetched += n;
    };
    for (int64_t i = 0; i < kPrefetchChunks; ++i) prefetch();
    for (int64_t kp = lo; kp <= last;) {
      int64_t n;
      const int64_t base = chunk(kp, n);
      prefetch();
      for (int64_t h = 0; h < KVH; ++h)
        scores(qs + h * G * D, k_cache + base + h * D, stride, n, p + h * G * kChunk);
      for (int64_t g = 0; g < H; ++g) {
        float* pg = p + g * kChunk;
        if (soft_cap > 0)
          for (int64_t j = 0; j < n; ++j) pg[j] = soft_cap * std::tanh(pg[j] / soft_cap);
        for (int64_t j = n; j < kChunk; ++j) pg[j] = -std::numeric_limits<float>::infinity();
        const __m256 lo8 = _mm256_loadu_ps(pg), hi8 = _mm256_loadu_ps(pg + 8);
        const float mx = std::max(m[g], hmax(_mm256_max_ps(lo8, hi8)));
        const float scale = std::isinf(m[g]) ? 0.0f : std::exp(m[g] - mx);
        m[g] = mx;
        const __m256 mv = _mm256_set1_ps(mx);
        const __m256 e_lo = exp_nonpositive(_mm256_sub_ps(lo8, mv)), e_hi = exp_nonpositive(_mm256_sub_ps(hi8, mv));
        _mm256_storeu_ps(pg, e_lo);   // the tail past n is -inf, so its weights are 0
        _mm256_storeu_ps(pg + 8, e_hi);
        l[g] = l[g] * scale + hsum(_mm256_add_ps(e_lo, e_hi));
        if (scale != 1.0f) {
          const __m256 sv = _mm256_set1_ps(scale);
          for (int64_t c = 0; c < D; c += 8)
            _mm256_storeu_ps(acc + g * D + c, _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + c), sv));
        }
      }
      for (int64_t h = 0; h < KVH; ++h)
        accumulate(p + h * G * kChunk, v_cache + base + h * D, stride, n, acc + h * G * D);
      kp += n;
    }
    for (int64_t g = 0; g < H; ++g) {
      // a sink adds exp(sink) to the softmax's denominator and nothing to its numerator
      const float total = sinks && !std::isinf(m[g]) ? l[g] + std::exp(sinks[g] - m[g]) : l[g];
      const float inv = total > 0 ? 1.0f / total : 0.0f;
      for (int64_t c = 0; c < D; ++c) o[g * D + c] = acc[g * D + c] * inv;
    }
  }

  // p[g, j] = qs[g] . k_j for the G heads of one kv head and the n keys at kb, kb + stride, ...
  void scores(const float* qs, const C* kb, int64_t stride, int64_t n, float* p) const {
    int64_t g = 0;
    for (; g + 3 <= G; g += 3) head_scores<3>(qs + g * D, kb, stride, n, p + g * kChunk);
    if (G - g == 2) head_scores<2>(qs + g * D, kb, stride, n, p + g * kChunk);
    if (G - g == 1) head_scores<1>(qs + g * D, kb, stride, n, p + g * kChunk);
  }

  // acc[g] += sum_j p[g, j] * v_j for the G heads of one kv head and the n values at vb, ...
  void accumulate(const float* p, const C* vb, int64_t stride, int64_t n, float* acc) const {
    int64_t g = 0;
    for (; g + 3 <= G; g += 3) head_accumulate<3>(p + g * kChunk, vb, stride, n, acc + g * D);
    if (G - g == 2) head_accumulate<2>(p + g * kChunk, vb, stride, n, acc + g * D);
    if (G - g == 1) head_accumulate<1>(p + g * kChunk, vb, stride, n, acc + g * D);
  }

  // GH heads x 4 keys of accumulators (12 of the 16 ymm registers): each key vector is loaded
  // once for all GH heads.
  template <int GH>
  void head_scores(const float* qs, const C* kb, int64_t stride, int64_t n, float* p) const {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      const C* k0 = kb + j * stride;
      __m256 a[GH][4];
      for (int g = 0; g < GH; ++g)
        for (int r = 0; r < 4; ++r) a[g][r] = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 8) {
        __m256 kv[4];
        for (int r = 0; r < 4; ++r) kv[r] = load8(k0 + r * stride + c);
        for (int g = 0; g < GH; ++g) {
          const __m256 qv = _mm256_loadu_ps(qs + g * D + c);
          for (int r = 0; r < 4; ++r) a[g][r] = _mm256_fmadd_ps(qv, kv[r], a[g][r]);
        }
      }
      for (int g = 0; g < GH; ++g) _mm_storeu_ps(p + g * kChunk + j, hsum4(a[g][0], a[g][1], a[g][2], a[g][3]));
    }
    for (; j < n; ++j) {
      const C* kj = kb + j * stride;
      for (int g = 0; g < GH; ++g) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t c = 0; c < D; c += 8)
          a = _mm256_fmadd_ps(_mm256_loadu_ps(qs + g * D + c), load8(kj + c), a);
        p[g * kChunk + j] = hsum(a);
      }
    }
  }

  // GH heads x 4 vectors of the output in registers while the keys go by, then the next 32
  // elements of D (8 at a time where D is not a multiple of 32).
  template <int GH>
  void head_accumulate(const float* p, const C* vb, int64_t stride, int64_t n, float* acc) const {
    int64_t c = 0;
    for (; c + 32 <= D; c += 32) head_accumulate_block<GH, 4>(p, vb + c, stride, n, acc + c);
    for (; c < D; c += 8) head_accumulate_block<GH, 1>(p, vb + c, stride, n, acc + c);
  }

  template <int GH, int CV>
  void head_accumulate_block(const float* p, const C* vb, int64_t stride, int64_t n, float* acc) const {
    __m256 a[GH][CV];
    for (int g = 0; g < GH; ++g)
      for (int v = 0; v < CV; ++v) a[g][v] = _mm256_loadu_ps(acc + g * D + v * 8);
    for (int64_t j = 0; j < n; ++j) {
      __m256 w[GH];
      for (int g = 0; g < GH; ++g) w[g] = _mm256_broadcast_ss(p + g * kChunk + j);
      for (int v = 0; v < CV; ++v) {
        const __m256 x = load8(vb + j * stride + v * 8);
        for (int g = 0; g < GH; ++g) a[g][v] = _mm256_fmadd_ps(w[g], x, a[g][v]);
      }
    }
    for (int g = 0; g < GH; ++g)
      for (int v = 0; v < CV; ++v) _mm256_storeu_ps(acc + g * D + v * 8, a[g][v]);
  }

  void work() {
    std::vector<float> scratch;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < T;) {
      item(i, scratch);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <typename C>
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer& k_cache,
               ffi::AnyBuffer& v_cache, ffi::Buffer<ffi::S32>& layer,
               ffi::Buffer<ffi::S32>& query_start_loc, ffi::Buffer<ffi::S32>& seq_lens,
               ffi::Buffer<ffi::S32>& block_tables, ffi::Buffer<ffi::S32>& num_seqs,
               ffi::Buffer<ffi::F32>& sinks, ffi::Buffer<ffi::S32>& key_limit,
               ffi::ResultBuffer<ffi::F32>& out, float sm_scale, int64_t sliding_window, float soft_cap) {
  const auto qd = q.dimensions(), cd = k_cache.dimensions(), td = block_tables.dimensions();
  const auto vd = v_cache.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || td.size() != 2 || vd.size() != 5 ||
      v_cache.element_type() != k_cache.element_type() ||
      !std::equal(cd.begin(), cd.end(), vd.begin()) || qd[2] != cd[4] || cd[3] == 0 || qd[1] % cd[3] != 0 || qd[2] % 8 != 0 ||
      seq_lens.dimensions().size() != 1 || seq_lens.dimensions()[0] != td[0] ||
      query_start_loc.dimensions().size() != 1 || query_start_loc.dimensions()[0] != td[0] + 1 ||
      sinks.dimensions().size() != 1 || (sinks.dimensions()[0] != 0 && sinks.dimensions()[0] != qd[1]) ||
      key_limit.dimensions().size() != 1 || (key_limit.dimensions()[0] != 0 && key_limit.dimensions()[0] != qd[0]))
    return ffi::Error::InvalidArgument(
        "imp_ragged_paged_attention: q [T, H, D] with D % 8 == 0, caches [L, NB, BS, KVH, D] of one type "
        "with H % KVH == 0, query_start_loc [S + 1], seq_lens [S], block_tables [S, MB], "
        "sinks [H] or [0], key_limit [T] or [0] expected");
  auto a = std::make_shared<Attention<C>>();
  a->q = q.typed_data();
  a->k_cache = static_cast<const C*>(k_cache.untyped_data());
  a->v_cache = static_cast<const C*>(v_cache.untyped_data());
  a->qsl = query_start_loc.typed_data();
  a->seq_lens = seq_lens.typed_data();
  a->tables = block_tables.typed_data();
  a->sinks = sinks.dimensions()[0] ? sinks.typed_data() : nullptr;
  a->key_limit = key_limit.dimensions()[0] ? key_limit.typed_data() : nullptr;
  a->out = out->typed_data();
  a->T = qd[0], a->H = qd[1], a->D = qd[2];
  a->NB = cd[1], a->BS = cd[2], a->KVH = cd[3], a->G = qd[1] / cd[3];
  a->MB = td[1];
  a->layer = std::clamp<int64_t>(layer.typed_data()[0], 0, cd[0] - 1);
  a->num_seqs = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, td[0]);
  a->window = sliding_window;
  a->sm_scale = sm_scale;
  a->soft_cap = soft_cap;
  const int64_t items = a->T;
  if (items == 0 || a->NB == 0 || a->BS == 0) {
    std::fill(a->out, a->out + q.element_count(), 0.0f);
    return ffi::Error::Success();
  }
  // Helpers pay off past ~1 MFLOP (4 per query head, key and element of D). One that starts
  // after the work is gone finds no item and returns; it holds its own reference to `a`.
  int64_t keys = 0;
  for (int64_t s = 0; s < a->num_seqs; ++s) {
    const int64_t new_tokens = a->qsl[s + 1] - a->qsl[s];
    keys += new_tokens * std::max<int64_t>(0, a->seq_lens[s] - new_tokens / 2);
  }
  const int64_t helpers = 4 * keys * a->H * a->D < (1 << 20) ? 0 : std::min(pool.num_threads(), items) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([a] { a->work(); });
  a->work();
  while (a->done.load(std::memory_order_acquire) < items) _mm_pause();
  return ffi::Error::Success();
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                         ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> seq_lens,
                         ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> num_seqs,
                         ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> key_limit,
                         ffi::ResultBuffer<ffi::F32> out, float sm_scale,
                         int64_t sliding_window, float soft_cap) {
  switch (k_cache.element_type()) {
    case ffi::DataType::F32:
      return Run<float>(pool, q, k_cache, v_cache, layer, query_start_loc, seq_lens, block_tables,
                        num_seqs, sinks, key_limit, out, sm_scale, sliding_window, soft_cap);
    case ffi::DataType::BF16:
    case ffi::DataType::U16:   // bfloat16 bits (how a CPU engine stores a bfloat16 cache)
      return Run<uint16_t>(pool, q, k_cache, v_cache, layer, query_start_loc, seq_lens, block_tables,
                           num_seqs, sinks, key_limit, out, sm_scale, sliding_window, soft_cap);
    default:
      return ffi::Error::InvalidArgument("imp_ragged_paged_attention: float32 or bfloat16 (or its bits in uint16) caches expected");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ImpRaggedPagedAttentionF32, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // k_cache: float32 or bfloat16
                                  .Arg<ffi::AnyBuffer>()          // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()   // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs []
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks [H] (gpt-oss) or [0]: none
                                  .Arg<ffi::Buffer<ffi::S32>>()   // key_limit [T] or [0]: causal
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap"));

extern "C" int imp_kernel_cpu_supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
