// Every fsdp_ema operator: its schema (each `def` with one line on what it does; the contracts are
// in the ops/ headers and docs/OPERATORS.md, which a test checks against these schemas), then one
// kernel table per dispatch key. CUDA kernels are registered in registration_cuda.cpp, so that a
// CPU-only build has no CUDA dependency.
#include <torch/library.h>

#include "ops/checkpoint/checkpoint_info.h"
#include "ops/save/commit_checkpoint.h"
#include "ops/checkpoint/directory.h"
#include "ops/checkpoint/export_writer.h"
#include "ops/gather/gather_shards.h"
#include "ops/load/load_ops.h"
#include "ops/common/memory.h"
#include "ops/posthoc/posthoc.h"
#include "ops/queries/queries.h"
#include "ops/save/save_shard.h"
#include "ops/update/update.h"

namespace ops = fsdp_ema::ops;

// Schema notes:
// - `Tensor(a! -> *)[]` rather than the usual `Tensor(a!)[]`: TorchScript's alias analysis records
//   the write on the list value only, so for a list built inline (`[self.ema]`) it sees a write to
//   a dead temporary and dead-code-eliminates the call (the EMA silently stops updating; aten's
//   `_foreach_mul_` has the same problem). `-> *` makes the list alias the wildcard after the
//   call, which keeps it. torch.compile reads the same schema as an ordinary in-place mutation.
// - Overload order matters: Python tries overloads in registration order, and a 0-dim tensor
//   would also convert to `float` (through a host sync), so the Tensor overloads come first.
// - The ops that change files are CONSERVATIVE: TorchScript then treats them as side-effecting
//   and never dead-code-eliminates a call whose result is unused. torch.compile has no C++ mark
//   for that (`import fsdp_ema` sets torch.fx.node.has_side_effect); with the library alone, a
//   graph keeps a save whose result reaches its output, which is what commit_checkpoint.after
//   and load_tensors.after are for (they also order the calls).
TORCH_LIBRARY(fsdp_ema, m) {
  const auto writes_files = c10::AliasAnalysisKind::CONSERVATIVE;
  // ema[i] <- lerp(ema[i], model[i], 1 - decay) for every pair, in one call; decay a 0-dim tensor.
  m.def("update_.Tensor(Tensor(a! -> *)[] ema, Tensor[] model, Tensor decay) -> ()");
  // The same, with decay a float.
  m.def("update_(Tensor(a! -> *)[] ema, Tensor[] model, float decay) -> ()");
  // The seed recipe's name for update_: the same schemas and kernels.
  m.def("ema_shard_update_.Tensor(Tensor(a! -> *)[] ema, Tensor[] model, Tensor decay) -> ()");
  m.def("ema_shard_update_(Tensor(a! -> *)[] ema, Tensor[] model, float decay) -> ()");
  // K EMA lists of the same model tensors (profile-major), one read of the model; 0-dim decays.
  m.def("update_multi_.Tensor(Tensor(a! -> *)[] ema, Tensor[] model, Tensor[] decays) -> ()");
  // The same, with float decays.
  m.def("update_multi_(Tensor(a! -> *)[] ema, Tensor[] model, float[] decays) -> ()");
  // Dim-0 shards of N tensors -> the N full tensors on every rank, one all-gather.
  m.def("gather_shards(Tensor[] shards, int[] rows, str group_name) -> Tensor[]");

  // One rank's local shards into its shard file, atomically; the file's bytes as a 0-dim tensor.
  m.def(torch::schema(
      "save_shard(str directory, int rank, int world_size, str[] names, Tensor[] shards, "
      "int[] offsets, int[] global_shapes, bool fsync=True, bool overwrite=False) -> Tensor",
      writes_files));
  // The index (the commit marker) once every rank's file is there; the number of tensors.
  m.def(torch::schema(
      "commit_checkpoint(str directory, int world_size, bool overwrite=False, bool fsync=True) "
      "-> int",
      writes_files));
  // The same for compiled graphs: the count as a 0-dim tensor after the saves in `after`.
  m.def(
      torch::schema("commit_checkpoint.after(str directory, int world_size, Tensor[] after, "
                    "bool overwrite=False, bool fsync=True) -> Tensor",
                    writes_files));
  // One shard file back, verified (owned memory; mmap=True: zero-copy views).
  m.def(
      "load_shard(str path, bool verify=True, Device? device=None, bool mmap=False) "
      "-> (str[] names, Tensor[] shards, int[] offsets, int[] global_shapes)");
  // Named tensors of a committed checkpoint, whole or the rows of rank `rank` of `world_size`.
  m.def(
      "load_tensors(str directory, str[] names, int rank=0, int world_size=1, bool verify=True, "
      "Device? device=None, bool mmap=False) -> Tensor[]");
  // The same, ordered after `after` in a graph (say, commit_checkpoint.after's result).
  m.def(
      "load_tensors.after(str directory, str[] names, Tensor[] after, int rank=0, "
      "int world_size=1, bool verify=True, Device? device=None, bool mmap=False) -> Tensor[]");
  // Private: what load_tensors calls, dispatched on `target` (ops/common/tracing.h says why).
  m.def(
      "_load_tensors(Tensor target, Tensor[] after, str directory, str[] names, int rank, "
      "int world_size, bool verify, bool mmap) -> Tensor[]");
  // Private: what load_shard calls, dispatched on `target`.
  m.def(
      "_load_shard(Tensor target, str path, bool verify, bool mmap) "
      "-> (str[] names, Tensor[] shards, int[] offsets, int[] global_shapes)");
  // The same tensors as load_tensors, read into existing tensors; everything checked first.
  m.def(
      "load_into_(str directory, str[] names, Tensor(a! -> *)[] out, int rank=0, "
      "int world_size=1, bool verify=True) -> ()");
  // JSON description of a checkpoint directory: layout, world size, tensors, metadata.
  m.def("checkpoint_info(str directory) -> str");

  // Directory work for the Python front (rules: format/layout.h).
  // True when the directory holds a committed checkpoint; creates nothing.
  m.def("is_committed(str directory) -> bool");
  // Creates the directory (and parents) if missing; true when it holds a committed checkpoint.
  m.def(torch::schema("prepare_checkpoint(str directory) -> bool", writes_files));
  // A small file beside the shard files (not a layout name), written atomically.
  m.def(torch::schema("write_sidecar(str directory, str name, str content, bool fsync=True) -> ()",
                      writes_files));
  // The committed checkpoint directories directly inside root, in name order.
  m.def("committed_checkpoints(str root, bool follow_links=True) -> str[]");
  // Removes a checkpoint directory: the index first, then everything else, never through a link.
  m.def(torch::schema("remove_checkpoint(str directory) -> ()", writes_files));

  // Rules that live in C++, for Python (ops/queries/queries.h).
  // The index's file name, the commit marker.
  m.def("index_file_name() -> str");
  // The name rank `rank` of `world_size` writes its shard file under.
  m.def("shard_file_name(int rank, int world_size) -> str");
  // A training state's document tensor and its EMA and model prefixes (format/names.h).
  m.def("training_state_names() -> str[]");
  // [begin, end): the dim-0 rows torch.chunk gives rank `rank` of `world_size`.
  m.def("chunk_rows(int rows, int rank, int world_size) -> int[]");
  // JSON: the dtype table (names, torch names, sizes, roles).
  m.def("dtypes() -> str");
  // The instruction set of the CPU update kernel in use: "avx512", "avx2" or "default".
  m.def("cpu_capability() -> str");
  // Indices of the tensors that share memory with another of them (tied weights; ops/common/memory.h).
  m.def("overlapping(Tensor[] tensors) -> int[]");

  // Post-hoc EMA (EDM2), computed by format/posthoc.h (what `fsdp-ema posthoc` uses too).
  // gamma of a power-function EMA profile from its relative standard deviation.
  m.def("power_ema_gamma(float sigma_rel) -> float");
  // The profile's relative standard deviation from gamma.
  m.def("power_ema_sigma_rel(float gamma) -> float");
  // Least-squares weights combining snapshots (steps[i], gammas[i]) into the profile (step, gamma).
  m.def("posthoc_weights(int[] steps, float[] gammas, int step, float gamma) -> float[]");
  // JSON plan of a reconstruction from a snapshot root (with `out`: the output checked too).
  m.def("posthoc_plan(str snapshot_root, float sigma_rel, int? step=None, str? out=None) -> str");

  // The streaming Hugging Face export writer: what `fsdp-ema export` writes, byte for byte.
  m.class_<ops::ExportWriter>("ExportWriter")
      .def(torch::init<const std::string&, const std::vector<std::string>&,
                       const std::vector<at::Tensor>&, std::optional<at::ScalarType>, int64_t, bool,
                       bool>())
      .def("write", &ops::ExportWriter::write)
      .def("finish", &ops::ExportWriter::finish)
      .def("abort", &ops::ExportWriter::abort)
      .def("total_size", &ops::ExportWriter::total_size);
  // A checkpoint opened once: a collective load checks everywhere, agrees, then writes.
  m.class_<ops::OpenCheckpoint>("OpenCheckpoint")
      .def(torch::init<const std::string&>())
      .def("check_into", &ops::OpenCheckpoint::check_into)
      .def("load_into_", &ops::OpenCheckpoint::load_into_)
      .def("load", &ops::OpenCheckpoint::load)
      .def("load_boxes", &ops::OpenCheckpoint::load_boxes)
      .def("check_unchanged", &ops::OpenCheckpoint::check_unchanged)
      .def("info", &ops::OpenCheckpoint::info);
}

