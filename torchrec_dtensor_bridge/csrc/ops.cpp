// The extension's ops, torch.ops.tdb_native: this package's C kernels (cpu_kernels.c, cpu_kernels16.c,
// row_digests.c, crc32c.c) over tensors, registered with TORCH_LIBRARY for the CPU dispatch key.
//
//   version()                                     kVersion: what kernels/native.py expects of the build it loads.
//   ids_valid(ids, offsets, rows)                 every table's ids inside its rows, the offsets in order.
//   pool_sum(weights, weights_offsets, dims, rows, ids, offsets, per_sample_weights)
//                                                 (B, sum(dims)) fp32: every table's bag sums side by side.
//   sparse_update(weights!, ..., kind, decay, momentum1!, ..., hyper, row_wise_state, stochastic_rounding, seed)
//                                                 a fused optimizer's update of the touched rows, in place.
//   row_digests(rows)                             one 64-bit digest per row of a (rows, bytes) uint8 tensor.
//   row_cuts(keys, threads, bounds)               where an update's grouped occurrences are cut over threads.
//   crc32c(data, prev)                            the CRC-32C of prev's bytes then a 1-D contiguous uint8 tensor's.
//   crc32c_hardware()                             whether crc32c runs on the CPU's instruction (else a bit a time).
//
// These ops trust their arguments: torch.ops.tdb (kernels/ops.py) checked them and chose these kernels; the C
// code checks the ids itself, before any row is read or written. The work is split over torch's intra-op
// threads (at::parallel_for): pooling on bag boundaries, an update on row boundaries (row_cuts), digests on
// row boundaries; every bag and row is computed whole by one thread, so the results are the same bits
// whatever the thread count.

#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <set>
#include <vector>

#include "tdb_kernels.h"

