// A GoogleTest fixture shared by the format tests: the reference model (fixture_model.h) written
// as a checkpoint of kWorld ranks, in a temporary directory removed with the fixture.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tests/format/fixture_model.h"
#include "tests/format/test_util.h"

namespace fsdp_ema::format::testing {

template <int64_t kWorld>
class ReferenceCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = reference_model();
    ckpt_ = root_.subdir("ckpt");
    write_checkpoint(ckpt_, model_, kWorld);
  }
  TempDir root_;
  std::string ckpt_;  // root_/ckpt: the committed checkpoint
  std::vector<RefTensor> model_;
};

}  // namespace fsdp_ema::format::testing
