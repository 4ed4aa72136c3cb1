// Host program (no GPU): the offsets operators/attention/wgmma_bwd.cuh computes by hand -- the
// swizzled shared-memory tiles' (sw128_offset, ds_offset) and the wgmma accumulator's fragment
// coordinates (acc_row, acc_col) -- against CuTe's own layouts and partitions, which the kernel's
// wgmma descriptors are built from. Prints "mismatches 0" when every one agrees.
#include <cstdint>
#include <cstdio>

#include "attention/wgmma_bwd.cuh"

using namespace cute;
using namespace cvt_kernel::wgmma_bwd;

template <class Elt, int Keys>
int check_tiles() {
  Elt* base = reinterpret_cast<Elt*>(uintptr_t(1) << 20);  // 1024-byte aligned, as the kernel's
  auto kv = make_tensor(make_smem_ptr(base), KMajor<Elt, Keys>{});
  auto qd = make_tensor(make_smem_ptr(base), Staged<Elt>{});
  auto ds = make_tensor(make_smem_ptr(base), DsLayout<Elt, Keys>{});
  int bad = 0;
  for (int r = 0; r < Keys; ++r)
    for (int c = 0; c < kDim; ++c) bad += int(&kv(r, c) - base) != sw128_offset(r, c);
  for (int s = 0; s < kStages; ++s)
    for (int r = 0; r < kQueries; ++r)
      for (int c = 0; c < kDim; ++c) bad += int(&qd(r, c, s) - base) != s * kQueries * kDim + sw128_offset(r, c);
  for (int b = 0; b < 2; ++b)
    for (int key = 0; key < Keys; ++key)
      for (int q = 0; q < kQueries; ++q)
        bad += int(&ds(key, q % 32, q / 32, b) - base) != b * Keys * kQueries + ds_offset<Keys>(key, q);
  return bad;
}

template <class Elt, int Keys>
int check_fragments() {
  using M = Mmas<Elt, Keys>;
  int bad = 0;
  for (int t = 0; t < 128; ++t) {
    auto cs = typename M::SdP{}.get_thread_slice(t).partition_C(make_identity_tensor(Shape<_64, _64>{}));
    auto ckv = typename M::KV{}.get_thread_slice(t).partition_C(make_identity_tensor(Shape<_64, _64>{}));
    auto cdq = typename M::DQ{}.get_thread_slice(t).partition_C(make_identity_tensor(Shape<_64, _32>{}));
    for (int i = 0; i < size(cs); ++i) bad += get<0>(cs(i)) != acc_row(t, i) || get<1>(cs(i)) != acc_col(t, i);
    for (int i = 0; i < size(ckv); ++i) bad += get<0>(ckv(i)) != acc_row(t, i) || get<1>(ckv(i)) != acc_col(t, i);
    for (int i = 0; i < size(cdq); ++i) bad += get<0>(cdq(i)) != acc_row(t, i) || get<1>(cdq(i)) != acc_col(t, i);
  }
  return bad;
}

int main() {
  const int bad = check_tiles<cutlass::bfloat16_t, 128>() + check_tiles<cutlass::half_t, 128>() +
                  check_tiles<cutlass::bfloat16_t, 64>() + check_fragments<cutlass::bfloat16_t, 128>() +
                  check_fragments<cutlass::half_t, 128>() + check_fragments<cutlass::bfloat16_t, 64>();
  printf("mismatches %d\n", bad);
  return bad != 0;
}