// Calls with no tensor argument to dispatch on (also what a device without a kernel of its own
// reaches, so each refuses tensors it cannot handle).
TORCH_LIBRARY_IMPL(fsdp_ema, CompositeExplicitAutograd, m) {
  m.impl("update_", &ops::update_no_kernel);  // empty lists: the error names the argument
  m.impl("ema_shard_update_", &ops::update_no_kernel);
  m.impl("update_multi_", &ops::update_multi_no_kernel);
  m.impl("gather_shards", &ops::gather_shards_cpu);  // empty lists: joins with nothing to send
  m.impl("save_shard", &ops::save_shard);            // empty lists: validates, writes its file
  m.impl("commit_checkpoint", &ops::commit_checkpoint);
  m.impl("commit_checkpoint.after", &ops::commit_after);
  m.impl("load_into_", &ops::load_into_);  // empty lists
  m.impl("checkpoint_info", &ops::checkpoint_info);
  m.impl("is_committed", &ops::is_committed);
  m.impl("prepare_checkpoint", &ops::prepare_checkpoint);
  m.impl("write_sidecar", &ops::write_sidecar);
  m.impl("committed_checkpoints", &ops::committed_checkpoints);
  m.impl("remove_checkpoint", &ops::remove_checkpoint);
  m.impl("index_file_name", &ops::index_file_name);
  m.impl("training_state_names", &ops::training_state_names);
  m.impl("shard_file_name", &ops::shard_file_name);
  m.impl("chunk_rows", &ops::chunk_rows);
  m.impl("dtypes", &ops::dtypes);
  m.impl("cpu_capability", &ops::cpu_capability);
  m.impl("overlapping", &ops::overlapping);  // real tensors of any device
  m.impl("power_ema_gamma", &ops::power_ema_gamma);
  m.impl("power_ema_sigma_rel", &ops::power_ema_sigma_rel);
  m.impl("posthoc_weights", &ops::posthoc_weights);
  m.impl("posthoc_plan", &ops::posthoc_plan);
}

