// Every fsdp_ema operator in one table: each `def` (one line above it on what the op does; the
// contracts are in the ops/ headers and docs/OPERATORS.md, which a test checks against these
// schemas) followed by the op's kernels, one `impl` per dispatch key. The CUDA kernels are
// registered only in a build with CUDA (FSDP_EMA_CUDA_IMPL), so a CPU-only build has no CUDA
// dependency. docs/DEVELOPMENT.md, "Adding an op", says what a new op adds here.
#include <torch/library.h>

#include <string>

#include "ops/checkpoint/checkpoint_info.h"
#include "ops/checkpoint/directory.h"
#include "ops/checkpoint/export_writer.h"
#include "ops/common/memory.h"
#include "ops/gather/gather_shards.h"
#include "ops/load/load_ops.h"
#include "ops/posthoc/posthoc.h"
#include "ops/queries/queries.h"
#include "ops/save/commit_checkpoint.h"
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
//
// Kernel keys:
// - CPU, CUDA: tensors on that device.
// - Meta: what tracing (FakeTensorMode: torch.compile, opcheck) runs: the op's own validation and
//   the results' shapes. The mutating ops only validate; the loads read the index or header,
//   never tensor data; the file-writing ops write nothing.
// - CompositeExplicitAutograd: calls with no tensor argument to dispatch on (also what a device
//   without a kernel of its own reaches, so each refuses tensors it cannot handle).
// - CompositeImplicitAutograd: built from other ops (a `target` tensor on the requested device,
//   then the private op), so the tracer sees the private op with a tensor to take the device from.
// The checkpoint ops' host code handles device tensors itself (pinned staging on save, a copy
// after the read on load); their CUDA kernels put the results on the tensors' device.
namespace {

constexpr auto kCPU = c10::DispatchKey::CPU;
constexpr auto kMeta = c10::DispatchKey::Meta;
constexpr auto kNoTensor = c10::DispatchKey::CompositeExplicitAutograd;
constexpr auto kComposite = c10::DispatchKey::CompositeImplicitAutograd;

#if defined(FSDP_EMA_WITH_CUDA)
#define FSDP_EMA_CUDA_IMPL(m, name, fn) m.impl(name, c10::DispatchKey::CUDA, fn)
#else
#define FSDP_EMA_CUDA_IMPL(m, name, fn) static_cast<void>(m)
#endif

// update_'s two schemas and their kernels under `name`.
void def_update(torch::Library& m, const std::string& name) {
  const std::string tensor = name + ".Tensor";
  // Decay a 0-dim tensor (read on the device: no host sync).
  m.def(torch::schema(
      (tensor + "(Tensor(a! -> *)[] ema, Tensor[] model, Tensor decay) -> ()").c_str()));
  m.impl(tensor.c_str(), kCPU, &ops::update_tensor_cpu);
  m.impl(tensor.c_str(), kMeta, &ops::update_tensor_meta);
  FSDP_EMA_CUDA_IMPL(m, tensor.c_str(), &ops::update_tensor_cuda);
  // Decay a float.
  m.def(
      torch::schema((name + "(Tensor(a! -> *)[] ema, Tensor[] model, float decay) -> ()").c_str()));
  m.impl(name.c_str(), kNoTensor, &ops::update_no_kernel);  // empty lists: names the argument
  m.impl(name.c_str(), kCPU, &ops::update_cpu);
  m.impl(name.c_str(), kMeta, &ops::update_meta);
  FSDP_EMA_CUDA_IMPL(m, name.c_str(), &ops::update_cuda);
}

void def_update_ops(torch::Library& m) {
  // ema[i] <- lerp(ema[i], model[i], 1 - decay) for every pair, in one call.
  def_update(m, "update_");
  // The seed recipe's name for update_: the same schemas and kernels.
  def_update(m, "ema_shard_update_");

  // K EMA lists of the same model tensors (profile-major), one read of the model; 0-dim decays.
  m.def("update_multi_.Tensor(Tensor(a! -> *)[] ema, Tensor[] model, Tensor[] decays) -> ()");
  m.impl("update_multi_.Tensor", kCPU, &ops::update_multi_tensor_cpu);
  m.impl("update_multi_.Tensor", kMeta, &ops::update_multi_tensor_meta);
  FSDP_EMA_CUDA_IMPL(m, "update_multi_.Tensor", &ops::update_multi_tensor_cuda);
  // The same, with float decays.
  m.def("update_multi_(Tensor(a! -> *)[] ema, Tensor[] model, float[] decays) -> ()");
  m.impl("update_multi_", kNoTensor, &ops::update_multi_no_kernel);
  m.impl("update_multi_", kCPU, &ops::update_multi_cpu);
  m.impl("update_multi_", kMeta, &ops::update_multi_meta);
  FSDP_EMA_CUDA_IMPL(m, "update_multi_", &ops::update_multi_cuda);
}

void def_gather_ops(torch::Library& m) {
  // Dim-0 shards of N tensors -> the N full tensors on every rank, one all-gather.
  m.def("gather_shards(Tensor[] shards, int[] rows, str group_name) -> Tensor[]");
  m.impl("gather_shards", kNoTensor, &ops::gather_shards_cpu);  // empty lists: joins, sends none
  m.impl("gather_shards", kCPU, &ops::gather_shards_cpu);
  m.impl("gather_shards", kMeta, &ops::gather_shards_meta);  // shapes, no collective
  FSDP_EMA_CUDA_IMPL(m, "gather_shards", &ops::gather_shards_cuda);
  // The byte alignment of every piece gather_shards packs (Python sizes its buckets with it).
  m.def("gather_alignment() -> int");
  m.impl("gather_alignment", kNoTensor, &ops::gather_alignment);
}

void def_save_ops(torch::Library& m) {
  const auto writes_files = c10::AliasAnalysisKind::CONSERVATIVE;
  // One rank's local shards into its shard file, atomically; the file's bytes as a 0-dim tensor.
  m.def(torch::schema(
      "save_shard(str directory, int rank, int world_size, str[] names, Tensor[] shards, "
      "int[] offsets, int[] global_shapes, bool fsync=True, bool overwrite=False) -> Tensor",
      writes_files));
  m.impl("save_shard", kNoTensor, &ops::save_shard);  // empty lists: validates, writes its file
  m.impl("save_shard", kCPU, &ops::save_shard);
  m.impl("save_shard", kMeta, &ops::save_shard_meta);
  FSDP_EMA_CUDA_IMPL(m, "save_shard", &ops::save_shard_cuda);
  // The index (the commit marker) once every rank's file is there; the number of tensors.
  m.def(torch::schema(
      "commit_checkpoint(str directory, int world_size, bool overwrite=False, bool fsync=True) "
      "-> int",
      writes_files));
  m.impl("commit_checkpoint", kNoTensor, &ops::commit_checkpoint);
  // The same with the index's "metadata" object (key, value, key, value, ...): an EMA's step.
  m.def(
      torch::schema("commit_checkpoint.with_metadata(str directory, int world_size, "
                    "str[] metadata, bool overwrite=False, bool fsync=True) -> int",
                    writes_files));
  m.impl("commit_checkpoint.with_metadata", kNoTensor, &ops::commit_with_metadata);
  // The same for compiled graphs: the count as a 0-dim tensor after the saves in `after`.
  m.def(
      torch::schema("commit_checkpoint.after(str directory, int world_size, Tensor[] after, "
                    "bool overwrite=False, bool fsync=True) -> Tensor",
                    writes_files));
  m.impl("commit_checkpoint.after", kNoTensor, &ops::commit_after);
  m.impl("commit_checkpoint.after", kCPU, &ops::commit_after);
  m.impl("commit_checkpoint.after", kMeta, &ops::commit_after_meta);
  FSDP_EMA_CUDA_IMPL(m, "commit_checkpoint.after", &ops::commit_after);
}

// A load and the private twin it calls with a `target` tensor on the requested device
// (ops/common/tracing.h says why): the load's CompositeImplicitAutograd kernel `entry`; the twin's
// kernels `to` (CPU and CUDA: it loads onto its target's device) and `meta` (tracing: the index or
// a header only).
template <typename Entry, typename To, typename Meta>
void def_load_and_twin(torch::Library& m, const char* load, Entry* entry, const char* twin, To* to,
                       Meta* meta) {
  const auto name = [](const char* schema) {
    const std::string s(schema);
    return s.substr(0, s.find('('));
  };
  const std::string load_name = name(load), twin_name = name(twin);
  m.def(load);
  m.impl(load_name.c_str(), kComposite, entry);
  m.def(twin);
  m.impl(twin_name.c_str(), kCPU, to);
  m.impl(twin_name.c_str(), kMeta, meta);
  FSDP_EMA_CUDA_IMPL(m, twin_name.c_str(), to);
}

// The loads: one read pipeline (ops/load/pipeline.h). load_tensors and load_shard have no tensor
// argument, so they make one on the requested device and call their private twin with it
// (ops/common/tracing.h says why).
void def_load_ops(torch::Library& m) {
  // One shard file back, verified (owned memory; mmap=True: zero-copy views); the private
  // _load_shard it calls, dispatched on `target`.
  def_load_and_twin(m,
                    "load_shard(str path, bool verify=True, Device? device=None, bool mmap=False) "
                    "-> (str[] names, Tensor[] shards, int[] offsets, int[] global_shapes)",
                    &ops::load_shard_entry,
                    "_load_shard(Tensor target, str path, bool verify, bool mmap) "
                    "-> (str[] names, Tensor[] shards, int[] offsets, int[] global_shapes)",
                    &ops::load_shard_to, &ops::load_shard_meta);
  // Named tensors of a committed checkpoint, whole or the rows of rank `rank` of `world_size`;
  // the private _load_tensors it calls, dispatched on `target`.
  def_load_and_twin(
      m,
      "load_tensors(str directory, str[] names, int rank=0, int world_size=1, bool verify=True, "
      "Device? device=None, bool mmap=False) -> Tensor[]",
      &ops::load_tensors_entry,
      "_load_tensors(Tensor target, Tensor[] after, str directory, str[] names, int rank, "
      "int world_size, bool verify, bool mmap) -> Tensor[]",
      &ops::load_tensors_to, &ops::load_tensors_meta);
  // load_tensors ordered after `after` in a graph (say, commit_checkpoint.after's result).
  m.def(
      "load_tensors.after(str directory, str[] names, Tensor[] after, int rank=0, "
      "int world_size=1, bool verify=True, Device? device=None, bool mmap=False) -> Tensor[]");
  m.impl("load_tensors.after", kComposite, &ops::load_tensors_after_entry);
  // The same tensors as load_tensors, read into existing tensors; everything checked first.
  m.def(
      "load_into_(str directory, str[] names, Tensor(a! -> *)[] out, int rank=0, "
      "int world_size=1, bool verify=True) -> ()");
  m.impl("load_into_", kNoTensor, &ops::load_into_);  // empty lists
  m.impl("load_into_", kCPU, &ops::load_into_);
  m.impl("load_into_", kMeta, &ops::load_into_meta);
  FSDP_EMA_CUDA_IMPL(m, "load_into_", &ops::load_into_);  // host reads, then copies to the device

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

// What the Python front asks of a checkpoint directory (the rules: fsdp_ema/format/layout.h) and
// the Hugging Face export writer; no tensors, so each op has the one kernel for calls without.
void def_checkpoint_ops(torch::Library& m) {
  const auto writes_files = c10::AliasAnalysisKind::CONSERVATIVE;
  // JSON description of a checkpoint directory: layout, world size, tensors, metadata.
  m.def("checkpoint_info(str directory) -> str");
  m.impl("checkpoint_info", kNoTensor, &ops::checkpoint_info);
  // True when the directory holds a committed checkpoint; creates nothing.
  m.def("is_committed(str directory) -> bool");
  m.impl("is_committed", kNoTensor, &ops::is_committed);
  // Creates the directory (and parents) if missing; true when it holds a committed checkpoint.
  m.def(torch::schema("prepare_checkpoint(str directory) -> bool", writes_files));
  m.impl("prepare_checkpoint", kNoTensor, &ops::prepare_checkpoint);
  // A small file beside the shard files (not a layout name), written atomically.
  m.def(torch::schema("write_sidecar(str directory, str name, str content, bool fsync=True) -> ()",
                      writes_files));
  m.impl("write_sidecar", kNoTensor, &ops::write_sidecar);
  // The committed checkpoint directories directly inside root, in name order.
  m.def("committed_checkpoints(str root, bool follow_links=True) -> str[]");
  m.impl("committed_checkpoints", kNoTensor, &ops::committed_checkpoints);
  // Removes a checkpoint directory: the index first, then everything else, never through a link.
  m.def(torch::schema("remove_checkpoint(str directory) -> ()", writes_files));
  m.impl("remove_checkpoint", kNoTensor, &ops::remove_checkpoint);
  // The same, with other commit markers (a trainer's state file) gone with the index, first.
  m.def(torch::schema("remove_checkpoint.first(str directory, str[] first) -> ()", writes_files));
  m.impl("remove_checkpoint.first", kNoTensor, &ops::remove_checkpoint_first);

  // The streaming Hugging Face export writer: what `fsdp-ema export` writes, byte for byte.
  m.class_<ops::ExportWriter>("ExportWriter")
      .def(torch::init<const std::string&, const std::vector<std::string>&,
                       const std::vector<at::Tensor>&, std::optional<at::ScalarType>, int64_t, bool,
                       bool>())
      .def("write", &ops::ExportWriter::write)
      .def("finish", &ops::ExportWriter::finish)
      .def("abort", &ops::ExportWriter::abort)
      .def("total_size", &ops::ExportWriter::total_size);
}

// Rules that live in C++, for Python (ops/queries/queries.h).
void def_query_ops(torch::Library& m) {
  // The index's file name, the commit marker.
  m.def("index_file_name() -> str");
  m.impl("index_file_name", kNoTensor, &ops::index_file_name);
  // The name rank `rank` of `world_size` writes its shard file under.
  m.def("shard_file_name(int rank, int world_size) -> str");
  m.impl("shard_file_name", kNoTensor, &ops::shard_file_name);
  // A training state's document tensor and its EMA and model prefixes (fsdp_ema/format/names.h).
  m.def("training_state_names() -> str[]");
  m.impl("training_state_names", kNoTensor, &ops::training_state_names);
  // [begin, end): the dim-0 rows torch.chunk gives rank `rank` of `world_size`.
  m.def("chunk_rows(int rows, int rank, int world_size) -> int[]");
  m.impl("chunk_rows", kNoTensor, &ops::chunk_rows);
  // JSON: the dtype table (names, torch names, sizes, roles).
  m.def("dtypes() -> str");
  m.impl("dtypes", kNoTensor, &ops::dtypes);
  // The instruction set of the CPU update kernel in use: "avx512", "avx2" or "default".
  m.def("cpu_capability() -> str");
  m.impl("cpu_capability", kNoTensor, &ops::cpu_capability);
  // Indices of the tensors that share memory with another of them (tied weights; memory.h), each
  // first checked as memory a load writes (dense, inside its storage, no self-overlap).
  m.def("overlapping(Tensor[] tensors, str[] names) -> int[]");
  m.impl("overlapping", kNoTensor, &ops::overlapping_destinations);  // real tensors, any device
}

// Post-hoc EMA (EDM2), computed by fsdp_ema/format/posthoc.h (what `fsdp-ema posthoc` uses too).
void def_posthoc_ops(torch::Library& m) {
  // gamma of a power-function EMA profile from its relative standard deviation.
  m.def("power_ema_gamma(float sigma_rel) -> float");
  m.impl("power_ema_gamma", kNoTensor, &ops::power_ema_gamma);
  // The profile's relative standard deviation from gamma.
  m.def("power_ema_sigma_rel(float gamma) -> float");
  m.impl("power_ema_sigma_rel", kNoTensor, &ops::power_ema_sigma_rel);
  // Least-squares weights combining snapshots (steps[i], gammas[i]) into the profile (step, gamma).
  m.def("posthoc_weights(int[] steps, float[] gammas, int step, float gamma) -> float[]");
  m.impl("posthoc_weights", kNoTensor, &ops::posthoc_weights);
  // JSON plan of a reconstruction from a snapshot root (with `out`: the output checked too).
  m.def("posthoc_plan(str snapshot_root, float sigma_rel, int? step=None, str? out=None) -> str");
  m.impl("posthoc_plan", kNoTensor, &ops::posthoc_plan);
}

}  // namespace

// One family of ops per ops/ folder, in the order of docs/OPERATORS.md.
TORCH_LIBRARY(fsdp_ema, m) {
  def_update_ops(m);      // ops/update/
  def_gather_ops(m);      // ops/gather/
  def_save_ops(m);        // ops/save/
  def_load_ops(m);        // ops/load/
  def_checkpoint_ops(m);  // ops/checkpoint/
  def_query_ops(m);       // ops/queries/
  def_posthoc_ops(m);     // ops/posthoc/
}
