// Sharded training with an EMA from C++ alone (no Python at run time): the program forks N ranks
// that meet through a c10d::TCPStore (served by the parent) and make a c10d::ProcessGroupGloo.
// A small torch::nn model keeps its parameters sharded by rows across the ranks (ZeRO-3 style,
// torch.chunk rows as FSDP's Shard(0)); each step every rank
//   1. gathers the full weights with fsdp_ema::gather_shards (one all-gather for all of them),
//   2. runs forward and backward on its own batch,
//   3. reduce-scatters the gradients (one collective for all of them) and averages them,
//   4. steps AdamW on its local shards and updates their EMA with fsdp_ema::update_,
// and every K steps (and at the end) saves the EMA and the model as fsdp_ema checkpoints
// (save_shard on every rank, commit_checkpoint on rank 0). Then the parent serves the last EMA
// checkpoint: CheckpointReader::load_into a fresh torch::nn model, and a validation loss.
//
//   train_sharded --out DIR [--ranks N] [--steps S] [--save-every K] [--check]
//
// --check also trains an unsharded single-process reference (plain torch::optim::AdamW on the
// whole model, the EMA by at::lerp_) on the same data and fails (exit 1) unless the saved EMA and
// model match it to 1e-6 and the served loss equals the reference EMA's loss.
#include <ATen/ATen.h>
#include <fsdp_ema/checkpoint.h>
#include <fsdp_ema/ops.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

namespace {

constexpr int64_t kIn = 8;
constexpr int64_t kHidden = 23;  // odd, and kOut < 4: uneven and empty torch.chunk rows
constexpr int64_t kOut = 3;
constexpr int64_t kBatch = 16;
constexpr double kLr = 1e-2;
constexpr double kWeightDecay = 0.01;
constexpr double kDecay = 0.9;

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kIn, kHidden))),
        fc2(register_module("fc2", torch::nn::Linear(kHidden, kOut))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

struct Options {
  std::string out;
  int ranks = 2;
  int64_t steps = 20;
  int64_t save_every = 5;
  bool check = false;
};

// Every rank starts from the same weights (and so does the reference).
Net make_net() {
  torch::manual_seed(0);
  return Net();
}

// The batch rank `rank` trains on at `step`: inputs and a fixed smooth target.
std::pair<torch::Tensor, torch::Tensor> batch(int64_t step, int64_t rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + rank);
  const torch::Tensor x = at::randn({kBatch, kIn}, gen);
  auto target_gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const torch::Tensor w = at::randn({kIn, kOut}, target_gen);
  return {x, torch::sin(x.matmul(w))};
}

std::string step_dir(const std::string& out, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step-%06lld", static_cast<long long>(step));
  return out + "/" + name;
}

bool is_save_step(const Options& o, int64_t step) {
  return step % o.save_every == 0 || step == o.steps;
}

