// Every fsdp_ema operator schema, and the CPU, Meta and composite kernel tables. CUDA kernels are
// registered in registration_cuda.cpp so that a CPU-only build has no CUDA dependency.
#include <torch/library.h>

#include "fsdp_ema/format/names.h"
#include "kernels/update_cpu.h"
#include "ops/checkpoint.h"
#include "ops/checkpoint_meta.h"
#include "ops/export.h"
#include "ops/gather.h"
#include "ops/load_into.h"
#include "ops/posthoc.h"
#include "ops/update.h"
#include "ops/update_multi.h"

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

  // Checkpoint ops. Those that write files are registered with CONSERVATIVE alias analysis:
  // TorchScript then treats them as side-effecting and never dead-code-eliminates a call whose
  // result is unused. torch.compile has no C++ mark for that (its effect registry and
  // torch.fx.node.has_side_effect are Python; `import fsdp_ema` sets the latter): with only the
  // library loaded, a graph keeps a save whose result reaches its output, which is what
  // commit_checkpoint.after and load_tensors.after are for (they also order the calls).
  //
  // Writes one rank's local shards to <directory>/shard-<rank>-of-<world_size>.safetensors
  // atomically (temporary file, fsync, rename, directory fsync); returns the file's bytes as a
  // 0-dim int64 CPU tensor (a tensor, not an int, so that torch.compile can trace the call).
  // Refuses a committed directory unless overwrite (then it writes under a name the committed
  // index does not reference, so the old checkpoint stays whole until the commit).
  m.def(torch::schema(
      "save_shard(str directory, int rank, int world_size, str[] names, Tensor[] shards, "
      "int[] offsets, int[] global_shapes, bool fsync=True, bool overwrite=False) -> Tensor",
      c10::AliasAnalysisKind::CONSERVATIVE));
  // Writes <directory>/fsdp_ema.index.json, the commit marker, once every rank's file exists;
  // refuses an already committed directory unless overwrite. Returns the number of tensors.
  m.def(torch::schema(
      "commit_checkpoint(str directory, int world_size, bool overwrite=False, bool fsync=True) "
      "-> int",
      c10::AliasAnalysisKind::CONSERVATIVE));
  // The same commit for compiled graphs: the tensor count as a 0-dim int64 tensor (a graph cannot
  // return an int), on the device of `after`, the save_shard results it must follow.
  m.def(
      torch::schema("commit_checkpoint.after(str directory, int world_size, Tensor[] after, "
                    "bool overwrite=False, bool fsync=True) -> Tensor",
                    c10::AliasAnalysisKind::CONSERVATIVE));
  // One shard file back: names, local shards, concatenated global offsets and global shapes.
  // Tensors are owned memory, read and verified in one pass; mmap=True (opt-in) returns zero-copy
  // views of the file's mapping instead (SIGBUS if the file is truncated while they live).
  m.def(
      "load_shard(str path, bool verify=True, Device? device=None, bool mmap=False) "
      "-> (str[] names, Tensor[] shards, int[] offsets, int[] global_shapes)");
  // Named tensors of a committed checkpoint (ours, or a DCP HuggingFace directory): whole, or the
  // dim-0 rows rank `rank` of `world_size` holds (torch.chunk semantics, any world size).
  m.def(
      "load_tensors(str directory, str[] names, int rank=0, int world_size=1, bool verify=True, "
      "Device? device=None, bool mmap=False) -> Tensor[]");
  // The same, ordered after `after` in a graph (say, commit_checkpoint.after's result).
  m.def(
      "load_tensors.after(str directory, str[] names, Tensor[] after, int rank=0, "
      "int world_size=1, bool verify=True, Device? device=None, bool mmap=False) -> Tensor[]");
  // Private: what load_tensors and load_shard call (ops/checkpoint_meta.h says why). `target` is
  // an empty tensor on the device to load to; `after` is not read.
  m.def(
      "_load_tensors(Tensor target, Tensor[] after, str directory, str[] names, int rank, "
      "int world_size, bool verify, bool mmap) -> Tensor[]");
  m.def(
      "_load_shard(Tensor target, str path, bool verify, bool mmap) "
      "-> (str[] names, Tensor[] shards, int[] offsets, int[] global_shapes)");
  // JSON description of a checkpoint directory: layout, world size, tensors (dtype, shape).
  m.def("checkpoint_info(str directory) -> str");
  // The same tensors as load_tensors, read into existing tensors (a model's, an optimizer's): no
  // allocation, no copy. Every destination and checksum is checked before any is written.
  m.def(
      "load_into_(str directory, str[] names, Tensor(a! -> *)[] out, int rank=0, "
      "int world_size=1, bool verify=True) -> ()");

  // Dim-0 shards (torch.chunk rows, possibly empty) of N tensors -> the N full tensors on every
  // rank of the c10d process group named group_name, with one all-gather.
  m.def("gather_shards(Tensor[] shards, int[] rows, str group_name) -> Tensor[]");

  // The instruction set of the CPU update kernel in use: "avx512", "avx2" or "default" (capped
  // by ATEN_CPU_CAPABILITY, as ATen's own kernels are).
  m.def("cpu_capability() -> str");
}

