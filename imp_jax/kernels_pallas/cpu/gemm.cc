// The projection GEMM's XLA FFI handlers for float32 and bfloat16 weights and the 32-weight GGML
// blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1); the kernel itself, and what each format is: gemm_exact.h.
#include "gemm_exact.h"

namespace {

constexpr auto GemmF32 = imp_gemm::Plain<imp_gemm::F32, ffi::F32>;
constexpr auto GemmBf16 = imp_gemm::Plain<imp_gemm::BF16, ffi::BF16>;
constexpr auto GemmQ8_0 = imp_gemm::Blocks<imp_gemm::Q8_0>;
constexpr auto GemmQ4_0 = imp_gemm::Blocks<imp_gemm::Q4_0>;
constexpr auto GemmQ4_1 = imp_gemm::Blocks<imp_gemm::Q4_1>;
constexpr auto GemmQ5_0 = imp_gemm::Blocks<imp_gemm::Q5_0>;
constexpr auto GemmQ5_1 = imp_gemm::Blocks<imp_gemm::Q5_1>;

}  // namespace

IMP_GEMM_HANDLER(ImpGemmF32, GemmF32, ffi::F32);
IMP_GEMM_HANDLER(ImpGemmBf16W, GemmBf16, ffi::BF16);
IMP_GEMM_HANDLER(ImpGemmQ8_0W, GemmQ8_0, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ4_0W, GemmQ4_0, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ4_1W, GemmQ4_1, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ5_0W, GemmQ5_0, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ5_1W, GemmQ5_1, ffi::U8);

extern "C" int imp_kernel_cpu_supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
