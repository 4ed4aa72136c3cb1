// The CUTLASS 3.x headers of the SM90 conv kernels (fprop_sm90.cuh, wgrad_sm90.cuh): the
// implicit-GEMM collective builders, the conv kernel and its device adapter, the epilogue builder,
// the conv ABI and the shared device helpers, in an order CUTLASS compiles (the TMA driver shim
// before any CUTLASS header); their mainloop, kernel and adapter types; and their launch.
#pragma once
#include "common/tma_driver.cuh"  // before any CUTLASS header

#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cute/tensor.hpp"
#include "cutlass/conv/convnd_problem_shape.hpp"
#include "cutlass/conv/dispatch_policy.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/conv/kernel/conv_universal.hpp"
#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "conv2d/abi.h"
#include "common/device.cuh"
#include "common/universal.cuh"

namespace cvt_kernel {

// One operator's SM90 implicit-GEMM conv around an epilogue (Cfg: Element, TileShape, ClusterShape,
// kStages): the mainloop (TMA im2col + wgmma on NHWC operands, 16-byte rows; kStages 0: as many
// stages as fit beside the epilogue's shared storage), the kernel and its device adapter.
template <class Cfg, cutlass::conv::Operator Op, class CollectiveEpilogue>
struct Sm90ConvKernel {
  using Element = typename Cfg::Element;
  using Layout = cutlass::layout::TensorNHWC;
  using StageCount = std::conditional_t<
      Cfg::kStages == 0,
      cutlass::conv::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::conv::collective::StageCount<Cfg::kStages>>;
  using CollectiveMainloop = typename cutlass::conv::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Op, Element, Layout, 8, Element, Layout, 8, float,
      typename Cfg::TileShape, typename Cfg::ClusterShape, StageCount,
      cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;
  using ProblemShape = cutlass::conv::ConvProblemShape<Op, CollectiveMainloop::DispatchPolicy::NumSpatialDimensions>;
  using ConvKernel = cutlass::conv::kernel::ConvUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Conv = cutlass::conv::device::ConvUniversalAdapter<ConvKernel>;
};

// Launches an SM90 conv kernel through its adapter's static run (the adapter's initialize() sets
// the shared-memory attribute on every call): the attribute once per device, then the kernel.
template <class ConvKernel, class Conv>
int launch_sm90_conv(const typename Conv::Arguments& arguments, void* workspace, int device_id,
                     cudaStream_t stream) {
  constexpr int kSmem = int(ConvKernel::SharedStorageSize);
  if (!smem_ready<ConvKernel>(reinterpret_cast<const void*>(cutlass::device_kernel<ConvKernel>), kSmem, device_id))
    return CVT_ERR_SMEM;
  return run_universal<ConvKernel, Conv>(arguments, workspace, stream);
}

}  // namespace cvt_kernel
