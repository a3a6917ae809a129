// The C++ paths with no Python and no TorchScript: CheckpointReader::load_into a torch::nn::Module
// (strict names and shapes, nested modules, buffers), the typed op wrappers of ops.h (load_tensors,
// load_shard, checkpoint_info, the tensor-returning commit), and process-group registration.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fsdp_ema/checkpoint.h>
#include <fsdp_ema/ops.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <string>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "checkpoint_fixture.h"

namespace {

namespace fs = std::filesystem;
using ::fsdp_ema::testing::scratch_dir;
using ::fsdp_ema::testing::write_sharded;
using ::testing::HasSubstr;

struct BlockImpl : torch::nn::Module {
  BlockImpl() : fc(register_module("fc", torch::nn::Linear(3, 5))) {
    scale = register_buffer("scale", torch::ones({5}));
  }
  torch::nn::Linear fc;
  torch::Tensor scale;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl()
      : block(register_module("block", Block())),
        head(register_module("head", torch::nn::Linear(5, 2))) {}
  Block block;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

std::map<std::string, at::Tensor> net_weights() {
  at::manual_seed(3);
  return {{"block.fc.weight", at::randn({5, 3})},
          {"block.fc.bias", at::randn({5})},
          {"block.scale", at::randn({5}).to(at::kDouble)},  // cast to the buffer's float32
          {"head.weight", at::randn({2, 5})},
          {"head.bias", at::randn({2})}};
}

TEST(NnModuleLoad, LoadsNestedParametersAndBuffersInPlace) {
  const fs::path dir = scratch_dir("nn");
  const auto weights = net_weights();
  write_sharded(dir, weights, 3);
  Net net;
  const at::Tensor fc_weight = net->block->fc->weight;  // the same tensor afterwards
  fsdp_ema::CheckpointReader(dir.string()).load_into(*net);
  EXPECT_TRUE(fc_weight.is_same(net->block->fc->weight));
  EXPECT_TRUE(net->block->fc->weight.requires_grad());
  for (const auto& p : net->named_parameters()) {
    EXPECT_TRUE(at::equal(p.value(), weights.at(p.key()))) << p.key();
  }
  EXPECT_TRUE(at::equal(net->block->scale, weights.at("block.scale").to(at::kFloat)));
  fs::remove_all(dir);
}

TEST(NnModuleLoad, NamesEveryProblemAndLeavesTheModuleUnchanged) {
  const fs::path dir = scratch_dir("nn_bad");
  auto weights = net_weights();
  weights.erase("head.bias");
  weights["head.weight"] = at::ones({5, 2});
  weights["extra"] = at::ones({4});
  write_sharded(dir, weights, 2);
  Net net;
  const at::Tensor before = net->block->fc->weight.detach().clone();
  try {
    fsdp_ema::CheckpointReader(dir.string()).load_into(*net);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_THAT(msg, HasSubstr("shape mismatch: head.weight (checkpoint [5, 2], module [2, 5])"));
    EXPECT_THAT(msg, HasSubstr("missing in checkpoint: head.bias"));
    EXPECT_THAT(msg, HasSubstr("unexpected in checkpoint: extra"));
  }
  EXPECT_TRUE(at::equal(net->block->fc->weight, before));
  fs::remove_all(dir);
}

// A module with tied weights (one parameter registered under two names, as a language model
// ties its embedding and output layer) has two names for one tensor: the load writes it once, when
// the checkpoint holds the same values under both names, and refuses naming both otherwise.
struct TiedImpl : torch::nn::Module {
  TiedImpl() : embed(register_module("embed", torch::nn::Linear(4, 3))) {
    out_weight = register_parameter("out_weight", embed->weight);
  }
  torch::nn::Linear embed;
  torch::Tensor out_weight;
};
TORCH_MODULE(Tied);

TEST(NnModuleLoad, TiedWeightsLoadOnceWhenTheCheckpointAgrees) {
  at::manual_seed(5);
  const at::Tensor w = at::randn({3, 4}), b = at::randn({3});
  const fs::path dir = scratch_dir("tied");
  write_sharded(dir, {{"embed.weight", w}, {"out_weight", w}, {"embed.bias", b}}, 2);
  Tied tied;
  ASSERT_TRUE(tied->out_weight.is_same(tied->embed->weight));
  fsdp_ema::CheckpointReader(dir.string()).load_into(*tied);
  EXPECT_TRUE(at::equal(tied->embed->weight, w));
  EXPECT_TRUE(at::equal(tied->embed->bias, b));
  fs::remove_all(dir);

  const fs::path differ = scratch_dir("tied_differ");
  write_sharded(differ, {{"embed.weight", w}, {"out_weight", w + 1}, {"embed.bias", b}}, 1);
  Tied other;
  const at::Tensor before = other->embed->weight.detach().clone();
  EXPECT_THAT([&] { fsdp_ema::CheckpointReader(differ.string()).load_into(*other); },
              ::testing::ThrowsMessage<c10::Error>(
                  HasSubstr("'out_weight' is the same tensor as 'embed.weight' (tied)")));
  EXPECT_TRUE(at::equal(other->embed->weight, before));
  fs::remove_all(differ);
}

TEST(OpWrappers, LoadTensorsLoadShardInfoAndTensorCommit) {
  const fs::path dir = scratch_dir("wrappers");
  const at::Tensor w = at::arange(35, at::kFloat).reshape({7, 5});
  const std::vector<int64_t> offsets{0, 0};
  const std::vector<int64_t> shape{7, 5};
  ASSERT_GT(fsdp_ema::save_shard(dir.string(), 0, 1, {"w"}, {w}, offsets, shape), 0);
  // The graph-friendly commit: a 0-dim int64 tensor on the device of `after`.
  const at::Tensor after = at::scalar_tensor(1, at::kLong);
  const at::Tensor count = fsdp_ema::commit_checkpoint(dir.string(), 1, {after});
  EXPECT_EQ(count.dim(), 0);
  EXPECT_EQ(count.item<int64_t>(), 1);

  // Rows of rank 1 of 3 (torch.chunk: 3, 3, 1).
  const auto rows = fsdp_ema::load_tensors(dir.string(), {"w"}, 1, 3);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_TRUE(at::equal(rows[0], w.chunk(3, 0)[1]));
  // Meta: dtype and shape from the index, no data.
  const auto meta = fsdp_ema::load_tensors(dir.string(), {"w"}, 2, 3, true, at::Device(at::kMeta));
  EXPECT_TRUE(meta[0].is_meta());
  EXPECT_EQ(meta[0].sizes(), at::IntArrayRef({1, 5}));

  const auto shard = fsdp_ema::load_shard((dir / "shard-00000-of-00001.safetensors").string());
  EXPECT_EQ(shard.names, std::vector<std::string>{"w"});
  EXPECT_TRUE(at::equal(shard.shards[0], w));
  EXPECT_EQ(shard.offsets, offsets);
  EXPECT_EQ(shard.global_shapes, shape);

  const std::string info = fsdp_ema::checkpoint_info(dir.string());
  EXPECT_THAT(info, HasSubstr("\"w\""));
  EXPECT_THAT(info, HasSubstr("\"world_size\":1"));
  fs::remove_all(dir);
}

TEST(OpWrappers, CommitWithMetadataRecordsItInTheIndexAndRefusesOddPairs) {
  const fs::path dir = scratch_dir("commit_metadata");
  const at::Tensor w = at::arange(6, at::kFloat);
  ASSERT_GT(fsdp_ema::save_shard(dir.string(), 0, 1, {"w"}, {w}, {0}, {6}), 0);
  try {
    fsdp_ema::commit_checkpoint(dir.string(), 1, false, true, {"lonely-key"});
    FAIL() << "an odd metadata list was taken";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("metadata must hold key, value pairs"));
  }
  EXPECT_FALSE(fs::exists(dir / "fsdp_ema.index.json"));  // refused before any file
  EXPECT_EQ(fsdp_ema::commit_checkpoint(dir.string(), 1, false, true, {"step", "12", "k", "v"}), 1);
  const std::string info = fsdp_ema::checkpoint_info(dir.string());
  EXPECT_THAT(info, HasSubstr("\"step\":\"12\""));
  EXPECT_THAT(info, HasSubstr("\"k\":\"v\""));
  fs::remove_all(dir);
}

// A backend that only carries a name (a group's name lives in its backends); no collective runs.
struct NameOnlyBackend : c10d::Backend {
  NameOnlyBackend() : c10d::Backend(0, 1) {}
  const std::string getBackendName() const override { return "name_only"; }
};

c10::intrusive_ptr<c10d::ProcessGroup> make_group() {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(0, 1);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM,
                    c10::make_intrusive<NameOnlyBackend>());
  return group;
}

