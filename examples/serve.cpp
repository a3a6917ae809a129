// Serves the EMA weights from C++ with no Python: loads the TorchScript model train.py exported
// (its weights are NaN), replaces every parameter with the EMA checkpoint through
// fsdp_ema::CheckpointReader::load_into (strict names and shapes; the checkpoint may have been
// written by any number of ranks), runs the validation batch and prints the loss.
//
//   serve MODEL.pt EMA_CHECKPOINT_DIR VAL_DIR
//
// Prints "loss=<value>" (%.9g) on its last line; exit status 1 on any error.
#include <fsdp_ema/checkpoint.h>
#include <torch/script.h>

#include <cmath>
#include <cstdio>
#include <exception>

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s MODEL.pt EMA_CHECKPOINT_DIR VAL_DIR\n", argv[0]);
    return 2;
  }
  try {
    torch::jit::Module model = torch::jit::load(argv[1]);
    model.eval();

    fsdp_ema::CheckpointReader ema(argv[2]);
    ema.load_into(model);  // every parameter, checksums verified; throws on any name/shape mismatch
    std::printf("EMA checkpoint: %s (%s layout, written by %lld rank(s), %zu tensors)\n", argv[2],
                ema.layout().c_str(), static_cast<long long>(ema.world_size()),
                ema.tensors().size());

    fsdp_ema::CheckpointReader val(argv[3]);
    const at::Tensor inputs = val.load("inputs");
    const at::Tensor targets = val.load("targets");

    torch::NoGradGuard no_grad;
    const at::Tensor logits = model.forward({inputs}).toTensor();
    // train.py's loss_fn: mean token cross-entropy over (batch * seq, vocab) logits.
    const at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}),
                                                   targets.reshape({-1}));
    const double value = loss.item<double>();
    std::printf("validation batch: %lld sequences x %lld tokens\n",
                static_cast<long long>(inputs.size(0)), static_cast<long long>(inputs.size(1)));
    std::printf("loss=%.9g\n", value);
    return std::isfinite(value) ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "serve: %s\n", e.what());
    return 1;
  }
}
