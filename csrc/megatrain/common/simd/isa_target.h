// Enables an instruction set for the functions of one source file only, never for the whole
// target (STYLE: no -march, no ISA flags on a target). Use, in a kernels/<name>_<isa>.cpp, after
// every #include of a header that other translation units also include:
//
//   #include <immintrin.h>                         // and every other header, first
//   #include "megatrain/common/simd/isa_target.h"
//   MEGATRAIN_ISA_TARGET_BEGIN("avx2,fma")
//   #include "megatrain/common/simd/vec_avx2.h"    // internal-linkage code only from here on
//   ...
//   MEGATRAIN_ISA_TARGET_END()
//
// Between the two, only code with internal linkage (anonymous namespaces, templates instantiated
// with such types) and the file's own entry points may be defined: an inline function with
// external linkage compiled here could be the copy the linker keeps for every other file, and
// run on a CPU without the ISA.
#pragma once

#define MEGATRAIN_ISA_PRAGMA_(x) _Pragma(#x)

#if defined(__clang__)
#define MEGATRAIN_ISA_TARGET_BEGIN(isa) \
  MEGATRAIN_ISA_PRAGMA_(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define MEGATRAIN_ISA_TARGET_END() MEGATRAIN_ISA_PRAGMA_(clang attribute pop)
#else
// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized (_mm512_undefined_pd); not ours.
#define MEGATRAIN_ISA_TARGET_BEGIN(isa)                     \
  MEGATRAIN_ISA_PRAGMA_(GCC push_options)                   \
  MEGATRAIN_ISA_PRAGMA_(GCC target(isa))                    \
  MEGATRAIN_ISA_PRAGMA_(GCC diagnostic push)                \
  MEGATRAIN_ISA_PRAGMA_(GCC diagnostic ignored "-Wmaybe-uninitialized")
#define MEGATRAIN_ISA_TARGET_END()             \
  MEGATRAIN_ISA_PRAGMA_(GCC diagnostic pop)    \
  MEGATRAIN_ISA_PRAGMA_(GCC pop_options)
#endif
