// The paged attention kernel for fp8 e4m3 rows (paged_attention.h: why each kind has its file).
#include "paged_attention.h"

namespace hloserve::paged {
HLOSERVE_PAGED_KIND(, Kind::kF8E4M3Rows)
}  // namespace hloserve::paged