namespace {

constexpr int64_t kVersion = 2;
constexpr int64_t kMinPerThread = 16384;  // ids or occurrences: below this a thread's share is not worth it
constexpr int64_t kDigestPartBytes = int64_t{32} << 20;  // the least a thread digests
constexpr int64_t kDecayL2 = 1;  // optim_kinds.WeightDecayMode.L2

int64_t version() { return kVersion; }

// cpu_kernels16.c's type codes for 16-bit tables; 0 for fp32.
int half_type(const at::Tensor& weights) {
  switch (weights.scalar_type()) {
    case at::kHalf: return TDB_F16;
    case at::kBFloat16: return TDB_BF16;
    default: return 0;
  }
}

std::vector<int64_t> starts(at::IntArrayRef sizes) {
  std::vector<int64_t> out(sizes.size(), 0);
  for (size_t t = 1; t < sizes.size(); ++t) out[t] = out[t - 1] + sizes[t - 1];
  return out;
}

const float* float_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

float* mutable_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

std::optional<at::Tensor> fp32_contiguous(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return t->to(at::kFloat).contiguous();
}

// fn(p) for every part p of [0, parts), on the intra-op threads when there are several; the return codes.
template <typename Fn>
std::vector<int> in_parts(int64_t parts, const Fn& fn) {
  std::vector<int> codes(static_cast<size_t>(parts), 0);
  if (parts == 1) {
    codes[0] = fn(0);
    return codes;
  }
  at::parallel_for(0, parts, 1, [&](int64_t a, int64_t b) {
    for (int64_t p = a; p < b; ++p) codes[static_cast<size_t>(p)] = fn(p);
  });
  return codes;
}

// Split points of grouped occurrences, one range per thread, never inside a row: bounds are the tables'
// first positions and the last one's end (each table's keys sorted by row).
std::vector<int64_t> cuts_of(const int32_t* keys, int64_t threads, const std::vector<int64_t>& bounds) {
  const int64_t first = bounds.front(), last = bounds.back();
  const int64_t parts = std::max<int64_t>(1, std::min(threads, (last - first) / kMinPerThread));
  if (parts == 1) return {first, last};
  std::set<int64_t> cuts{first, last};
  for (int64_t k = 1; k < parts; ++k) {
    int64_t guess = first + (last - first) * k / parts;
    // the table holding it, then back to where its row starts
    const auto t = std::upper_bound(bounds.begin(), bounds.end(), guess) - bounds.begin() - 1;
    const int64_t lo = bounds[static_cast<size_t>(t)], hi = bounds[static_cast<size_t>(t) + 1];
    if (lo < guess && guess < hi) guess = std::lower_bound(keys + lo, keys + hi, keys[guess]) - keys;
    cuts.insert(guess);
  }
  return {cuts.begin(), cuts.end()};
}

std::vector<int64_t> row_cuts(const at::Tensor& keys, int64_t threads, at::IntArrayRef bounds) {
  TORCH_CHECK(keys.scalar_type() == at::kInt && keys.dim() == 1 && keys.is_contiguous(),
              "tdb_native::row_cuts: keys must be a contiguous 1-D int32 tensor");
  TORCH_CHECK(bounds.size() >= 2 && bounds.front() >= 0 && bounds.back() <= keys.numel(),
              "tdb_native::row_cuts: bounds must lie within keys");
  return cuts_of(keys.data_ptr<int32_t>(), threads, bounds.vec());
}

bool ids_valid(const at::Tensor& ids, const at::Tensor& offsets, at::IntArrayRef rows) {
  const auto tables = static_cast<int64_t>(rows.size());
  const int64_t bags = (offsets.numel() - 1) / tables;
  return tdb_check_tables(tables, rows.data(), ids.data_ptr<int64_t>(), ids.numel(), offsets.data_ptr<int64_t>(),
                          bags) == 0;
}

at::Tensor pool_sum(const at::Tensor& weights, at::IntArrayRef weights_offsets, at::IntArrayRef dims,
                    at::IntArrayRef rows, const at::Tensor& ids_in, const at::Tensor& offsets_in,
                    const std::optional<at::Tensor>& per_sample_weights) {
  const at::Tensor ids = ids_in.contiguous(), offsets = offsets_in.contiguous();
  const auto psw = fp32_contiguous(per_sample_weights);
  const auto tables = static_cast<int64_t>(dims.size());
  const int64_t bags = (offsets.numel() - 1) / tables;
  int64_t width = 0;
  for (int64_t d : dims) width += d;
  at::Tensor out = at::empty({bags, width}, weights.options().dtype(at::kFloat));
  const int64_t ldo = bags ? out.stride(0) : width;
  const std::vector<int64_t> doff = starts(dims);
  // all tables' bags split evenly over the threads (each bag's sum is the same whatever the split)
  const int64_t total = tables * bags;
  const int64_t parts = std::max<int64_t>(
      1, std::min({static_cast<int64_t>(at::get_num_threads()), ids.numel() / kMinPerThread, total}));
  const int wtype = half_type(weights);
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  float* outp = out.data_ptr<float>();
  const std::vector<int> codes = in_parts(parts, [&](int64_t p) {
    const int64_t g0 = total * p / parts, g1 = total * (p + 1) / parts;
    if (wtype == 0)
      return tdb_pool_tables(weights.const_data_ptr<float>(), tables, weights_offsets.data(), dims.data(),
                             rows.data(), outp, ldo, doff.data(), ip, ids.numel(), op, bags, g0, g1, float_ptr(psw));
    return tdb_pool_tables16(static_cast<const uint16_t*>(weights.const_data_ptr()), wtype, tables,
                             weights_offsets.data(), dims.data(), rows.data(), outp, ldo, doff.data(), ip,
                             ids.numel(), op, bags, g0, g1, float_ptr(psw));
  });
  for (int rc : codes) {
    TORCH_CHECK(rc != TDB_BAD_ARGUMENTS, "pooled lookup kernel: bad arguments (weights' type)");
    TORCH_CHECK_VALUE(rc == 0, "pooled lookup: ids of table ", -1 - rc, " outside [0, ", rows[-1 - rc],
                      ") or offsets out of order");
  }
  return out;
}

// The exception for a return code of the update's C functions (none for 0).
void check_update(int rc, at::IntArrayRef rows, int64_t n) {
  if (rc == 0) return;
  TORCH_CHECK_VALUE(rc != -1, "sparse update: offsets must be non-decreasing within [0, ", n,
                    "], got boundaries out of order");
  TORCH_CHECK(rc != TDB_BAD_ARGUMENTS, "sparse update kernel: bad arguments (kind, decay or width)");
  TORCH_CHECK_VALUE(false, "sparse update: ids of table ", -2 - rc, " outside [0, ", rows[-2 - rc], ")");
}

void sparse_update(const at::Tensor& weights, at::IntArrayRef weights_offsets, at::IntArrayRef dims,
                   at::IntArrayRef rows, const at::Tensor& grad, const at::Tensor& ids_in,
                   const at::Tensor& offsets_in, const std::optional<at::Tensor>& per_sample_weights, int64_t kind,
                   int64_t decay, const std::optional<at::Tensor>& momentum1, at::IntArrayRef momentum1_offsets,
                   const std::optional<at::Tensor>& momentum2, at::IntArrayRef momentum2_offsets,
                   at::ArrayRef<double> hyper, bool row_wise_state, bool stochastic_rounding, int64_t seed) {
  TORCH_CHECK(hyper.size() == TDB_HYPER_VALUES, "tdb_native::sparse_update: ", TDB_HYPER_VALUES,
              " hyper-parameter values, got ", hyper.size());
  const at::Tensor ids = ids_in.contiguous(), offsets = offsets_in.contiguous();
  const auto psw = fp32_contiguous(per_sample_weights);
  const auto tables = static_cast<int64_t>(dims.size());
  const int64_t bags = (offsets.numel() - 1) / tables, n = ids.numel();
  if (n == 0 || bags == 0) return;
  const int wtype = half_type(weights);
  const bool half = wtype != 0;
  at::Tensor work = at::empty({5, n}, ids.options().dtype(at::kInt));
  int32_t* keys = work.data_ptr<int32_t>();
  int32_t *occ = keys + n, *bag_of = keys + 2 * n, *tmp_keys = keys + 3 * n, *tmp_occ = keys + 4 * n;
  const std::vector<int64_t> goff = starts(dims);
  const int k = static_cast<int>(kind), dm = static_cast<int>(decay);
  float* s1 = mutable_ptr(momentum1);
  float* s2 = mutable_ptr(momentum2);
  const int64_t* s1off = momentum1.has_value() ? momentum1_offsets.data() : nullptr;
  const int64_t* s2off = momentum2.has_value() ? momentum2_offsets.data() : nullptr;
  const float* g = grad.const_data_ptr<float>();
  const int64_t ldg = grad.stride(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  // a per-row state: a row touched once takes its statistic from its bag's, summed up front
  std::optional<at::Tensor> bag_sq;
  if (row_wise_state && decay != kDecayL2 && (!half || !psw.has_value()))
    bag_sq = at::empty({tables * bags}, grad.options().dtype(at::kFloat));
  float* sq = mutable_ptr(bag_sq);
  float hp32[TDB_HYPER_VALUES];
  double hp64[TDB_HYPER_VALUES];
  for (int i = 0; i < TDB_HYPER_VALUES; ++i) {
    hp64[i] = hyper[static_cast<size_t>(i)];
    hp32[i] = static_cast<float>(hp64[i]);
  }
  const int64_t threads = at::get_num_threads();
  if (!half && (threads == 1 || n < 2 * kMinPerThread)) {  // each table grouped right before its walk
    check_update(tdb_update_tables(k, dm, weights.data_ptr<float>(), tables, weights_offsets.data(), dims.data(),
                                   rows.data(), s1, s1off, s2, s2off, g, ldg, goff.data(), float_ptr(psw), ip, n, op,
                                   bags, keys, occ, bag_of, tmp_keys, tmp_occ, sq, hp32),
                 rows, n);
    return;
  }
  // every table grouped first (nothing written unless every id is valid), then the walks, cut over all
  // tables' occurrences on row boundaries over the threads
  check_update(tdb_group_tables(tables, rows.data(), ip, n, op, bags, keys, occ, bag_of, tmp_keys, tmp_occ), rows, n);
  if (sq != nullptr)
    (half ? tdb_bag_square_sums16 : tdb_bag_square_sums_tables)(g, ldg, tables, goff.data(), dims.data(), bags, sq);
  std::vector<int64_t> bounds(static_cast<size_t>(tables) + 1);
  for (int64_t t = 0; t <= tables; ++t) bounds[static_cast<size_t>(t)] = op[t * bags];
  const std::vector<int64_t> cuts = cuts_of(keys, threads, bounds);
  const std::vector<int> codes = in_parts(static_cast<int64_t>(cuts.size()) - 1, [&](int64_t p) {
    const int64_t a = cuts[static_cast<size_t>(p)], b = cuts[static_cast<size_t>(p) + 1];
    if (!half)
      return tdb_apply_tables(k, dm, weights.data_ptr<float>(), tables, weights_offsets.data(), dims.data(), s1,
                              s1off, s2, s2off, g, ldg, goff.data(), float_ptr(psw), keys, occ, bag_of, sq, op, bags,
                              a, b, hp32);
    return tdb_apply_tables16(k, dm, static_cast<uint16_t*>(weights.data_ptr()), wtype, stochastic_rounding ? 1 : 0,
                              static_cast<uint64_t>(seed), tables, weights_offsets.data(), dims.data(), s1, s1off, s2,
                              s2off, g, ldg, goff.data(), float_ptr(psw), keys, occ, bag_of, sq, op, bags, a, b,
                              hp64);
  });
  for (int rc : codes) check_update(rc, rows, n);
}

at::Tensor row_digests(const at::Tensor& rows) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kByte && (rows.size(1) <= 1 || rows.stride(1) == 1),
              "tdb_native::row_digests: rows must be a 2-D uint8 tensor with unit column stride");
  const int64_t n = rows.size(0), nbytes = rows.size(1), stride = rows.stride(0);
  at::Tensor out = at::empty({n}, rows.options().dtype(at::kLong));
  if (n == 0) return out;
  const int64_t parts = std::max<int64_t>(
      1, std::min(static_cast<int64_t>(at::get_num_threads()), n * nbytes / kDigestPartBytes));
  const auto* base = static_cast<const uint8_t*>(rows.const_data_ptr());
  auto* digests = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  const std::vector<int> codes = in_parts(parts, [&](int64_t p) {
    const int64_t a = n * p / parts, b = n * (p + 1) / parts;
    return tdb_row_digests(base + a * stride, b - a, nbytes, stride, digests + a);
  });
  for (int rc : codes) TORCH_CHECK(rc == 0, "tdb_row_digests failed on ", n, " rows of ", nbytes, " bytes");
  return out;
}