// Ops with no tensor argument: the kernel for calls that have nothing to dispatch on (also the
// one a device without its own kernel would reach, so each refuses tensors it cannot handle).
TORCH_LIBRARY_IMPL(fsdp_ema, CompositeExplicitAutograd, m) {
  m.impl("commit_checkpoint", &fsdp_ema::ops::commit_checkpoint);
  m.impl("checkpoint_info", &fsdp_ema::ops::checkpoint_info);
  m.impl("load_into_", &fsdp_ema::ops::load_into_);  // empty lists
  m.impl("cpu_capability", [] { return std::string(fsdp_ema::kernels::update_cpu_capability()); });
  // Empty lists: save_shard validates (names vs shards), commit_checkpoint.after commits,
  // gather_shards joins the collective with nothing to send.
  m.impl("save_shard", &fsdp_ema::ops::save_shard);
  m.impl("commit_checkpoint.after", &fsdp_ema::ops::commit_after);
  m.impl("gather_shards", &fsdp_ema::ops::gather_shards_cpu);
  // update_ with a float decay and empty lists has no tensor to dispatch on (nor do tensors on a
  // device without a kernel): validate, so the error names the bad argument ("ema is empty"),
  // then refuse. The Tensor overloads always have `decay` to dispatch on.
  for (const char* name : {"update_", "ema_shard_update_"}) {
    m.impl(name, [](at::TensorList ema, at::TensorList model, double decay) {
      fsdp_ema::ops::update_meta(ema, model, decay);
      TORCH_CHECK(false, "fsdp_ema::update_: no kernel for tensors on ", ema[0].device());
    });
  }
}

// Built from other ops (a `target` tensor on the requested device, then the private op), so the
// tracer sees the private op with a tensor to take the device from.
TORCH_LIBRARY_IMPL(fsdp_ema, CompositeImplicitAutograd, m) {
  m.impl("load_tensors", &fsdp_ema::ops::load_tensors_entry);
  m.impl("load_tensors.after", &fsdp_ema::ops::load_tensors_after_entry);
  m.impl("load_shard", &fsdp_ema::ops::load_shard_entry);
}

TORCH_LIBRARY_IMPL(fsdp_ema, CPU, m) {
  for (const char* name : {"update_", "ema_shard_update_"}) {
    m.impl(name, &fsdp_ema::ops::update_cpu);
    m.impl((std::string(name) + ".Tensor").c_str(), &fsdp_ema::ops::update_tensor_cpu);
  }
  m.impl("gather_shards", &fsdp_ema::ops::gather_shards_cpu);
  m.impl("save_shard", &fsdp_ema::ops::save_shard);
  m.impl("commit_checkpoint.after", &fsdp_ema::ops::commit_after);
  m.impl("_load_tensors", &fsdp_ema::ops::load_tensors_to);
  m.impl("_load_shard", &fsdp_ema::ops::load_shard_to);
  m.impl("load_into_", &fsdp_ema::ops::load_into_);
}

