// What the ops' Meta kernels (FakeTensorMode: torch.compile, opcheck) share: a tracer's fake
// tensors told from real meta tensors, the device a result goes to, and the `target` tensor the
// private load ops dispatch on.
//
// Why the file-reading ops go through a private op with a `target` tensor: FakeTensorMode derives
// the device of a Meta kernel's results from its tensor inputs, and load_tensors / load_shard have
// none ("Could not find common device"). Their public schemas are therefore
// CompositeImplicitAutograd kernels that make an empty tensor on the requested device and call
// `_load_tensors` / `_load_shard` with it: the private op dispatches on that tensor (CPU, CUDA,
// Meta), and under tracing its Meta kernel reads only the index / header (no tensor data).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>

namespace fsdp_ema::ops {

// A tracer's fake tensors reach Meta kernels as meta tensors that still carry the Python key;
// a real meta tensor does not. Only the latter has no data behind it.
bool is_real_meta(const at::Tensor& t);

// The device of the first non-CPU tensor, else the CPU: where FakeTensorMode puts the results of
// a Meta kernel whose tensor inputs are 0-dim (a CPU 0-dim tensor defers to any other device).
at::Device result_device(at::TensorList tensors);

// An empty tensor on the device the results go to: what the private load ops dispatch on.
at::Tensor target_on(std::optional<at::Device> device);

// Options of a Meta kernel's results.
at::TensorOptions meta_options(at::ScalarType dtype);

}  // namespace fsdp_ema::ops