int64_t crc32c(const at::Tensor& data, int64_t prev) {
  TORCH_CHECK(data.dim() == 1 && data.scalar_type() == at::kByte && data.is_contiguous(),
              "tdb_native::crc32c: data must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(prev >= 0 && prev <= 0xffffffffLL, "tdb_native::crc32c: prev must be a 32-bit CRC, got ", prev);
  return tdb_crc32c(static_cast<uint32_t>(prev), static_cast<const uint8_t*>(data.const_data_ptr()),
                    static_cast<size_t>(data.numel()));
}

bool crc32c_hardware() { return tdb_crc32c_hardware() != 0; }

}  // namespace

TORCH_LIBRARY(tdb_native, m) {
  m.def("version() -> int", &version);
  m.def("ids_valid(Tensor ids, Tensor offsets, int[] rows) -> bool");
  m.def("pool_sum(Tensor weights, int[] weights_offsets, int[] dims, int[] rows, Tensor ids, Tensor offsets, "
        "Tensor? per_sample_weights) -> Tensor");
  m.def("sparse_update(Tensor(a!) weights, int[] weights_offsets, int[] dims, int[] rows, Tensor grad, Tensor ids, "
        "Tensor offsets, Tensor? per_sample_weights, int kind, int decay, Tensor(b!)? momentum1, "
        "int[] momentum1_offsets, Tensor(c!)? momentum2, int[] momentum2_offsets, float[] hyper, "
        "bool row_wise_state, bool stochastic_rounding, int seed) -> ()");
  m.def("row_digests(Tensor rows) -> Tensor");
  m.def("row_cuts(Tensor keys, int threads, int[] bounds) -> int[]");
  m.def("crc32c(Tensor data, int prev) -> int");
  m.def("crc32c_hardware() -> bool", &crc32c_hardware);
}

TORCH_LIBRARY_IMPL(tdb_native, CPU, m) {
  m.impl("ids_valid", &ids_valid);
  m.impl("pool_sum", &pool_sum);
  m.impl("sparse_update", &sparse_update);
  m.impl("row_digests", &row_digests);
  m.impl("row_cuts", &row_cuts);
  m.impl("crc32c", &crc32c);
}

// An importable module (import torchrec_dtensor_bridge._C loads this library and so registers the ops above);
// it holds nothing itself.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "torch.ops.tdb_native: this package's CPU kernels",
                               -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