// What tracing (FakeTensorMode, torch.compile, opcheck) runs: validation and result shapes only.
// Mutating and returning nothing, update_'s meta kernel only validates. The load ops read the
// index or header, never tensor data; the file-writing ops write nothing.
TORCH_LIBRARY_IMPL(fsdp_ema, Meta, m) {
  for (const char* name : {"update_", "ema_shard_update_"}) {
    m.impl(name, &fsdp_ema::ops::update_meta);
    m.impl((std::string(name) + ".Tensor").c_str(), &fsdp_ema::ops::update_tensor_meta);
  }
  m.impl("gather_shards", &fsdp_ema::ops::gather_shards_meta);  // no collective
  m.impl("save_shard", &fsdp_ema::ops::save_shard_meta);
  m.impl("commit_checkpoint.after", &fsdp_ema::ops::commit_after_meta);
  m.impl("_load_tensors", &fsdp_ema::ops::load_tensors_meta);
  m.impl("_load_shard", &fsdp_ema::ops::load_shard_meta);
  m.impl("load_into_", &fsdp_ema::ops::load_into_meta);
}

// Checkpoint directory layout (#13): what the Python front needs so that it does no file-system
// work on checkpoint directories itself; every rule is in format/ (fsdp_ema/format/layout.h).
// No tensor arguments: one kernel for every backend, given with the schema. Those that change
// files are CONSERVATIVE, so TorchScript never dead-code-eliminates them.
TORCH_LIBRARY_FRAGMENT(fsdp_ema, m) {
  // The index's file name, the commit marker (fsdp_ema/format/names.h).
  m.def("index_file_name() -> str", [] { return std::string(fsdp_ema::format::kIndexFileName); });
  // The name rank `rank` of `world_size` writes its shard file under (fsdp_ema/format/names.h).
  m.def("shard_file_name(int rank, int world_size) -> str", [](int64_t rank, int64_t world_size) {
    TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size,
                "fsdp_ema::shard_file_name: need 0 <= rank < world_size, got rank ", rank,
                " and world_size ", world_size);
    return fsdp_ema::format::shard_file_name(rank, world_size);
  });
  // True when the directory holds a committed checkpoint (its index); creates nothing.
  m.def("is_committed(str directory) -> bool", &fsdp_ema::ops::is_committed);
  // Creates the directory (and parents) if missing; true when it holds a committed checkpoint.
  m.def(torch::schema("prepare_checkpoint(str directory) -> bool",
                      c10::AliasAnalysisKind::CONSERVATIVE),
        &fsdp_ema::ops::prepare_checkpoint);
  // A small file beside the shard files (not a layout name), written atomically.
  m.def(torch::schema("write_sidecar(str directory, str name, str content, bool fsync=True) -> ()",
                      c10::AliasAnalysisKind::CONSERVATIVE),
        &fsdp_ema::ops::write_sidecar);
  // The committed checkpoint directories directly inside root, in name order.
  m.def("committed_checkpoints(str root, bool follow_links=True) -> str[]",
        &fsdp_ema::ops::committed_checkpoints);
  // Removes a checkpoint directory: the index first, then everything else, never through a link.
  m.def(
      torch::schema("remove_checkpoint(str directory) -> ()", c10::AliasAnalysisKind::CONSERVATIVE),
      &fsdp_ema::ops::remove_checkpoint);
  // The streaming Hugging Face export writer (format::ExportWriter): ShardedEMA.export writes
  // what `fsdp-ema export` writes, byte for byte.
  m.class_<fsdp_ema::ops::ExportWriter>("ExportWriter")
      .def(torch::init<const std::string&, const std::vector<std::string>&,
                       const std::vector<at::Tensor>&, std::optional<at::ScalarType>, int64_t, bool,
                       bool>())
      .def("write", &fsdp_ema::ops::ExportWriter::write)
      .def("finish", &fsdp_ema::ops::ExportWriter::finish)
      .def("abort", &fsdp_ema::ops::ExportWriter::abort)
      .def("total_size", &fsdp_ema::ops::ExportWriter::total_size);
  // A checkpoint directory opened once (ops/load_into.h): a collective load checks and hashes
  // everything on every rank (check_into), agrees, then writes (load_into_) from the same files.
  m.class_<fsdp_ema::ops::OpenCheckpoint>("OpenCheckpoint")
      .def(torch::init<const std::string&>())
      .def("check_into", &fsdp_ema::ops::OpenCheckpoint::check_into)
      .def("load_into_", &fsdp_ema::ops::OpenCheckpoint::load_into_)
      .def("load", &fsdp_ema::ops::OpenCheckpoint::load)
      .def("check_unchanged", &fsdp_ema::ops::OpenCheckpoint::check_unchanged)
      .def("info", &fsdp_ema::ops::OpenCheckpoint::info);
}