// One rank: everything between the process group's creation and its end.
// Long: an example read top to bottom, as a training script is (group, shards, optimizer, EMA,
// steps, checkpoints, the check); cut into helpers it would hide the order it teaches.
void train_rank(const Options& o, int rank, uint16_t port) {
  at::set_num_threads(1);  // the ranks share the machine's cores
  c10d::TCPStoreOptions store_options;
  store_options.port = port;
  store_options.isServer = false;
  store_options.timeout = std::chrono::seconds(60);
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_options);
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(60));
  gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, o.ranks, gloo_options);
  // The group wraps the backend per device type, as torch.distributed's new_group does.
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, o.ranks);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  const int64_t world = o.ranks;

  Net net = make_net();
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;  // the full-size parameters forward/backward runs on
  for (const auto& p : net->named_parameters()) {
    names.push_back(p.key());
    params.push_back(p.value());
  }
  const size_t n = params.size();
  std::vector<int64_t> rows(n);
  std::vector<torch::Tensor> local(n);  // this rank's rows: the only copy kept between steps
  std::vector<int64_t> offsets, global_shapes;
  for (size_t i = 0; i < n; ++i) {
    rows[i] = params[i].size(0);
    const auto [b, e] = fsdp_ema::chunk_rows(rows[i], rank, world);
    local[i] = params[i].detach().narrow(0, b, e - b).clone().requires_grad_(true);
    for (int64_t d = 0; d < params[i].dim(); ++d) {
      offsets.push_back(d == 0 ? b : 0);
      global_shapes.push_back(params[i].size(d));
    }
  }
  std::vector<torch::Tensor> ema(n);
  for (size_t i = 0; i < n; ++i) ema[i] = local[i].detach().clone();
  torch::optim::AdamW adamw(local, torch::optim::AdamWOptions(kLr).weight_decay(kWeightDecay));

  // Reduce-scatter layout: segment r holds, for every tensor, the gradient rows rank r owns.
  std::vector<int64_t> segment(world, 0);
  std::vector<int64_t> row_numel(n);
  for (size_t i = 0; i < n; ++i) {
    row_numel[i] = params[i].numel() / std::max<int64_t>(rows[i], 1);
    for (int64_t r = 0; r < world; ++r) {
      const auto [b, e] = fsdp_ema::chunk_rows(rows[i], r, world);
      segment[r] += (e - b) * row_numel[i];
    }
  }
  const int64_t segment_max = *std::max_element(segment.begin(), segment.end());

  for (int64_t step = 1; step <= o.steps; ++step) {
    {
      torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> shards(n);
      for (size_t i = 0; i < n; ++i) shards[i] = local[i].detach();
      const std::vector<torch::Tensor> full = fsdp_ema::gather_shards(shards, rows, group);
      for (size_t i = 0; i < n; ++i) params[i].copy_(full[i]);
    }
    net->zero_grad();
    const auto [x, y] = batch(step, rank);
    torch::mse_loss(net->forward(x), y).backward();

    std::vector<torch::Tensor> inputs(world);
    for (int64_t r = 0; r < world; ++r) {
      std::vector<torch::Tensor> pieces;
      for (size_t i = 0; i < n; ++i) {
        const auto [b, e] = fsdp_ema::chunk_rows(rows[i], r, world);
        pieces.push_back(params[i].grad().narrow(0, b, e - b).reshape({-1}));
      }
      pieces.push_back(torch::zeros({segment_max - segment[r]}));
      inputs[r] = torch::cat(pieces);
    }
    std::vector<torch::Tensor> output{torch::empty({segment_max})};
    std::vector<std::vector<torch::Tensor>> input_lists{inputs};
    group->reduce_scatter(output, input_lists)->wait();
    int64_t pos = 0;
    for (size_t i = 0; i < n; ++i) {
      const int64_t numel = local[i].numel();
      local[i].mutable_grad() =
          output[0].narrow(0, pos, numel).view(local[i].sizes()).div(world).clone();
      pos += numel;
    }
    adamw.step();
    {
      torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> model(n);
      for (size_t i = 0; i < n; ++i) model[i] = local[i].detach();
      fsdp_ema::update_(ema, model, kDecay);
    }

    if (is_save_step(o, step)) {
      const std::string dir = step_dir(o.out, step);
      if (rank == 0) {
        std::filesystem::create_directories(dir + "/ema");
        std::filesystem::create_directories(dir + "/model");
      }
      group->barrier()->wait();
      std::vector<torch::Tensor> model(n);
      for (size_t i = 0; i < n; ++i) model[i] = local[i].detach();
      fsdp_ema::save_shard(dir + "/model", rank, world, names, model, offsets, global_shapes);
      fsdp_ema::save_shard(dir + "/ema", rank, world, names, ema, offsets, global_shapes);
      group->barrier()->wait();  // every rank's files are durable before the commit
      if (rank == 0) {
        fsdp_ema::commit_checkpoint(dir + "/model", world);
        fsdp_ema::commit_checkpoint(dir + "/ema", world);  // the EMA last: it marks the step
        std::printf("step %lld: saved %s (ema, model)\n", static_cast<long long>(step),
                    dir.c_str());
        std::fflush(stdout);
      }
      group->barrier()->wait();
    }
  }
}

// The unsharded reference: the same model, data and hyperparameters, plain libtorch throughout.
struct Reference {
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;
  std::vector<torch::Tensor> ema;
};

Reference train_reference(const Options& o) {
  Net net = make_net();
  Reference ref;
  for (const auto& p : net->named_parameters()) {
    ref.names.push_back(p.key());
    ref.params.push_back(p.value());
    ref.ema.push_back(p.value().detach().clone());
  }
  torch::optim::AdamW adamw(net->parameters(),
                            torch::optim::AdamWOptions(kLr).weight_decay(kWeightDecay));
  for (int64_t step = 1; step <= o.steps; ++step) {
    adamw.zero_grad();
    // The mean over ranks of each rank's mean loss: what the sharded run's averaged gradient is.
    torch::Tensor loss = torch::zeros({});
    for (int64_t r = 0; r < o.ranks; ++r) {
      const auto [x, y] = batch(step, r);
      loss = loss + torch::mse_loss(net->forward(x), y);
    }
    (loss / o.ranks).backward();
    adamw.step();
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < ref.ema.size(); ++i) {
      ref.ema[i].lerp_(ref.params[i].detach(), 1.0 - kDecay);
    }
  }
  return ref;
}

// Serving: a fresh model, every parameter from the EMA checkpoint (strict names and shapes,
// checksums verified), the loss on a held-out batch.
double serve_loss(const std::string& ema_dir) {
  Net net = make_net();
  fsdp_ema::CheckpointReader(ema_dir).load_into(*net);
  torch::NoGradGuard no_grad;
  const auto [x, y] = batch(/*step=*/1 << 20, /*rank=*/0);
  return torch::mse_loss(net->forward(x), y).item<double>();
}