// Built from other ops (a `target` tensor on the requested device, then the private op), so the
// tracer sees the private op with a tensor to take the device from.
TORCH_LIBRARY_IMPL(fsdp_ema, CompositeImplicitAutograd, m) {
  m.impl("load_tensors", &ops::load_tensors_entry);
  m.impl("load_tensors.after", &ops::load_tensors_after_entry);
  m.impl("load_shard", &ops::load_shard_entry);
}

TORCH_LIBRARY_IMPL(fsdp_ema, CPU, m) {
  m.impl("update_.Tensor", &ops::update_tensor_cpu);
  m.impl("update_", &ops::update_cpu);
  m.impl("ema_shard_update_.Tensor", &ops::update_tensor_cpu);
  m.impl("ema_shard_update_", &ops::update_cpu);
  m.impl("update_multi_.Tensor", &ops::update_multi_tensor_cpu);
  m.impl("update_multi_", &ops::update_multi_cpu);
  m.impl("gather_shards", &ops::gather_shards_cpu);
  m.impl("save_shard", &ops::save_shard);
  m.impl("commit_checkpoint.after", &ops::commit_after);
  m.impl("_load_tensors", &ops::load_tensors_to);
  m.impl("_load_shard", &ops::load_shard_to);
  m.impl("load_into_", &ops::load_into_);
}

// What tracing (FakeTensorMode: torch.compile, opcheck) runs: the ops' own validation and the
// results' shapes. The mutating ops only validate; the loads read the index or header, never
// tensor data; the file-writing ops write nothing.
TORCH_LIBRARY_IMPL(fsdp_ema, Meta, m) {
  m.impl("update_.Tensor", &ops::update_tensor_meta);
  m.impl("update_", &ops::update_meta);
  m.impl("ema_shard_update_.Tensor", &ops::update_tensor_meta);
  m.impl("ema_shard_update_", &ops::update_meta);
  m.impl("update_multi_.Tensor", &ops::update_multi_tensor_meta);
  m.impl("update_multi_", &ops::update_multi_meta);
  m.impl("gather_shards", &ops::gather_shards_meta);  // no collective
  m.impl("save_shard", &ops::save_shard_meta);
  m.impl("commit_checkpoint.after", &ops::commit_after_meta);
  m.impl("_load_tensors", &ops::load_tensors_meta);
  m.impl("_load_shard", &ops::load_shard_meta);
  m.impl("load_into_", &ops::load_into_meta);
}
