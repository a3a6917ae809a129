// Reading fsdp_ema checkpoints from C++ with no Python: a directory written by the checkpoint ops
// (fsdp_ema/ops.h, or ShardedEMA.save), or one written by torch.distributed.checkpoint's
// HuggingFace storage writer. Full tensors, the dim-0 slice any rank of any world size needs,
// checksum verification, and loading into a name->tensor map, a torch::nn::Module or a
// TorchScript module.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch::jit {
struct Module;
}  // namespace torch::jit
namespace torch::nn {
class Module;
}  // namespace torch::nn
namespace torch::inductor {
class AOTIModelPackageLoader;  // <torch/csrc/inductor/aoti_package/model_package_loader.h>
}  // namespace torch::inductor

namespace fsdp_ema {

// One tensor of a checkpoint: its name, dtype and global shape.
struct CheckpointTensor {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

// What load_into does with names that the checkpoint and the module do not share.
struct LoadOptions {
  bool strict = true;  // error on names missing from either side (shapes must always match)
  bool verify = true;  // check every piece read against its checksum
};

class CheckpointReader {
 public:
  // Opens and validates `directory` (everything but the tensor data). A directory of shard files
  // without fsdp_ema.index.json is an incomplete checkpoint and is refused.
  //
  // Loaded tensors are memory the caller owns, read and verified in one pass: truncating or
  // rewriting the files afterwards changes nothing. With mmap = true (opt-in), a CPU load whose
  // rows one stored piece holds exactly is a zero-copy view of a private mapping of the file
  // instead: faster, verified at load time, but a live view of the file's pages afterwards: a
  // change made to the file in place later shows through it, and truncating the file while the
  // tensor lives and then touching it raises SIGBUS (as with torch.load(mmap=True)). A file that
  // shrinks while a load verifies its mapping is a c10::Error naming the file, not a SIGBUS.
  // Each load maps the file anew (copy-on-write): a write through a loaded tensor changes
  // neither the file nor a tensor of another load, and a later load verifies the file as it is;
  // zero-copy tensors hold their mapping, and outlive the reader. load_into always reads owned
  // memory, so a destination only ever gets bytes its load verified.
  //
  // Every method is const and may run on several threads at once; the reader must outlive every
  // call made through it (destroying, moving or assigning it while a call runs is undefined).
  explicit CheckpointReader(const std::string& directory, bool mmap = false);
  ~CheckpointReader();
  CheckpointReader(CheckpointReader&&) noexcept;
  CheckpointReader& operator=(CheckpointReader&&) noexcept;

  const std::string& directory() const;
  // "fsdp_ema" or "dcp-huggingface".
  std::string layout() const;
  // Number of ranks that wrote the checkpoint (DCP: number of shard files).
  int64_t world_size() const;
  // Every tensor, sorted by name.
  std::vector<CheckpointTensor> tensors() const;
  bool contains(const std::string& name) const;

  // The full tensor, on `device`.
  at::Tensor load(const std::string& name, at::Device device = at::kCPU, bool verify = true) const;
  // The dim-0 rows rank `rank` of `world_size` holds, as torch.chunk(tensor, world_size)[rank]
  // (FSDP's Shard(0)): any world size, including non-divisors and more ranks than rows (empty
  // slices). A 0-dim tensor is returned whole.
  at::Tensor load_chunk(const std::string& name, int64_t rank, int64_t world_size,
                        at::Device device = at::kCPU, bool verify = true) const;
  // Every tensor, whole, by name (ordered: names come from the file, and an ordered map cannot be
  // flooded by names crafted to collide in a hash table; it is also what load_into takes).
  // To a CUDA device, load, load_chunk and load_all read through two 64 MiB pinned host buffers
  // (the device copies one while the file is read into the other): the host never holds more.
  std::map<std::string, at::Tensor> load_all(at::Device device = at::kCPU,
                                             bool verify = true) const;
  // Checks every piece against its checksum; returns how many pieces carried one.
  size_t verify_all() const;

  // Copies the checkpoint into the module's parameters and buffers (dotted names, recursively),
  // casting to their dtypes and devices. Checks every name and shape and reads every tensor
  // before the first copy, so a failure leaves the module unchanged. Errors list the missing,
  // unexpected and mis-shaped names.
  void load_into(torch::jit::Module& module, const LoadOptions& options = {}) const;
  // Same for a C++ frontend module (its named_parameters() and named_buffers(), recursively).
  void load_into(torch::nn::Module& module, const LoadOptions& options = {}) const;
  // Same for any set of named destinations, copied into in place. Every destination is checked
  // before anything is read: defined, dense, not meta (no memory to load into), inside its
  // storage, no two of its elements sharing memory, and no two destinations sharing memory (one
  // tensor under two names included); errors name the destination. The module overloads take a
  // tensor registered under several names (tied weights) as one destination: written once, and
  // only when the checkpoint holds the same values under every one of its names.
  void load_into(const std::map<std::string, at::Tensor>& targets,
                 const LoadOptions& options = {}) const;
  // Replaces the weights of an AOTInductor package (torch._inductor.aoti_compile_and_package)
  // through its constant-update API: no recompile per checkpoint. The package must have been
  // compiled with inductor_configs={"aot_inductor.use_runtime_constant_folding": True}, or its
  // weights are folded into derived constants at compile time and only some stay replaceable
  // (strict then names the missing ones). Every name and shape is checked, and every tensor read
  // and verified, before the constants change; the folded constants are recomputed from the new
  // ones. Not to be called while another thread runs the package.
  void load_into(torch::inductor::AOTIModelPackageLoader& package,
                 const LoadOptions& options = {}) const;

 private:
  // A second name (key) of a destination (value) that is the same tensor: tied weights.
  using Tied = std::map<std::string, std::string>;
  // The checks and reads of load_into: each shared name's tensor on its target's device and
  // dtype; throws before reading anything when names (strict) or shapes disagree. A tied name
  // counts as present; its stored values must equal (bit for bit, cast) the others of its tensor,
  // and stand for them where the checkpoint holds only the tied name.
  std::vector<std::pair<std::string, at::Tensor>> read_for(
      const std::map<std::string, at::Tensor>& targets, const LoadOptions& options,
      const Tied& tied = {}) const;
  // load_into of destinations written in place: every destination checked, then read_for, then
  // the copies.
  void write_into(const std::map<std::string, at::Tensor>& targets, const Tied& tied,
                  const LoadOptions& options) const;

  struct Impl;
  // impl_, or a c10::Error when this reader was moved from.
  const Impl& impl() const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp_ema