double max_difference(const fsdp_ema::CheckpointReader& reader, const Reference& ref,
                      const std::vector<torch::Tensor>& expected) {
  double worst = 0;
  for (size_t i = 0; i < ref.names.size(); ++i) {
    const torch::Tensor got = reader.load(ref.names[i]);
    worst = std::max(worst, (got - expected[i].detach()).abs().max().item<double>());
  }
  return worst;
}

int run_parent(const Options& o) {
  c10d::TCPStoreOptions store_options;
  store_options.port = 0;  // any free port; the ranks learn it through fork
  store_options.isServer = true;
  store_options.numWorkers = o.ranks + 1;
  store_options.waitWorkers = false;
  store_options.timeout = std::chrono::seconds(60);
  const auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_options);
  const uint16_t port = store->getPort();
  // Checkpoints are never overwritten: a step directory already committed would be refused.
  if (std::filesystem::exists(o.out) && !std::filesystem::is_empty(o.out)) {
    std::fprintf(stderr, "train_sharded: --out %s must be a new or empty directory\n",
                 o.out.c_str());
    return 2;
  }
  std::filesystem::create_directories(o.out);

  std::vector<pid_t> children;
  for (int rank = 0; rank < o.ranks; ++rank) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("train_sharded: fork");
      return 1;
    }
    if (pid == 0) {
      int code = 0;
      try {
        train_rank(o, rank, port);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "train_sharded: rank %d: %s\n", rank, e.what());
        code = 1;
      }
      std::fflush(nullptr);
      std::_Exit(code);  // the parent's objects (the store server) are not ours to destroy
    }
    children.push_back(pid);
  }
  bool ok = true;
  for (size_t i = 0; i < children.size(); ++i) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      if (ok) {
        std::fprintf(stderr, "train_sharded: a rank failed; stopping the others\n");
        for (const pid_t child : children) {
          if (child != pid) ::kill(child, SIGKILL);
        }
      }
      ok = false;
    }
  }
  if (!ok) return 1;

  const std::string last = step_dir(o.out, o.steps);
  const double loss = serve_loss(last + "/ema");
  std::printf("served %s/ema: loss=%.9g\n", last.c_str(), loss);
  if (!o.check) return 0;

  const Reference ref = train_reference(o);
  const double ema_diff = max_difference(fsdp_ema::CheckpointReader(last + "/ema"), ref, ref.ema);
  const double model_diff =
      max_difference(fsdp_ema::CheckpointReader(last + "/model"), ref, ref.params);
  // The reference EMA's loss, computed on the reference's own tensors.
  Net ref_net = make_net();
  {
    torch::NoGradGuard no_grad;
    size_t i = 0;
    for (auto& p : ref_net->parameters()) p.copy_(ref.ema[i++]);
  }
  torch::NoGradGuard no_grad;
  const auto [x, y] = batch(1 << 20, 0);
  const double ref_loss = torch::mse_loss(ref_net->forward(x), y).item<double>();
  std::printf(
      "check: max |ema - reference| = %.3g, max |model - reference| = %.3g, "
      "reference ema loss=%.9g\n",
      ema_diff, model_diff, ref_loss);
  const bool pass = ema_diff <= 1e-6 && model_diff <= 1e-6 &&
                    std::abs(loss - ref_loss) <= 1e-6 * std::max(1.0, std::abs(ref_loss));
  std::printf("%s\n", pass ? "check passed" : "check FAILED");
  return pass ? 0 : 1;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(std::string(flag) + " needs a value");
      return argv[++i];
    };
    if (a == "--out") {
      o.out = value("--out");
    } else if (a == "--ranks") {
      o.ranks = std::stoi(value("--ranks"));
    } else if (a == "--steps") {
      o.steps = std::stoll(value("--steps"));
    } else if (a == "--save-every") {
      o.save_every = std::stoll(value("--save-every"));
    } else if (a == "--check") {
      o.check = true;
    } else {
      throw std::invalid_argument("unknown argument '" + a + "'");
    }
  }
  if (o.out.empty()) throw std::invalid_argument("--out DIR is required");
  if (o.ranks < 1) throw std::invalid_argument("--ranks must be >= 1");
  if (o.steps < 1) throw std::invalid_argument("--steps must be >= 1");
  if (o.save_every < 1) throw std::invalid_argument("--save-every must be >= 1");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "train_sharded: %s\nusage: %s --out DIR [--ranks N] [--steps S] "
                 "[--save-every K] [--check]\n",
                 e.what(), argv[0]);
    return 2;
  }
  try {
    return run_parent(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_sharded: %s\n", e.what());
    return 1;
  }
}
