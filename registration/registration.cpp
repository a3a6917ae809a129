// Every fsdp_ema operator schema, and the CPU and Meta kernel tables. CUDA kernels are registered
// in registration_cuda.cpp so that a CPU-only build has no CUDA dependency.
#include <torch/library.h>

#include "ops/update.h"

// Why `Tensor(a! -> *)[]` rather than the usual `Tensor(a!)[]`: TorchScript's alias analysis
// records the write on the list value only, so for a list built inline (`[self.ema]`) it sees a
// write to a dead temporary and dead-code-eliminates the call (the EMA silently stops updating;
// aten's `_foreach_mul_` has the same problem). `-> *` makes the list alias the wildcard after
// the call, which keeps it. torch.compile reads the same schema as an ordinary in-place mutation.
TORCH_LIBRARY(fsdp_ema, m) {
  // Overload order matters: Python tries overloads in registration order, and a 0-dim tensor
  // would also convert to `float` (through a host sync), so the Tensor overload comes first.
  //
  // ema[i] <- lerp(ema[i], model[i], 1 - decay) for every pair, in one fused call, with decay a
  // 0-dim tensor read where the tensors live (no host sync; a changing value never recompiles).
  m.def("update_.Tensor(Tensor(a! -> *)[] ema, Tensor[] model, Tensor decay) -> ()");
  // Same, with decay a Python/C++ float.
  m.def("update_(Tensor(a! -> *)[] ema, Tensor[] model, float decay) -> ()");
  // The seed recipe's name for update_: same schemas, same kernels.
  m.def("ema_shard_update_.Tensor(Tensor(a! -> *)[] ema, Tensor[] model, Tensor decay) -> ()");
  m.def("ema_shard_update_(Tensor(a! -> *)[] ema, Tensor[] model, float decay) -> ()");
}

TORCH_LIBRARY_IMPL(fsdp_ema, CPU, m) {
  for (const char* name : {"update_", "ema_shard_update_"}) {
    m.impl(name, &fsdp_ema::ops::update_cpu);
    m.impl((std::string(name) + ".Tensor").c_str(), &fsdp_ema::ops::update_tensor_cpu);
  }
}

// Mutating and returning nothing: the meta kernel only validates, which is all tracing needs.
TORCH_LIBRARY_IMPL(fsdp_ema, Meta, m) {
  for (const char* name : {"update_", "ema_shard_update_"}) {
    m.impl(name, &fsdp_ema::ops::update_meta);
    m.impl((std::string(name) + ".Tensor").c_str(), &fsdp_ema::ops::update_tensor_meta);
  }
}
