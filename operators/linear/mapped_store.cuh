// EVT store nodes that store Fn(value) and pass the value on unchanged: the training forward's fc1
// saves gelu'(z) (the only thing the backward needs of the pre-activation z) where the traced tree
// stores z, so that fc2's input gradient multiplies by the saved factor instead of computing
// GELU' again (cvt_cutlass.epilogues: bias_gelu_dgelu, dgelu_saved_dbias). Store is CUTLASS's aux
// store node (Sm90AuxStore, or VisitorAuxStore on the SM80-class path) of the stored element type;
// Fn a functor template on cutlass::Array<float, N> (linear/dgelu.cuh). The value is converted
// to Store's element after Fn, in fp32 before it.
#pragma once
#include <utility>

#include "cutlass/array.h"
#include "cutlass/cutlass.h"
#include "linear/dgelu.cuh"

namespace cvt_kernel {

// SM90 (TMA warp-specialized epilogues): the consumer's store callbacks wrapped.
template <template <class> class Fn, class Store>
struct Sm90MappedAuxStore : Store {
  using Store::Store;

  template <class Base>
  struct Callbacks : Base {
    CUTLASS_DEVICE explicit Callbacks(Base&& base) : Base(std::move(base)) {}

    template <class ElementAccumulator, class ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const& frg_acc, int epi_v, int epi_m,
                              int epi_n, cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      Base::visit(frg_acc, epi_v, epi_m, epi_n, Fn<cutlass::Array<ElementInput, FragmentSize>>{}(frg_input));
      return frg_input;
    }
  };

  template <bool ReferenceSrc, class Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(Args const& args) {
    auto base = Store::template get_consumer_store_callbacks<ReferenceSrc>(args);
    return Callbacks<decltype(base)>(std::move(base));
  }
};

// SM80-class visitor epilogues (sm_89): the same on the threadblock visitor's callbacks.
template <template <class> class Fn, class Store>
struct Sm80MappedAuxStore : Store {
  using Store::Store;
  CUTLASS_HOST_DEVICE Sm80MappedAuxStore() {}

  template <class Base>
  struct Callbacks : Base {
    CUTLASS_DEVICE explicit Callbacks(Base&& base) : Base(std::move(base)) {}

    template <class ElementAccumulator, class ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(int iter_idx, int row_idx, int column_idx, int frg_idx,
                              cutlass::Array<ElementAccumulator, FragmentSize> const& frg_acc,
                              cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      Base::visit(iter_idx, row_idx, column_idx, frg_idx, frg_acc,
                  Fn<cutlass::Array<ElementInput, FragmentSize>>{}(frg_input));
      return frg_input;
    }
  };

  template <class... Args>
  CUTLASS_DEVICE auto get_callbacks(Args&&... args) {
    auto base = Store::get_callbacks(std::forward<Args>(args)...);
    return Callbacks<decltype(base)>(std::move(base));
  }
};

}  // namespace cvt_kernel
