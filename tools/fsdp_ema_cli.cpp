// fsdp-ema: inspect, verify and export fsdp_ema (and DCP HuggingFace) checkpoint directories.
// Reads a checkpoint under its shared directory lock, as every writer of the format takes it.
// Exit status: 0 success, 1 failed check or unreadable checkpoint, 2 bad command line.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cinttypes>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/export.h"
#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/layout.h"
#include "fsdp_ema/format/names.h"
#include "tools/posthoc_cmd.h"
#include "tools/progress.h"
#include "tools/terminal_text.h"

#ifndef FSDP_EMA_VERSION
#define FSDP_EMA_VERSION "unknown"
#endif

namespace {

namespace fmt = fsdp_ema::format;
using fsdp_ema::tools::human_bytes;
using fsdp_ema::tools::printable;
using fsdp_ema::tools::Progress;

std::string with_commas(uint64_t v) {
  // Built forwards into a new string (no insert into the middle: one pass, and no GCC
  // -Wrestrict false positive on std::string::insert).
  const std::string digits = std::to_string(v);
  std::string out;
  out.reserve(digits.size() + digits.size() / 3);
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

int cmd_inspect(const std::string& dir) {
  const fmt::CheckpointDir ckpt = fmt::CheckpointDir::open(dir);
  const fmt::CheckpointIndex& index = ckpt.index();
  uint64_t total_bytes = 0, file_bytes = 0;
  size_t pieces = 0;
  for (const std::string& f : ckpt.files()) file_bytes += ckpt.shard_file(f).file_bytes();

  // Names, metadata and file names come from the checkpoint: printed escaped (printable()).
  std::printf("checkpoint:  %s\n", printable(dir).c_str());
  if (ckpt.layout() == fmt::CheckpointLayout::kFsdpEma) {
    std::printf("format:      fsdp_ema (index format_version %" PRId64 ")\n", index.format_version);
    std::printf("world size:  %" PRId64 "\n", ckpt.world_size());
  } else {
    std::printf("format:      DCP HuggingFace / safetensors directory (no index, no checksums)\n");
    std::printf("world size:  %" PRId64 " (number of files)\n", ckpt.world_size());
  }
  std::printf("files:       %zu (%s)\n", ckpt.files().size(), human_bytes(file_bytes).c_str());
  for (const auto& [k, v] : index.metadata)
    std::printf("metadata:    %s = %s\n", printable(k).c_str(), printable(v).c_str());

  std::vector<std::string> names;
  names.reserve(index.tensors.size());
  size_t name_w = 4;
  for (const fmt::IndexTensor& t : index.tensors) {
    names.push_back(printable(t.name));
    name_w = std::max(name_w, names.back().size());
  }
  name_w = std::min<size_t>(name_w, 60);
  std::printf("\n%-*s  %-7s  %-20s  %15s  %6s\n", static_cast<int>(name_w), "NAME", "DTYPE",
              "SHAPE", "BYTES", "PIECES");
  for (size_t i = 0; i < index.tensors.size(); ++i) {
    const fmt::IndexTensor& t = index.tensors[i];
    const uint64_t b = ckpt.tensor_nbytes(t.name);
    total_bytes += b;
    pieces += t.pieces.size();
    std::printf("%-*s  %-7s  %-20s  %15s  %6zu\n", static_cast<int>(name_w), names[i].c_str(),
                std::string(fmt::dtype_name(t.dtype)).c_str(),
                fmt::shape_to_string(t.shape).c_str(), with_commas(b).c_str(), t.pieces.size());
  }
  std::printf("\ntotal: %zu tensors, %s bytes (%s) in %zu pieces\n", index.tensors.size(),
              with_commas(total_bytes).c_str(), human_bytes(total_bytes).c_str(), pieces);
  return 0;
}

// The loader's verdict (CheckpointDir::open, then every piece's checksum and data checks, what
// every load applies), so verify and load agree on every layout; files the index does not list
// are harmless to our readers and a warning (a failure with --strict: DCP's reader reads them).
int cmd_verify(const std::string& dir, size_t max_failures, bool strict) {
  std::optional<fmt::CheckpointDir> ckpt;
  try {
    ckpt.emplace(fmt::CheckpointDir::open(dir));
  } catch (const fmt::FormatError& e) {
    std::printf("FAIL: %s\n", printable(e.what()).c_str());
    std::printf("verify: %s is not a valid checkpoint\n", printable(dir).c_str());
    return 1;
  }
  size_t failures = 0, pieces = 0, verified = 0;
  uint64_t bytes = 0;
  auto fail = [&](const std::string& msg) {
    if (failures < max_failures) std::printf("FAIL: %s\n", printable(msg).c_str());
    ++failures;
  };
  size_t warnings = 0;
  for (const std::string& f : ckpt->stray_files()) {
    const std::string msg =
        dir + "/" + f +
        ": not listed in the index (our readers ignore it, but DCP's "
        "HuggingFace reader would read it as part of the checkpoint; remove it)";
    if (strict) {
      fail(msg);
    } else {
      std::printf("WARNING: %s\n", printable(msg).c_str());
      ++warnings;
    }
  }
  for (const fmt::IndexTensor& t : ckpt->tensors()) {
    for (size_t p = 0; p < t.pieces.size(); ++p) {
      ++pieces;
      try {
        if (ckpt->verify_piece(t.name, p)) ++verified;
      } catch (const fmt::FormatError& e) {
        fail(e.what());
      }
    }
    bytes += ckpt->tensor_nbytes(t.name);
  }
  if (failures > max_failures) {
    std::printf("... and %zu more failures\n", failures - max_failures);
  }
  if (failures > 0) {
    std::printf("verify: %zu failure(s) in %s\n", failures, printable(dir).c_str());
    return 1;
  }
  std::printf("OK: %zu tensors, %zu pieces, %s; coverage checked, %zu checksums verified%s%s\n",
              ckpt->tensors().size(), pieces, human_bytes(bytes).c_str(), verified,
              verified < pieces ? " (DCP files carry no checksums)" : "",
              warnings > 0 ? ("; " + std::to_string(warnings) + " warning(s)").c_str() : "");
  return 0;
}

// --dtype: a dtype the export casts to, as its safetensors name in any case ("bf16") or its
// Python name ("bfloat16"): the table's spellings (fsdp_ema/format/dtype_table.h).
std::string cast_dtype_spellings(std::string_view sep) {
  std::string s = fmt::dtype_names_with_role(fmt::kRoleCast, sep);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::optional<fmt::DType> parse_cast_dtype(const std::string& s) {
  const auto d = fmt::parse_dtype_spelling(s);
  if (!d || !fmt::has_role(*d, fmt::kRoleCast)) return std::nullopt;
  return d;
}

// What `export` writes without --what: a training-state checkpoint's EMA (its model when it holds
// no EMA), named without the prefix; every tensor of any other checkpoint, names as stored.
std::string default_export_selection(const std::string& dir) {
  const fmt::CheckpointDir ckpt = fmt::CheckpointDir::open(dir);
  const fmt::CheckpointIndex& index = ckpt.index();
  if (index.find(fmt::kTrainingStateDocTensor) == nullptr) return "all";
  const bool has_ema = std::any_of(
      index.tensors.begin(), index.tensors.end(),
      [](const fmt::IndexTensor& t) { return t.name.starts_with(fmt::kTrainingStateEmaPrefix); });
  return has_ema ? "ema" : "model";
}

int cmd_export(const std::string& dir, const std::string& out, const std::string& dtype,
               std::string what, uint64_t max_file_size, bool overwrite, bool no_verify,
               bool quiet) {
  fmt::ExportOptions opts;
  if (what.empty()) {
    what = default_export_selection(dir);
    if (what != "all" && !quiet) {
      std::printf(
          "%s is a training-state checkpoint: exporting its %s (--what %s; --what model, "
          "ema or all for the others)\n",
          printable(dir).c_str(), what == "ema" ? "EMA" : "model", what.c_str());
    }
  }
  if (what == "ema") opts.select_prefix = std::string(fmt::kTrainingStateEmaPrefix);
  if (what == "model") opts.select_prefix = std::string(fmt::kTrainingStateModelPrefix);
  if (!dtype.empty()) opts.dtype = parse_cast_dtype(dtype);  // validated by the CLI parser
  opts.max_file_bytes = max_file_size;
  opts.overwrite = overwrite;
  opts.verify = !no_verify;
  Progress progress(stderr, Progress::pick_mode(stderr, quiet), "export");
  uint64_t total = 0;
  opts.progress = [&](const fmt::ExportProgress& p) {
    total = p.bytes_total;
    progress.update(p.bytes_done, p.bytes_total, p.tensor);
  };
  const fmt::ExportResult r = fmt::export_consolidated(dir, out, opts);
  progress.finish(total, total);
  if (!quiet) {
    std::printf("exported %s (%s) to %s:", with_commas(r.total_size).c_str(),
                human_bytes(r.total_size).c_str(), printable(out).c_str());
    for (const std::string& f : r.files) std::printf(" %s", f.c_str());
    if (r.wrote_index) std::printf(" %s", std::string(fmt::kExportIndexFileName).c_str());
    std::printf("\n");
  }
  return 0;
}

// What the command line says: the subcommand's arguments (one set for inspect, verify, export).
struct Args {
  std::string dir, out, dtype, what;
  size_t max_failures = 10;
  uint64_t max_file_size = 5'000'000'000;
  bool overwrite = false, no_verify = false, quiet = false, strict = false;
  fsdp_ema::tools::PosthocArgs posthoc;
  int64_t posthoc_step = -1;
};

struct Commands {
  CLI::App* inspect;
  CLI::App* verify;
  CLI::App* exp;
  CLI::App* posthoc;
};

CLI::App* add_inspect(CLI::App& app, Args& a) {
  CLI::App* inspect = app.add_subcommand(
      "inspect",
      "Print the format, world size and every tensor (dtype, global shape, bytes, pieces)");
  inspect->add_option("DIR", a.dir, "Checkpoint directory")
      ->required()
      ->check(CLI::ExistingDirectory);
  return inspect;
}

CLI::App* add_verify(CLI::App& app, Args& a) {
  CLI::App* verify = app.add_subcommand(
      "verify",
      "Check every header, the index, the coverage of every tensor, every checksum and every "
      "byte a load checks; exit 0 exactly when a load would succeed");
  verify->add_option("DIR", a.dir, "Checkpoint directory")
      ->required()
      ->check(CLI::ExistingDirectory);
  verify->add_option("--max-failures", a.max_failures, "Failures to print (default 10)");
  verify->add_flag("--strict", a.strict,
                   "Also fail on *" + std::string(fmt::kSafetensorsSuffix) +
                       " files the index does not list (a warning otherwise: DCP's reader "
                       "would read them)");
  return verify;
}

CLI::App* add_export(CLI::App& app, Args& a) {
  CLI::App* exp = app.add_subcommand(
      "export", "Write the full tensors to OUT in Hugging Face layout: " +
                    std::string(fmt::kExportSingleFileName) + ", or numbered files (" +
                    fmt::export_file_name(1, 2) + ", ...) + " +
                    std::string(fmt::kExportIndexFileName) + " above --max-file-size");
  exp->add_option("DIR", a.dir, "Checkpoint directory")->required()->check(CLI::ExistingDirectory);
  exp->add_option("OUT", a.out, "Output directory (created if missing)")->required();
  exp->add_option("--dtype", a.dtype,
                  "Cast floating tensors to " + cast_dtype_spellings(", ") +
                      " (round to nearest even); integer tensors are kept")
      ->check(CLI::Validator(
          [](std::string& s) {
            return parse_cast_dtype(s) ? std::string() : "must be " + cast_dtype_spellings(", ");
          },
          cast_dtype_spellings("|")));
  exp->add_option("--what", a.what,
                  "ema, model or all: the 'ema.' or 'model.' tensors of a training-state "
                  "checkpoint, named without that prefix, or every tensor, names as stored "
                  "(default: ema for a training state, its model if it holds no EMA; all for "
                  "any other checkpoint)")
      ->check(CLI::IsMember({"ema", "model", "all"}));
  exp->add_option("--max-file-size", a.max_file_size,
                  "Largest tensor data per file, e.g. 5GB, 500MB, 2GiB; 0 = one file (default 5GB)")
      ->transform(CLI::AsSizeValue(true));
  exp->add_flag("--overwrite", a.overwrite, "Replace model files already in OUT");
  exp->add_flag("--no-verify", a.no_verify, "Skip checksum verification while reading");
  exp->add_flag("-q,--quiet", a.quiet, "No progress and no summary");
  return exp;
}

CLI::App* add_posthoc(CLI::App& app, Args& a) {
  CLI::App* posthoc = app.add_subcommand(
      "posthoc",
      "Post-hoc EMA (EDM2): combine the power-EMA snapshots under SNAPSHOT_ROOT (written by "
      "fsdp_ema.ShardedPowerEMA) into the EMA of --sigma-rel, written to OUT as a checkpoint");
  posthoc->add_option("SNAPSHOT_ROOT", a.posthoc.snapshot_root, "Directory of snapshots")
      ->required()
      ->check(CLI::ExistingDirectory);
  posthoc->add_option("OUT", a.posthoc.out, "Output checkpoint directory")->required();
  posthoc
      ->add_option("--sigma-rel", a.posthoc.sigma_rel,
                   "Relative standard deviation of the EMA to synthesize, in (0, 0.2887]")
      ->required();
  posthoc->add_option("--step", a.posthoc_step,
                      "Training step (averaging updates) to synthesize at (default: the last "
                      "snapshot's)");
  posthoc->add_flag("--overwrite", a.posthoc.overwrite, "Replace a checkpoint already in OUT");
  posthoc->add_flag("--no-verify", a.posthoc.no_verify, "Skip checksum verification");
  posthoc->add_flag("--dry-run", a.posthoc.dry_run, "Print the snapshots and weights only");
  posthoc->add_flag("-q,--quiet", a.posthoc.quiet, "No progress and no summary");
  return posthoc;
}

int run(const Commands& c, Args& a) {
  // posthoc reads many snapshots and writes its output through format/'s save and commit,
  // which take the output directory's lock themselves.
  if (*c.posthoc) {
    if (a.posthoc_step >= 0) a.posthoc.step = a.posthoc_step;
    return fsdp_ema::tools::cmd_posthoc(a.posthoc);
  }
  // Every other command reads the checkpoint under its shared directory lock (fsdp_ema/format/
  // layout.h): a commit or a removal (exclusive) never runs while it reads, and it waits for
  // one that is running; ranks saving shard files (shared) do not block it.
  const fmt::DirectoryLock lock(a.dir, fmt::DirectoryLock::Mode::kShared);
  if (*c.inspect) return cmd_inspect(a.dir);
  if (*c.verify) return cmd_verify(a.dir, a.max_failures, a.strict);
  if (*c.exp) {
    return cmd_export(a.dir, a.out, a.dtype, a.what, a.max_file_size, a.overwrite, a.no_verify,
                      a.quiet);
  }
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "fsdp-ema: inspect, verify, export and post-hoc-combine fsdp_ema checkpoints "
      "(directories of safetensors shard files + " +
      std::string(fmt::kIndexFileName) +
      ") and torch DCP HuggingFace-sharded directories.\n"
      "Exit status: 0 success, 1 failed check or unreadable checkpoint, 2 usage error."};
  app.set_version_flag("--version", std::string("fsdp-ema ") + FSDP_EMA_VERSION +
                                        " (checkpoint format version " +
                                        std::to_string(fmt::kIndexFormatVersion) + ")");
  app.require_subcommand(1);
  Args args;
  const Commands commands{add_inspect(app, args), add_verify(app, args), add_export(app, args),
                          add_posthoc(app, args)};
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  try {
    return run(commands, args);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "\nfsdp-ema: error: %s\n", printable(e.what()).c_str());
    return 1;
  }
}