TEST(ProcessGroups, RegisterGivesAResolvableNameOnce) {
  const auto group = make_group();
  const std::string name = fsdp_ema::register_process_group(group);
  EXPECT_THAT(name, HasSubstr("fsdp_ema_group_"));
  EXPECT_EQ(c10d::resolve_process_group(name).get(), group.get());
  EXPECT_EQ(fsdp_ema::register_process_group(group), name);  // already registered: same name
  const auto other = make_group();
  const std::string other_name = fsdp_ema::register_process_group(other);
  EXPECT_NE(other_name, name);
  EXPECT_EQ(c10d::resolve_process_group(other_name).get(), other.get());
  c10d::unregister_process_group(name);
  c10d::unregister_process_group(other_name);
}

TEST(ProcessGroups, ANamedGroupKeepsItsNameUnlessAnotherHoldsIt) {
  const auto group = make_group();
  group->setGroupName("frontend_test_group");
  EXPECT_EQ(fsdp_ema::register_process_group(group), "frontend_test_group");
  EXPECT_EQ(c10d::resolve_process_group("frontend_test_group").get(), group.get());
  const auto other = make_group();
  other->setGroupName("frontend_test_group");  // taken: it gets a fresh name
  const std::string other_name = fsdp_ema::register_process_group(other);
  EXPECT_NE(other_name, "frontend_test_group");
  EXPECT_EQ(c10d::resolve_process_group(other_name).get(), other.get());
  c10d::unregister_process_group("frontend_test_group");
  c10d::unregister_process_group(other_name);
}

TEST(ProcessGroups, GatherShardsNamesAnUnknownGroup) {
  EXPECT_THAT(
      [] {
        fsdp_ema::gather_shards({at::ones({2, 3})}, {2}, "no_such_group");
      },
      ::testing::ThrowsMessage<c10::Error>(
          HasSubstr("group_name 'no_such_group' names no process group")));
}

}  // namespace
