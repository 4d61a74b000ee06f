#include "comm/codecs/low_rank.h"

#include <cmath>
#include <cstring>
#include <type_traits>

#include "comm/cpu_features.h"

namespace troupe::comm {
namespace {

#define TROUPE_INLINE inline __attribute__((always_inline))

// GCC vectors: four floats in the plain build, eight in the AVX2 one. The kernels are written on
// them because GCC does not vectorise a float dot product (a reduction) without -ffast-math.
typedef float Float4 __attribute__((vector_size(16)));
typedef float Float8 __attribute__((vector_size(32)));

template <class V>
constexpr size_t kLanes = sizeof(V) / sizeof(float);

// Unaligned loads and stores. By reference: an 8-float vector passed by value from a function
// built without AVX would change the calling convention (GCC's -Wpsabi).
template <class V>
TROUPE_INLINE void load(V& v, const float* x) {
  std::memcpy(&v, x, sizeof(v));
}
template <class V>
TROUPE_INLINE void store(float* x, const V& v) {
  std::memcpy(x, &v, sizeof(v));
}

// out[k] = a . b[k] over len elements, for kCount rows b[k] at once (a is read once).
template <class V, size_t kCount>
TROUPE_INLINE void dots(const float* a, const float* const* b, size_t len, float* out) {
  V acc[kCount] = {};
  size_t j = 0;
  for (; j + kLanes<V> <= len; j += kLanes<V>) {
    V x, y;
    load(x, a + j);
    for (size_t k = 0; k < kCount; ++k) {
      load(y, b[k] + j);
      acc[k] += x * y;
    }
  }
  for (size_t k = 0; k < kCount; ++k) {
    float s = 0.0f;
    for (size_t l = 0; l < kLanes<V>; ++l) s += acc[k][l];
    for (size_t t = j; t < len; ++t) s += a[t] * b[k][t];
    out[k] = s;
  }
}

// y[k] += c[k] * x over len elements, for kCount rows y[k] at once (x is read once).
template <class V, size_t kCount>
TROUPE_INLINE void axpys(const float* c, const float* x, size_t len, float* const* y) {
  size_t j = 0;
  for (; j + kLanes<V> <= len; j += kLanes<V>) {
    V v, w;
    load(v, x + j);
    for (size_t k = 0; k < kCount; ++k) {
      load(w, y[k] + j);
      w += c[k] * v;
      store(y[k] + j, w);
    }
  }
  for (; j < len; ++j)
    for (size_t k = 0; k < kCount; ++k) y[k][j] += c[k] * x[j];
}

// Calls f(first, count) over [0, r) in groups of at most four, count a compile-time constant
// (std::integral_constant) so that the loops inside unroll.
template <class F>
TROUPE_INLINE void by_fours(size_t r, F f) {
  size_t k = 0;
  for (; k + 4 <= r; k += 4) f(k, std::integral_constant<size_t, 4>{});
  switch (r - k) {
    case 3:
      f(k, std::integral_constant<size_t, 3>{});
      break;
    case 2:
      f(k, std::integral_constant<size_t, 2>{});
      break;
    case 1:
      f(k, std::integral_constant<size_t, 1>{});
      break;
    default:
      break;
  }
}

// With `add`: m's row = from's row + add's row first (then read from cache by the dot products);
// `from` is m itself unless given.
template <class V>
TROUPE_INLINE void project(const float* m, size_t rows, size_t cols, const float* qt, size_t r,
                           float* p, const float* add = nullptr, const float* from = nullptr) {
  for (size_t i = 0; i < rows; ++i) {
    const float* mi = m + i * cols;
    if (add) {
      float* row = const_cast<float*>(mi);  // m is the caller's writable buffer when add is set
      const float* in = from ? from + i * cols : row;
      const float* ai = add + i * cols;
      size_t j = 0;
      for (; j + kLanes<V> <= cols; j += kLanes<V>) {
        V x, y;
        load(x, in + j);
        load(y, ai + j);
        x += y;
        store(row + j, x);
      }
      for (; j < cols; ++j) row[j] = in[j] + ai[j];
    }
    by_fours(r, [&](size_t k, auto count) {
      constexpr size_t kCount = decltype(count)::value;
      const float* b[kCount];
      for (size_t c = 0; c < kCount; ++c) b[c] = qt + (k + c) * cols;
      dots<V, kCount>(mi, b, cols, p + i * r + k);
    });
  }
}

template <class V>
TROUPE_INLINE void back_project(const float* m, size_t rows, size_t cols, const float* p, size_t r,
                                float* qt) {
  std::memset(qt, 0, r * cols * sizeof(float));
  for (size_t i = 0; i < rows; ++i) {
    const float* mi = m + i * cols;
    by_fours(r, [&](size_t k, auto count) {
      constexpr size_t kCount = decltype(count)::value;
      float* y[kCount];
      for (size_t c = 0; c < kCount; ++c) y[c] = qt + (k + c) * cols;
      axpys<V, kCount>(p + i * r + k, mi, cols, y);
    });
  }
}

// The expansion P Q^T of row i at columns [j, j + lanes), times scale: pi is P's row i, qt is Q^T.
template <class V>
TROUPE_INLINE void expansion_at(V& acc, const float* pi, const float* qt, size_t r, size_t cols,
                                size_t j, float scale) {
  acc = V{};
  V q;
  for (size_t k = 0; k < r; ++k) {
    load(q, qt + k * cols + j);
    acc += pi[k] * q;
  }
  acc *= scale;
}

// The same at one column j, unscaled (callers scale as their vector path does).
TROUPE_INLINE float expansion_at(const float* pi, const float* qt, size_t r, size_t cols,
                                 size_t j) {
  float acc = 0.0f;
  for (size_t k = 0; k < r; ++k) acc += pi[k] * qt[k * cols + j];
  return acc;
}

// With `e`: e = the old matrix - (the new m) * back, in the same pass; the old matrix is m as it
// was, or e itself with kFromError (then m is only written).
template <class V, bool kFromError = false>
TROUPE_INLINE void expand(const float* p, const float* qt, size_t rows, size_t cols, size_t r,
                          float scale, float* m, float back = 0.0f, float* e = nullptr) {
  for (size_t i = 0; i < rows; ++i) {
    const float* pi = p + i * r;
    float* mi = m + i * cols;
    const float* old_row = kFromError ? e + i * cols : mi;
    size_t j = 0;
    for (; j + kLanes<V> <= cols; j += kLanes<V>) {
      V acc;
      expansion_at(acc, pi, qt, r, cols, j, scale);
      if (e) {
        V old;
        load(old, old_row + j);
        old -= acc * back;
        store(e + i * cols + j, old);
      }
      store(mi + j, acc);
    }
    for (; j < cols; ++j) {
      const float acc = expansion_at(pi, qt, r, cols, j);
      if (e) e[i * cols + j] = old_row[j] - scale * acc * back;
      mi[j] = scale * acc;
    }
  }
}

// e's row := from's row + (e's row - scale * (op's row * oqt) * back), the last with expand()'s
// arithmetic, then its projection onto qt as project() does it.
template <class V>
TROUPE_INLINE void settle_add_project(const float* from, float* e, const float* op,
                                      const float* oqt, size_t o_r, float scale, float back,
                                      size_t rows, size_t cols, const float* qt, size_t r,
                                      float* p) {
  for (size_t i = 0; i < rows; ++i) {
    const float* pi = op + i * o_r;
    const float* in = from + i * cols;
    float* row = e + i * cols;
    size_t j = 0;
    for (; j + kLanes<V> <= cols; j += kLanes<V>) {
      V acc;
      expansion_at(acc, pi, oqt, o_r, cols, j, scale);
      V old, x;
      load(old, row + j);
      old -= acc * back;
      load(x, in + j);
      x += old;
      store(row + j, x);
    }
    for (; j < cols; ++j) {
      const float acc = expansion_at(pi, oqt, o_r, cols, j);
      const float settled = row[j] - scale * acc * back;
      row[j] = in[j] + settled;
    }
    by_fours(r, [&](size_t k, auto count) {
      constexpr size_t kCount = decltype(count)::value;
      const float* b[kCount];
      for (size_t c = 0; c < kCount; ++c) b[c] = qt + (k + c) * cols;
      dots<V, kCount>(row, b, cols, p + i * r + k);
    });
  }
}

void settle_add_project_generic(const float* from, float* e, const float* op, const float* oqt,
                                size_t o_r, float scale, float back, size_t rows, size_t cols,
                                const float* qt, size_t r, float* p) {
  settle_add_project<Float4>(from, e, op, oqt, o_r, scale, back, rows, cols, qt, r, p);
}
__attribute__((target("avx2"))) void settle_add_project_avx2(const float* from, float* e,
                                                             const float* op, const float* oqt,
                                                             size_t o_r, float scale, float back,
                                                             size_t rows, size_t cols,
                                                             const float* qt, size_t r, float* p) {
  settle_add_project<Float8>(from, e, op, oqt, o_r, scale, back, rows, cols, qt, r, p);
}

void project_generic(const float* m, size_t rows, size_t cols, const float* qt, size_t r,
                     float* p) {
  project<Float4>(m, rows, cols, qt, r, p);
}
void add_project_generic(const float* from, float* m, const float* add, size_t rows, size_t cols,
                         const float* qt, size_t r, float* p) {
  project<Float4>(m, rows, cols, qt, r, p, add, from);
}
void expand_error_generic(const float* p, const float* qt, size_t rows, size_t cols, size_t r,
                          float scale, float back, float* m, float* e) {
  expand<Float4>(p, qt, rows, cols, r, scale, m, back, e);
}
__attribute__((target("avx2"))) void add_project_avx2(const float* from, float* m, const float* add,
                                                      size_t rows, size_t cols, const float* qt,
                                                      size_t r, float* p) {
  project<Float8>(m, rows, cols, qt, r, p, add, from);
}
__attribute__((target("avx2"))) void expand_error_avx2(const float* p, const float* qt, size_t rows,
                                                       size_t cols, size_t r, float scale,
                                                       float back, float* m, float* e) {
  expand<Float8>(p, qt, rows, cols, r, scale, m, back, e);
}
void expand_from_error_generic(const float* p, const float* qt, size_t rows, size_t cols, size_t r,
                               float scale, float back, float* e, float* out) {
  expand<Float4, true>(p, qt, rows, cols, r, scale, out, back, e);
}
__attribute__((target("avx2"))) void expand_from_error_avx2(const float* p, const float* qt,
                                                            size_t rows, size_t cols, size_t r,
                                                            float scale, float back, float* e,
                                                            float* out) {
  expand<Float8, true>(p, qt, rows, cols, r, scale, out, back, e);
}
void back_project_generic(const float* m, size_t rows, size_t cols, const float* p, size_t r,
                          float* qt) {
  back_project<Float4>(m, rows, cols, p, r, qt);
}
void expand_generic(const float* p, const float* qt, size_t rows, size_t cols, size_t r,
                    float scale, float* m) {
  expand<Float4>(p, qt, rows, cols, r, scale, m);
}
__attribute__((target("avx2"))) void project_avx2(const float* m, size_t rows, size_t cols,
                                                  const float* qt, size_t r, float* p) {
  project<Float8>(m, rows, cols, qt, r, p);
}
__attribute__((target("avx2"))) void back_project_avx2(const float* m, size_t rows, size_t cols,
                                                       const float* p, size_t r, float* qt) {
  back_project<Float8>(m, rows, cols, p, r, qt);
}
__attribute__((target("avx2"))) void expand_avx2(const float* p, const float* qt, size_t rows,
                                                 size_t cols, size_t r, float scale, float* m) {
  expand<Float8>(p, qt, rows, cols, r, scale, m);
}

// splitmix64's finaliser.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// splitmix64 number `counter` of the stream keyed by key = mix64(seed) (mixed, so that seeds a
// multiple of the increment apart do not give shifted copies of one stream).
inline uint64_t stream(uint64_t key, uint64_t counter) {
  return mix64(key + (counter + 1) * 0x9e3779b97f4a7c15ull);
}

// The AVX2 build of a kernel where the processor has it, else the plain one.
template <class F>
F* pick(F* avx2, F* generic) {
  return have_avx2() ? avx2 : generic;
}

}  // namespace

void low_rank_project(const float* m, size_t rows, size_t cols, const float* qt, size_t r,
                      float* p) {
  pick(project_avx2, project_generic)(m, rows, cols, qt, r, p);
}

void low_rank_add_project(float* m, const float* add, size_t rows, size_t cols, const float* qt,
                          size_t r, float* p) {
  low_rank_add_project_from(m, m, add, rows, cols, qt, r, p);
}

void low_rank_add_project_from(const float* from, float* m, const float* add, size_t rows,
                               size_t cols, const float* qt, size_t r, float* p) {
  pick(add_project_avx2, add_project_generic)(from, m, add, rows, cols, qt, r, p);
}

void low_rank_expand_error(const float* p, const float* qt, size_t rows, size_t cols, size_t r,
                           float scale, float back, float* m, float* e) {
  pick(expand_error_avx2, expand_error_generic)(p, qt, rows, cols, r, scale, back, m, e);
}

void low_rank_expand_from_error(const float* p, const float* qt, size_t rows, size_t cols, size_t r,
                                float scale, float back, float* e, float* out) {
  pick(expand_from_error_avx2, expand_from_error_generic)(p, qt, rows, cols, r, scale, back, e,
                                                          out);
}

void low_rank_settle_add_project(const float* from, float* e, const float* op, const float* oqt,
                                 size_t o_r, float scale, float back, size_t rows, size_t cols,
                                 const float* qt, size_t r, float* p) {
  pick(settle_add_project_avx2, settle_add_project_generic)(from, e, op, oqt, o_r, scale, back,
                                                            rows, cols, qt, r, p);
}

void low_rank_back_project(const float* m, size_t rows, size_t cols, const float* p, size_t r,
                           float* qt) {
  pick(back_project_avx2, back_project_generic)(m, rows, cols, p, r, qt);
}

void low_rank_expand(const float* p, const float* qt, size_t rows, size_t cols, size_t r,
                     float scale, float* m) {
  pick(expand_avx2, expand_generic)(p, qt, rows, cols, r, scale, m);
}

void orthogonalize_columns(float* p, size_t rows, size_t r) {
  for (size_t k = 0; k < r; ++k) {
    // Each earlier column is removed twice: one pass of Gram-Schmidt in float leaves a residue
    // that grows with how nearly dependent the columns are; a second pass removes it.
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t l = 0; l < k; ++l) {
        double dot = 0.0;
        for (size_t i = 0; i < rows; ++i)
          dot += static_cast<double>(p[i * r + k]) * static_cast<double>(p[i * r + l]);
        const float d = static_cast<float>(dot);
        for (size_t i = 0; i < rows; ++i) p[i * r + k] -= d * p[i * r + l];
      }
    }
    double sum_sq = 0.0;
    for (size_t i = 0; i < rows; ++i)
      sum_sq += static_cast<double>(p[i * r + k]) * static_cast<double>(p[i * r + k]);
    const double norm = std::sqrt(sum_sq);
    const float inv = norm < 1e-8 ? 0.0f : static_cast<float>(1.0 / norm);
    for (size_t i = 0; i < rows; ++i) p[i * r + k] *= inv;
  }
}

void random_normal(uint64_t seed, float* out, size_t n) {
  // Box-Muller on pairs: numbers 2q and 2q+1 of the stream give out[2q] and out[2q+1], so every
  // element depends on its position alone (a prefix of a longer draw is the shorter draw).
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  constexpr double kUnit = 1.0 / 9007199254740992.0;  // 2^-53
  const uint64_t key = mix64(seed);
  for (size_t i = 0; i < n; i += 2) {
    const double u1 = static_cast<double>((stream(key, i) >> 11) + 1) * kUnit;  // (0, 1]
    const double u2 = static_cast<double>(stream(key, i + 1) >> 11) * kUnit;    // [0, 1)
    const double radius = std::sqrt(-2.0 * std::log(u1));
    out[i] = static_cast<float>(radius * std::cos(kTwoPi * u2));
    if (i + 1 < n) out[i + 1] = static_cast<float>(radius * std::sin(kTwoPi * u2));
  }
}

}  // namespace troupe::comm
