// The paged attention kernel for f32, bf16 and f16 caches (paged_attention.h: why each kind has its file).
#include "paged_attention.h"

namespace hloserve::paged {
HLOSERVE_PAGED_KIND(, Kind::kF32)
HLOSERVE_PAGED_KIND(, Kind::kBF16)
HLOSERVE_PAGED_KIND(, Kind::kF16)
}  // namespace hloserve::paged
