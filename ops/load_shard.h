// fsdp_ema::load_shard and the private _load_shard it calls (see ops/tracing.h for why): one
// shard file back, verified. Their kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace fsdp_ema::ops {

// names, local shards, concatenated global offsets, concatenated global shapes.
using ShardContents = std::tuple<std::vector<std::string>, std::vector<at::Tensor>,
                                 std::vector<int64_t>, std::vector<int64_t>>;

// One shard file back. The shards are memory the caller owns, read and verified in one pass; with
// mmap (opt-in) CPU shards are zero-copy views of a private mapping of the file instead
// (truncating the file while they live, then touching them, raises SIGBUS, as with
// torch.load(mmap=True)).
ShardContents load_shard(c10::string_view path, bool verify, std::optional<at::Device> device,
                         bool mmap);
// CompositeImplicitAutograd kernel of load_shard: the private op on an empty tensor on `device`.
ShardContents load_shard_entry(c10::string_view path, bool verify, std::optional<at::Device> device,
                               bool mmap);
// _load_shard on CPU and CUDA: load_shard onto target's device.
ShardContents load_shard_to(const at::Tensor& target, c10::string_view path, bool verify,
                            bool mmap);
// _load_shard's Meta kernel: reads the file's header only.
ShardContents load_shard_meta(const at::Tensor& target, c10::string_view path, bool verify,
                              bool mmap);

}  // namespace fsdp_ema::ops
