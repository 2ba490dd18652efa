// The projection GEMM's XLA FFI handlers for the K-quant super-blocks (Q2_K..Q6_K), IQ4_XS, IQ4_NL
// and MXFP4 weights; the kernel itself, and what each format is: gemm_exact.h.
#include "gemm_exact.h"

namespace {

constexpr auto GemmQ2_K = imp_gemm::Blocks<imp_gemm::Q2_K>;
constexpr auto GemmQ3_K = imp_gemm::Blocks<imp_gemm::Q3_K>;
constexpr auto GemmQ4_K = imp_gemm::Blocks<imp_gemm::Q4_K>;
constexpr auto GemmQ5_K = imp_gemm::Blocks<imp_gemm::Q5_K>;
constexpr auto GemmQ6_K = imp_gemm::Blocks<imp_gemm::Q6_K>;
constexpr auto GemmIQ4_XS = imp_gemm::Blocks<imp_gemm::IQ4_XS>;
constexpr auto GemmIQ4_NL = imp_gemm::Blocks<imp_gemm::IQ4_NL>;
constexpr auto GemmMXFP4 = imp_gemm::Blocks<imp_gemm::MXFP4>;

}  // namespace

IMP_GEMM_HANDLER(ImpGemmQ2_KW, GemmQ2_K, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ3_KW, GemmQ3_K, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ4_KW, GemmQ4_K, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ5_KW, GemmQ5_K, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmQ6_KW, GemmQ6_K, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmIQ4_XSW, GemmIQ4_XS, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmIQ4_NLW, GemmIQ4_NL, ffi::U8);
IMP_GEMM_HANDLER(ImpGemmMXFP4W, GemmMXFP4, ffi::U8);
