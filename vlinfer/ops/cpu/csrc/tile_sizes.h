// The few-row expert kernel's (moe_experts.cpp) and the panel kernels' (panels.h) microkernels are
// templates over their tile's rows (and columns), 1..4 each, so the accumulators stay in registers;
// this turns a runtime tile size into those constants.
#pragma once

#include <cstdint>
#include <type_traits>

// f(std::integral_constant<int, R>{}) for R = min(rows, 4) (callers pass 1..4; 0 is taken as 1).
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// f(std::integral_constant<int, R>{}, std::integral_constant<int, C>{}) for R = min(rows, 4), C =
// min(cols, 4) (callers pass 1..4; 0 is taken as 1).
template <typename F>
inline void with_tile_size(int64_t rows, int64_t cols, F&& f) {
  with_rows(rows, [&](auto r) { with_rows(cols, [&](auto c) { f(r, c); }); });
}
