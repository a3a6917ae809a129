// Serves the EMA weights from C++ with no Python: loads the model train.py exported (its weights
// are NaN), replaces every weight with the EMA checkpoint through fsdp_ema::CheckpointReader
// (strict names and shapes; the checkpoint may have been written by any number of ranks), runs
// the validation batch and prints the loss. Two model formats:
//   MODEL.pt   TorchScript: torch::jit::load, then load_into(module) (parameters replaced in place)
//   MODEL.pt2  AOTInductor package (torch._inductor.aoti_compile_and_package, compiled with
//              runtime constant folding): AOTIModelPackageLoader, then load_into(package), which
//              goes through the package's constant-update API (no recompile per checkpoint)
//
//   serve MODEL.pt|MODEL.pt2 EMA_CHECKPOINT_DIR VAL_DIR
//
// Prints "loss=<value>" (%.9g) on its last line; exit status 1 on any error.
#include <c10/util/Exception.h>
#include <fsdp_ema/checkpoint.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>

#include <cmath>
#include <cstdio>
#include <exception>
#include <string>

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s MODEL.pt|MODEL.pt2 EMA_CHECKPOINT_DIR VAL_DIR\n", argv[0]);
    return 2;
  }
  try {
    const std::string model_path = argv[1];
    fsdp_ema::CheckpointReader ema(argv[2]);
    fsdp_ema::CheckpointReader val(argv[3]);
    const at::Tensor inputs = val.load("inputs");
    const at::Tensor targets = val.load("targets");

    torch::NoGradGuard no_grad;
    at::Tensor logits;
    if (ends_with(model_path, ".pt2")) {
      torch::inductor::AOTIModelPackageLoader package(model_path);
      ema.load_into(package);  // every weight, checksums verified; throws on any mismatch
      logits = package.run({inputs})[0];
      std::printf("model: %s (AOTInductor package)\n", model_path.c_str());
    } else {
      torch::jit::Module model = torch::jit::load(model_path);
      model.eval();
      ema.load_into(model);  // every parameter and buffer, checksums verified
      logits = model.forward({inputs}).toTensor();
      std::printf("model: %s (TorchScript)\n", model_path.c_str());
    }
    std::printf("EMA checkpoint: %s (%s layout, written by %lld rank(s), %zu tensors)\n", argv[2],
                ema.layout().c_str(), static_cast<long long>(ema.world_size()),
                ema.tensors().size());
    // train.py's loss_fn: mean token cross-entropy over (batch * seq, vocab) logits.
    const at::Tensor loss =
        at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
    const double value = loss.item<double>();
    std::printf("validation batch: %lld sequences x %lld tokens\n",
                static_cast<long long>(inputs.size(0)), static_cast<long long>(inputs.size(1)));
    std::printf("loss=%.9g\n", value);
    return std::isfinite(value) ? 0 : 1;
  } catch (const c10::Error& e) {
    // torch's errors: the message without the C++ backtrace what() appends.
    std::fprintf(stderr, "serve: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "serve: %s\n", e.what());
    return 1;
  }
}