// --- issue #18: update_multi_ (K EMA lists, one read of the model) and post-hoc EMA ---------
// Its own TORCH_LIBRARY_FRAGMENT and IMPL blocks, so this op's registration stays in one piece.
// Same alias annotation as update_ (see the note above TORCH_LIBRARY), same overload order.
TORCH_LIBRARY_FRAGMENT(fsdp_ema, m) {
  // ema[k * N + i] <- lerp(ema[k * N + i], model[i], 1 - decays[k]) for K = len(decays)
  // profile lists of N = len(model) tensors, with decays 0-dim tensors read where the tensors
  // live (no host sync; changing values never recompile).
  m.def("update_multi_.Tensor(Tensor(a! -> *)[] ema, Tensor[] model, Tensor[] decays) -> ()");
  // Same, with decays Python/C++ floats.
  m.def("update_multi_(Tensor(a! -> *)[] ema, Tensor[] model, float[] decays) -> ()");

  // Post-hoc EMA (EDM2), all computed by format/posthoc.h, the one implementation that the
  // `fsdp-ema posthoc` command also uses. gamma of a power-function EMA profile from its
  // relative standard deviation (the cubic's largest real root), and back.
  m.def("power_ema_gamma(float sigma_rel) -> float");
  m.def("power_ema_sigma_rel(float gamma) -> float");
  // Least-squares weights combining snapshots (steps[i], gammas[i]) into the profile (step,
  // gamma).
  m.def("posthoc_weights(int[] steps, float[] gammas, int step, float gamma) -> float[]");
  // JSON plan of a post-hoc reconstruction from a snapshot root: snapshots, weights, tensors.
  m.def("posthoc_plan(str snapshot_root, float sigma_rel, int? step=None, str? out=None) -> str");
}

TORCH_LIBRARY_IMPL(fsdp_ema, CompositeExplicitAutograd, m) {
  // Empty lists (nothing to dispatch on): validate so the error names the bad argument.
  m.impl("update_multi_", [](at::TensorList ema, at::TensorList model, c10::ArrayRef<double> d) {
    fsdp_ema::ops::update_multi_meta(ema, model, d);
    TORCH_CHECK(false, "fsdp_ema::update_multi_: no kernel for tensors on ", ema[0].device());
  });
  m.impl("power_ema_gamma", &fsdp_ema::ops::power_ema_gamma);
  m.impl("power_ema_sigma_rel", &fsdp_ema::ops::power_ema_sigma_rel);
  m.impl("posthoc_weights", &fsdp_ema::ops::posthoc_weights);
  m.impl("posthoc_plan", &fsdp_ema::ops::posthoc_plan);
}

TORCH_LIBRARY_IMPL(fsdp_ema, CPU, m) {
  m.impl("update_multi_", &fsdp_ema::ops::update_multi_cpu);
  m.impl("update_multi_.Tensor", &fsdp_ema::ops::update_multi_tensor_cpu);
}

TORCH_LIBRARY_IMPL(fsdp_ema, Meta, m) {
  m.impl("update_multi_", &fsdp_ema::ops::update_multi_meta);
  m.impl("update_multi_.Tensor", &fsdp_ema::ops::update_multi_tensor_meta);
}
