// The paged attention kernel for int8 rows (symmetric, and with a zero point) (paged_attention.h: why each kind has its file).
#include "paged_attention.h"

namespace hloserve::paged {
HLOSERVE_PAGED_KIND(, Kind::kI8Rows)
HLOSERVE_PAGED_KIND(, Kind::kI8ZpRows)
}  // namespace hloserve::paged
