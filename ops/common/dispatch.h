// What the public C++ wrappers (include/fsdp_ema/ops.h, each defined beside its op's host code)
// call through: the typed dispatcher handle of one operator, so that a C++ call picks its kernel
// by the tensors' device exactly as torch.ops.fsdp_ema.* does from Python.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace fsdp_ema::ops {

// The handle of operator `name` ("fsdp_ema::update_") and `overload` ("" or "Tensor") with C++
// signature Signature; throws when no such schema is registered. Look it up once per wrapper:
//   static const auto op = typed_op<int64_t(c10::string_view)>("fsdp_ema::my_op");
template <typename Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* name, const char* overload = "") {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).typed<Signature>();
}

}  // namespace fsdp_ema::ops
