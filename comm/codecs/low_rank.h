#pragma once
/// The dense kernels of PowerSGD's low-rank approximation M ~ P Q^T, on row-major float32
/// matrices: M is rows x cols, P is rows x r, and Q is kept transposed (Qt, r x cols) so that every
/// inner loop runs over contiguous memory.
#include <cstddef>
#include <cstdint>

namespace troupe::comm {

/// p = m * qt^T: p[i][k] = sum_j m[i][j] * qt[k][j].
void low_rank_project(const float* m, size_t rows, size_t cols, const float* qt, size_t r,
                      float* p);
/// m += add, then p = m * qt^T, row by row: one pass over memory for error feedback's sum and the
/// projection (each row is summed, then read again from cache). The same bits as adding, then
/// low_rank_project.
void low_rank_add_project(float* m, const float* add, size_t rows, size_t cols, const float* qt,
                          size_t r, float* p);
/// low_rank_add_project from a matrix that lies elsewhere: m = from + add, then p = m * qt^T, in
/// the same pass. The same bits as copying `from` into m, then low_rank_add_project; `from` may be
/// m.
void low_rank_add_project_from(const float* from, float* m, const float* add, size_t rows,
                               size_t cols, const float* qt, size_t r, float* p);
/// qt = p^T * m: qt[k][j] = sum_i p[i][k] * m[i][j].
void low_rank_back_project(const float* m, size_t rows, size_t cols, const float* p, size_t r,
                           float* qt);
/// m = p * qt (scaled): m[i][j] = scale * sum_k p[i][k] * qt[k][j].
void low_rank_expand(const float* p, const float* qt, size_t rows, size_t cols, size_t r,
                     float scale, float* m);
/// low_rank_expand, and the error it leaves: e = m - (the new m) * back, from m as it was (for
/// PowerSGD's memory, back = 1 / (world * scale)), in the same pass. The same bits as copying m to
/// e, expanding, then e[i] -= m[i] * back.
void low_rank_expand_error(const float* p, const float* qt, size_t rows, size_t cols, size_t r,
                           float scale, float back, float* m, float* e);
/// low_rank_expand_error with the matrix held in e: on entry e is M, on return the error
/// M - out * back, and out = scale * p * qt, written only. The same bits as copying e to out,
/// then low_rank_expand_error(..., out, e). PowerSGD keeps M = gradient + memory in its memory
/// this way: the pass that sums M then writes lines it has just read instead of the bucket's,
/// which it would first have to fetch.
void low_rank_expand_from_error(const float* p, const float* qt, size_t rows, size_t cols, size_t r,
                                float scale, float back, float* e, float* out);
/// The error low_rank_expand_from_error leaves, settled only when the next step's sum reads it: on
/// entry e holds the previous step's M, expanded then into scale * op * oqt (op rows x o_r, oqt
/// o_r x cols); e becomes m = from + (M - scale * op * oqt * back), and p = m * qt^T (qt r x cols),
/// row by row in one pass. The same bits as low_rank_expand_from_error(op, oqt, rows, cols, o_r,
/// scale, back, e, out), then low_rank_add_project_from(from, e, e, rows, cols, qt, r, p), with
/// e read and written once instead of twice and no `out`: PowerSGD's expansion then writes the
/// bucket only, and its memory keeps M until the next step.
void low_rank_settle_add_project(const float* from, float* e, const float* op, const float* oqt,
                                 size_t o_r, float scale, float back, size_t rows, size_t cols,
                                 const float* qt, size_t r, float* p);
/// Makes the r columns of p (rows x r, row-major) orthonormal in place by modified Gram-Schmidt
/// (dot products in double; each earlier column is removed twice, which keeps P^T P = I to
/// rounding even when columns are nearly dependent). A column whose norm falls below 1e-8 after
/// removing the earlier ones is set to zero (it adds nothing to the approximation) instead of
/// being divided by ~0.
void orthogonalize_columns(float* p, size_t rows, size_t r);
/// out[i] = independent standard normal samples for i < n, from a counter-based generator
/// seeded with `seed` alone (never torch's global generator): the same on every rank (that uses
/// the same C library: Box-Muller takes log, cos and sin from libm). out[i] depends on i, not
/// on n: a shorter draw is a prefix of a longer one.
void random_normal(uint64_t seed, float* out, size_t n);

}  // namespace troupe::comm
