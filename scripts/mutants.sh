#!/usr/bin/env bash
# Planted bugs the tests must catch (not part of CI; about 16 minutes for all on 2 cores).
#
# Each mutant is (file, exact old text, new text) plus the tests that must fail once it is in:
# targeted ctest -R / pytest selections, not the whole suite. The mutants are applied one at a
# time to ONE scratch copy of this checkout (a git worktree of HEAD under $FSDP_EMA_MUTANTS_DIR,
# default /tmp/fsdp_ema_mutants, with the checkout's uncommitted changes and untracked files
# copied in, and its own build directory: ccache makes each rebuild one object), each reverted
# before the next. The selections first run on the unmutated copy (they must pass there).
#
#   bash scripts/mutants.sh                 # every mutant
#   bash scripts/mutants.sh NAME...         # some of them (names from --list)
#   bash scripts/mutants.sh --list
#   bash scripts/mutants.sh --check         # seconds: every mutant's old text is in its file once
#   FSDP_EMA_MUTANTS_NO_BASELINE=1 ...      # skip the baseline run
#
# Prints a killed/survived table; exits non-zero when a mutant survives or is an ERROR (its old
# text is not in the file exactly once, it does not build, or its tests fail without it): when
# code moves, update the mutant's old/new text below.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
export FSDP_EMA_MUTANTS_ROOT="$FSDP_EMA_ROOT"
export FSDP_EMA_MUTANTS_DIR="${FSDP_EMA_MUTANTS_DIR:-/tmp/fsdp_ema_mutants}"
IFS= read -r -d '' program <<'PY' || true
import os
import shutil
import subprocess
import sys
import time

ROOT = os.environ["FSDP_EMA_MUTANTS_ROOT"]
SCRATCH = os.environ["FSDP_EMA_MUTANTS_DIR"]
TREE = os.path.join(SCRATCH, "tree")
BUILD = os.path.join(TREE, "build")
PYTHON = os.environ["FSDP_EMA_PYTHON"]


def pytest(*args):
    return ("pytest", [PYTHON, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args])


def ctest(regex):
    return ("ctest", ["ctest", "--test-dir", BUILD, "--output-on-failure", "-R", regex,
                      "--no-tests=error", "--timeout", "600"])


# name: (file, old text, new text, tests that must fail). Keep the sites in code that rarely
# moves, and the old text short but unique in its file.
MUTANTS = {
    # --- packaging ------------------------------------------------------------------------------
    "torch-check-ignores-cuda": (
        "python/fsdp_ema/_library.py",
        "if (built_version, built_cuda) == (running_version, running_cuda):",
        "if built_version == running_version:",
        [pytest("python_tests/test_packaging.py", "-k", "check_torch")]),
    # --- kernels --------------------------------------------------------------------------------
    "cpu-thread-partition": (
        "kernels/update_cpu.cpp",
        "if (stop > pos) range(p, pos - first, stop - first);",
        "if (stop > pos) range(p, 0, stop - first);",
        [pytest("python_tests/test_update.py", "-k", "threads")]),
    "multi-cpu-model-tile-misaligned": (
        "kernels/update_multi_cpu.cpp",
        "kernel(pairs[k * num_tensors + t], lo, hi, decays[k]);",
        "kernel(pairs[k * num_tensors + t], lo, k == 0 ? hi : std::max(lo, hi - 1), decays[k]);",
        [pytest("python_tests/test_update_multi.py", "-k", "bit_for_bit")]),
    # The lerp rule (kernels/update_types.h, every kernel's): always from the EMA's side.
    "decay-zero-not-exact": (
        "kernels/update_types.h",
        "  return w < Op(0.5);",
        "  return w <= Op(1);",
        [pytest("python_tests/test_update.py", "-k", "decay_zero_copies"),
         pytest("python_tests/test_sharded_ema_local.py", "-k", "decay_zero")]),
    # #28: the weight 1 - decay formed from decay rounded to float32 (1.7e-4 off at 0.9999).
    "weight-formed-from-a-float32-decay": (
        "kernels/update_types.h",
        "  return static_cast<Op>(1.0 - decay);",
        "  return Op(1) - static_cast<Op>(decay);",
        [pytest("python_tests/test_update.py", "-k", "weight_is_one_minus_decay"),
         pytest("python_tests/test_update.py", "-k", "bit_exact_against_lerp"),
         pytest("python_tests/test_update.py::test_ten_thousand_steps_stay_within_float32_"
                "rounding_of_a_float64_reference[cpu-6]"),
         pytest("python_tests/test_update.py", "-k", "matches_lerp_for_every_dtype_pair")]),
    "cpu-weight-rounded-to-bf16": (
        "kernels/update_cpu_impl.h",
        "const float w = ema_weight<float>(decay);",
        "const float w = static_cast<float>(c10::BFloat16(ema_weight<float>(decay)));",
        [pytest("python_tests/test_update.py", "-k", "matches_lerp_for_every_dtype_pair")]),
    # --- ops ------------------------------------------------------------------------------------
    "bf16-decay-tensor-read-as-1-minus-decay": (
        "ops/update/update.cpp",
        "  const double value = decay.item<double>();",
        "  const double value = decay.scalar_type() == at::kBFloat16 ? 1.0 - decay.item<double>()\n"
        "                                                            : decay.item<double>();",
        [pytest("python_tests/test_update.py", "-k", "decay_tensor_dtypes")]),
    "update-overlap-of-two-elements-missed": (
        "ops/common/memory.cpp",
        "base + static_cast<uintptr_t>(hi + 1) * size,",
        "base + static_cast<uintptr_t>(hi + 1) * size - 8,",
        [pytest("python_tests/test_update.py", "-k", "bad_input"),
         pytest("python_tests/test_bad_inputs.py", "-k", "overlap")]),
    # #28: interleaved disjoint views counted as overlapping (extents, not elements).
    "overlap-by-extent-not-by-element": (
        "ops/common/memory.cpp",
        "        if (a->dense && e.dense) {",
        "        if (true) {",
        [pytest("python_tests/test_load_into.py", "-k", "interleaved"),
         pytest("python_tests/test_update.py", "-k", "interleave")]),
    # #28: a destination whose storage was shrunk written past its end (heap corruption).
    "storage-extent-unchecked": (
        "ops/common/memory.cpp",
        "  TORCH_CHECK(first >= 0 && needed <= held, op, label(index), \" reaches \", needed,",
        "  TORCH_CHECK(first >= 0 && (needed <= held || held > 0), op, label(index), \" reaches \","
        " needed,",
        [pytest("python_tests/test_load_into.py", "-k", "shrunk"),
         pytest("python_tests/test_update.py", "-k", "shrunk")]),
    # #28: writes that autograd does not see.
    "version-counter-not-bumped": (
        "ops/common/memory.cpp",
        "    if (t.defined()) t.unsafeGetTensorImpl()->bump_version();",
        "    (void)t;",
        [pytest("python_tests/test_load_into.py", "-k", "version_counter"),
         pytest("python_tests/test_update.py", "-k", "version_counter")]),
    # --- format ---------------------------------------------------------------------------------
    # #28: the post-hoc output compared with the snapshots as path strings.
    "posthoc-output-compared-as-strings": (
        "format/posthoc/posthoc.cpp",
        "    if (same_or_inside(out_dir, s.dir)) {",
        "    if (out_dir == s.dir) {",
        [ctest("^PosthocCombine.RefusesAnOutputThatIsASnapshot"),
         pytest("python_tests/test_posthoc.py", "-k", "never_a_snapshot")]),
    # #28: a path with a NUL byte cut at the NUL by the system calls.
    "nul-in-a-path-not-refused": (
        "format/core/paths.cpp",
        "  if (nul == std::string_view::npos) return;",
        "  if (nul != std::string_view::npos + 1) return;",
        [pytest("python_tests/test_attack_edges.py", "-k", "nul_byte"),
         ctest("^Export.RefusesAPathWithANulByte")]),
    # #28: verify skips the data checks of pieces without a checksum (DCP, plain HF), which a
    # load applies: verify says OK where load refuses.
    "verify-skips-data-checks-without-a-checksum": (
        "format/shard/shard_file.cpp",
        "    file_.check_data(t_, 0, data, n);\n    hash_.update(data, n);",
        "    hash_.update(data, n);",
        [pytest("python_tests/test_one_verdict.py", "-k", "bool_byte")]),
    # #28: a file's identity without its ctime: a same-size rewrite with the mtime set back
    # between a collective load's check and its write loads wrong data.
    "identity-without-ctime": (
        "format/core/file_util.cpp",
        "         now.mtime_ns == then.mtime_ns && (now.ctime_ns == then.ctime_ns || now.links == 0);",
        "         now.mtime_ns == then.mtime_ns;",
        [pytest("python_tests/test_load_into.py", "-k", "rewrit")]),
    # #28: the clean exit without its GIL-free settling time (gloo's workers abort the exit).
    "clean-exit-without-settling": (
        "python/fsdp_ema/distributed/shutdown.py",
        "    time.sleep(settle)",
        "    pass",
        [pytest("python_tests/test_clean_exit.py", "-k", "exits_zero or settles")]),
    # #28: tables of names from files keyed by the fixed-seed std::hash (hash flooding).
    "name-index-unseeded-hash": (
        "format/include/fsdp_ema/format/name_index.h",
        "  static uint64_t hash(std::string_view s) { return name_hash(s); }",
        "  static uint64_t hash(std::string_view s) { return std::hash<std::string_view>{}(s); }",
        [ctest("^Scale.NameIndexProbesStayLinearOnNamesCraftedToCollide$")]),
    "posthoc-profile-dot-uses-the-wrong-gamma": (
        "format/posthoc/posthoc.cpp",
        "if (t_a <= t_b) return num_factor * std::pow(t_a / t_b, gamma_b) / t_b;",
        "if (t_a <= t_b) return num_factor * std::pow(t_a / t_b, gamma_a) / t_b;",
        [ctest("PosthocWeights"),
         pytest("python_tests/test_posthoc.py", "-k", "numpy_solve")]),
    "posthoc-cli-drops-the-last-snapshot": (
        "format/posthoc/posthoc.cpp",
        "const double w = plan.weights[i];",
        "const double w = i + 1 == in.size() ? 0.0 : plan.weights[i];",
        [ctest("PosthocCombine"),
         pytest("python_tests/test_posthoc.py", "-k", "cli_equals_python")]),
    "chunk-rows-cpp-remainder-one": (
        "format/core/rows.cpp",
        "const int64_t cs = rows / world + (rows % world != 0 ? 1 : 0);",
        "const int64_t cs = rows / world + (rows % world > 1 ? 1 : 0);",
        [pytest("python_tests/test_checkpoint.py", "-k", "resharding"),
         pytest("python_tests/test_gather_shards.py")]),
    # #33, the read pipeline's seams. A piece with a whole-piece checksum only, read in part,
    # must be read and hashed whole (its part placed from that pass), not read in part unhashed.
    "partial-read-skips-checksum": (
        "format/read/read_plan.cpp",
        "    } else if (options_.verify && info.checksum) {\n      add_whole(p, dst, runs);",
        "    } else if (options_.verify && info.checksum && runs.size() > 1) {\n"
        "      add_whole(p, dst, runs);",
        [pytest("python_tests/test_checkpoint.py", "-k", "partial_read"),
         ctest("^ReadPipeline\\.EveryRead")]),
    # The edge blocks of a dim-0 range (read through a buffer) are checked like the rest.
    "rows-partial-read-skips-checksum": (
        "format/read/read_plan.cpp",
        "        ReadUnit& head = unit(align_down(r.src, b), mid_begin);",
        "        ReadUnit& head = open_unit(p, align_down(r.src, b), mid_begin, UnitCheck::kNone);",
        [pytest("python_tests/test_checkpoint.py", "-k", "partial_read"),
         ctest("^ReadPipeline\\.EveryRead")]),
    # The C++ reader's load_into copies from memory its load verified, never from a zero-copy
    # view of the file (read again by the copy, after the verification).
    "reader-load-into-copies-a-view": (
        "ops/reader/checkpoint_reader.cpp",
        "target.device(), /*mmap=*/false)[0];",
        "target.device(), r.mmap)[0];",
        [ctest("^CheckpointReader\\.ZeroCopyReaderLoadsIntoAModuleOnlyVerifiedBytes$")]),
    # update() refuses a model whose shards now hold other elements (same local shapes).
    # ShardedEMA.load resumes the step save() recorded (#40: the schedule restarted silently),
    # and refuses it under another schedule.
    "load-drops-the-saved-step": (
        "python/fsdp_ema/ema/persist.py",
        "        if step:\n            state.set_step(step[0])",
        "        if False:\n            state.set_step(step[0])",
        [pytest("python_tests/test_teacher.py", "-k", "save_then_load")]),
    "load-takes-another-schedule": (
        "python/fsdp_ema/ema/state.py",
        "        if changes:\n            raise ValueError(\n                f\"{what}: the checkpoint's EMA",
        "        if False:\n            raise ValueError(\n                f\"{what}: the checkpoint's EMA",
        [pytest("python_tests/test_teacher.py", "-k", "save_then_load")]),
    "update-ignores-a-resharded-model": (
        "python/fsdp_ema/ema/state.py",
        "                   else slot.sharding_changed())",
        "                   else None)",
        [pytest("python_tests/test_mesh_layouts.py", "-k", "resharded")]),
    # A chunk read straight into its destination is checked after the read, like one read into
    # a buffer (the attack's "verified load returns unverified bytes").
    # #41: a zero-copy load's verification of its mapping, unguarded: a file truncated under it
    # kills the process with SIGBUS instead of an error naming the file.
    "mapped-verification-unguarded": (
        "format/core/mapped_guard.cpp",
        "  std::atomic<Armed*>* const slot = claim(&armed);",
        "  std::atomic<Armed*>* const slot = nullptr;",
        [ctest("^MappedReads\\.AFileTruncated"),
         ctest("^MappedLoads\\.AFileTruncatedAfterTheOpen"),
         pytest("python_tests/test_mapped_truncation.py", "-k", "between_mapping")]),
    # #41: the guard taking another thread's SIGBUS (one in the range a guarded loop covers) as
    # its own: it would jump into the other thread's loop.
    "mapped-guard-ignores-the-thread": (
        "format/core/mapped_guard.cpp",
        "    if (a == nullptr || pthread_equal(a->thread, self) == 0) continue;",
        "    if (a == nullptr) continue;",
        [ctest("^MappedGuardDeathTest\\.AnotherThreadsFault")]),
    "read-chunk-skips-its-check": (
        "format/read/read_exec.cpp",
        "        check_chunk(unit, c, data, where);\n      }\n      if (direct[c.unit]",
        "      }\n      if (direct[c.unit]",
        [ctest("^ReadPipeline\\."),
         pytest("python_tests/test_concurrent_rewrites.py", "-k", "no_verified_load")]),
    # The write pass of a check-then-write load hashes what it reads (fstat cannot see a write
    # through a dirty shared page).
    "write-pass-trusts-the-check": (
        "ops/load/load_ops.cpp",
        "    read_into(dir, plan, out, verify);",
        "    read_into(dir, plan, out, false);",
        [pytest("python_tests/test_concurrent_rewrites.py", "-k", "dirty_shared_page")]),
    # Staged chunks are checked in the buffer before their copies are issued.
    "staged-chunk-skips-its-check": (
        "format/read/read_exec.cpp",
        "          check_chunk(u, c, into);",
        "          (void)into;",
        [ctest("^StagedReads\\.ABadBlock")]),
    # A rank's rows start at its first row, not the tensor's.
    "planner-ignores-the-first-row": (
        "format/read/read_plan.cpp",
        "    off[0] = q.rows.begin;",
        "    off[0] = 0;",
        [ctest("^ReadPipeline\\.Reshard"), pytest("python_tests/test_checkpoint.py", "-k",
                                                    "resharding")]),
    "one-row-overlap-not-seen-by-the-commit": (
        "format/dir/index_check.cpp",
        "      hi[d] = cell_of(d, p.offsets[d] + p.shape[d]);\n",
        "      hi[d] = cell_of(d, p.offsets[d] + p.shape[d]);\n"
        "      if (d == 0 && hi[d] - lo[d] > 1) --hi[d];\n",
        [pytest("python_tests/test_checkpoint.py", "-k", "one_row"),
         ctest("^Coverage\\.")]),
    "one-row-intersection-missed-by-reads": (
        "format/core/shape.cpp",
        "    if (hi <= lo) return std::nullopt;",
        "    if (hi <= lo || (hi - lo == 1 && a.shape[d] > 1 && b.shape[d] > 1)) return std::nullopt;",
        [pytest("python_tests/test_checkpoint.py", "-k", "resharding"),
         ctest("^CheckpointDir")]),
    "rename-before-the-header-write": (
        "format/shard/safetensors_writer.cpp",
        "  detail::pwrite_all(fd.get(), header.data(), header.size(), 0, guard.path);\n"
        "  result.header_checksum = checksum_of(header.data(), header.size());\n"
        "  if (options.fsync) detail::fsync_fd(fd.get(), guard.path);\n"
        "  fd.close_or_throw(guard.path);\n"
        "  detail::rename_replace(guard.path, path);\n"
        "  guard.armed = false;\n",
        "  detail::rename_replace(guard.path, path);\n"
        "  guard.armed = false;\n"
        "  detail::pwrite_all(fd.get(), header.data(), header.size(), 0, path);\n"
        "  result.header_checksum = checksum_of(header.data(), header.size());\n"
        "  if (options.fsync) detail::fsync_fd(fd.get(), path);\n"
        "  fd.close_or_throw(path);\n",
        [pytest("python_tests/test_disk_full.py")]),
    "temporary-kept-after-a-failed-write": (
        "format/shard/safetensors_writer.cpp",
        "    if (armed) detail::remove_quietly(path);",
        "    if (armed && false) detail::remove_quietly(path);",
        [pytest("python_tests/test_disk_full.py")]),
    "cast-rounds-ties-away-from-zero": (
        "format/core/dtype_cast.cpp",
        "if (rem > half || (rem == half && (q & 1))) ++q;",
        "if (rem >= half) ++q;",
        [pytest("python_tests/test_checkpoint.py", "-k", "cli_export_casts"),
         ctest("^DTypeCast\\.")]),
    "commit-indexes-without-a-missing-rank": (
        "format/dir/index_build.cpp",
        "    if (!detail::path_exists(detail::join_path(dir, name))) {\n"
        "      throw FormatError(dir + \": missing shard file \"",
        "    if (!detail::path_exists(detail::join_path(dir, name))) continue;\n    if (false) {\n"
        "      throw FormatError(dir + \": missing shard file \"",
        # The commit refuses a missing rank before it builds the index (layout.cpp); the index's
        # own refusal is what the format test of build_index_from_files pins.
        [pytest("python_tests/test_checkpoint.py", "-k", "missing_rank"),
         ctest("^Index\\.BuildFromDirectoryReadsEveryRanksHeader$")]),
    "index-json-drops-a-zero-checksum": (
        "format/dir/index_file.cpp",
        "      if (p.checksum) {\n        out += \", \\\"checksum\\\": \\\"\";",
        "      if (p.checksum && *p.checksum != 0) {\n        out += \", \\\"checksum\\\": \\\"\";",
        [ctest("^format_fuzz_replay$")]),
    # --- tracing and the C++ paths (#15) --------------------------------------------------------
    "meta-load-ignores-rank-rows": (
        "ops/load/pipeline.cpp",
        "  shape[0] = item.rows.size();",
        "  (void)item.rows;",
        [pytest("python_tests/test_library_only.py", "-k", "tracing or opcheck")]),
    "train-sharded-gradients-not-averaged": (
        "examples/train_sharded.cpp",
        ".view(local[i].sizes()).div(world).clone();",
        ".view(local[i].sizes()).clone();",
        [ctest("^train_sharded_2ranks$")]),
    # --- Python ---------------------------------------------------------------------------------
    # The row rule has no Python copy (chunk-rows-cpp-remainder-one covers it); a Layout whose
    # second replica writes too puts two pieces over one box.
    # Loads to a device through two staging buffers: refilling a buffer before waiting for the
    # copies out of it hands the device the next step's bytes.
    "staging-refills-before-wait": (
        "format/read/read_exec.cpp",
        "if (s >= 2) target.acquire(b);",
        "if (s >= 2 && false) target.acquire(b);",
        [ctest("^StagedReads\\.LateCopies")]),
    "layout-every-replica-writes": (
        "python/fsdp_ema/model/layouts.py",
        "if any(c for c, p in zip(coordinate, self.placements) if not is_shard(p)):",
        "if False:",
        [pytest("python_tests/test_layouts.py", "-k", "exactly_once")]),
    "warmup-ignores-start-step": (
        "python/fsdp_ema/ema/schedule.py",
        "s = (k - self.start_step).clamp_min(0).to(torch.float64)",
        "s = k.clamp_min(0).to(torch.float64)",
        [pytest("python_tests/test_sharded_ema_local.py", "-k", "written_out")]),
    "update-every-counted-from-start-step": (
        "python/fsdp_ema/ema/schedule.py",
        "d = torch.where(k % self.update_every == 0, d, 1.0)",
        "d = torch.where((k - self.start_step) % self.update_every == 0, d, 1.0)",
        [pytest("python_tests/test_sharded_ema_local.py", "-k", "written_out")]),
    "decay-at-ignores-start-step": (
        "python/fsdp_ema/ema/schedule.py",
        "return self.warmup(step - self.start_step, self.decay) if self.warmup else self.decay",
        "return self.warmup(step, self.decay) if self.warmup else self.decay",
        [pytest("python_tests/test_sharded_ema_local.py", "-k", "written_out")]),
    "commit-before-the-barrier": (
        "python/fsdp_ema/store/collective.py",
        "    nbytes = run(write)  # also the barrier: every rank's file is durable past here\n",
        "    nbytes = write()\n",
        [pytest("python_tests/test_sharded_ema.py", "-k", "slow_rank")]),
    "strict-false-load-state-dict-loads-nothing": (
        "python/fsdp_ema/ema/persist.py",
        "for fqn, _ in slot.names() if fqn in state_dict}",
        "for fqn, _ in slot.names() if fqn in state_dict and strict}",
        [pytest("python_tests/test_sharded_ema_local.py", "-k", "strict_false")]),
    "strict-false-load-directory-loads-nothing": (
        "python/fsdp_ema/ema/persist.py",
        "check_names=lambda available: self._check_names(available, strict, \"load\"),",
        "check_names=lambda available: self._check_names(available, strict, \"load\") or "
        "(not strict and available.clear()),",
        [pytest("python_tests/test_sharded_ema_local.py", "-k", "strict_false")]),
    "power-ema-counts-t-from-0": (
        "python/fsdp_ema/ema/power.py",
        "return (1.0 - 1.0 / t.to(torch.float64)) ** self._exponent",
        "return (1.0 - 1.0 / (t + 1).to(torch.float64)) ** self._exponent",
        [pytest("python_tests/test_power_ema.py", "-k", "direct_float64")]),
    "posthoc-python-sums-without-the-last-snapshot": (
        "python/fsdp_ema/store/posthoc.py",
        "p = x.to(torch.float64).mul_(w)",
        "p = x.to(torch.float64).mul_(0.0 if last else w)",
        [pytest("python_tests/test_posthoc.py", "-k", "cli_equals_python or 2_ranks")]),
    # --- diffusers EMAModel (#42) ---------------------------------------------------------------
    # diffusers' schedule off by one update (the first averaging step used s = 0's decay).
    "diffusers-decay-off-by-one": (
        "python/fsdp_ema/integrations/diffusers_schedule.py",
        "s = (t - (self.update_after_step + 1)).clamp_min(0)",
        "s = (t - self.update_after_step).clamp_min(0)",
        [pytest("python_tests/test_integration_diffusers.py", "-k", "plain_matches")]),
    "diffusers-parameters-iterable-taken": (
        "python/fsdp_ema/integrations/diffusers.py",
        "        if not isinstance(parameters, nn.Module):\n            raise TypeError(",
        "        if False:\n            raise TypeError(",
        [pytest("python_tests/test_integration_diffusers.py", "-k", "refusals")]),
    "diffusers-step-takes-other-parameters": (
        "python/fsdp_ema/integrations/diffusers.py",
        "        if not self._own(_params(parameters, \"EMAModel.step\")):",
        "        if not self._own(list(self.model.parameters())):",
        [pytest("python_tests/test_integration_diffusers.py", "-k", "refusals")]),
    # The cached parameter list taken for the model's after it replaced one of them.
    "diffusers-step-list-cache-unchecked": (
        "python/fsdp_ema/integrations/diffusers.py",
        "        if (len(given) == len(self.params) and all(map(operator.is_, given, self.params))\n"
        "                and self.current()):",
        "        if (len(given) == len(self.params) and all(map(operator.is_, given, self.params))\n"
        "                and True):",
        [pytest("python_tests/test_integration_diffusers.py", "-k", "round_trips and fsdp2")]),
    # An EMA made after a forward without backward (FSDP2's root left unsharded) kept the root's
    # parameters whole beside the others' shards, and copy_to/update mixed them with DTensors.
    "ema-made-from-unsharded-fsdp2-root": (
        "python/fsdp_ema/ema/state.py",
        "        for module in fsdp2_modules:\n            module.reshard()\n        slots = ",
        "        slots = ",
        [pytest("python_tests/test_sharded_ema.py", "-k", "forward_without_backward")]),
    # store() before the EMA's first use kept the unsharded root's full tensors.
    "diffusers-store-without-reshard": (
        "python/fsdp_ema/integrations/diffusers.py",
        "        \"\"\"Keeps a host copy of ``parameters`` (this rank's shards) for ``restore``.\"\"\"\n"
        "        self._reshard()\n",
        "        \"\"\"Keeps a host copy of ``parameters`` (this rank's shards) for ``restore``.\"\"\"\n",
        [pytest("python_tests/test_integration_diffusers.py", "-k", "sharded_matches and fsdp2")]),
    "diffusers-settings-unchecked": (
        "python/fsdp_ema/integrations/diffusers_schedule.py",
        "        if name in (\"inv_gamma\", \"power\") and not value > 0:",
        "        if False:",
        [pytest("python_tests/test_integration_diffusers.py", "-k", "refusals")]),
    # An EMAModel of the module FSDP1 then wrapped averaged nothing it could name.
    "diffusers-fsdp1-wrapped-taken": (
        "python/fsdp_ema/integrations/diffusers.py",
        "        if changed and not isinstance(model, FullyShardedDataParallel):",
        "        if False:",
        [pytest("python_tests/test_integration_diffusers.py", "-k", "round_trips and fsdp1")]),
    # A sharded EMA listed its local shards as diffusers' full shadow_params.
    "diffusers-sharded-shadow-params-listed": (
        "python/fsdp_ema/integrations/diffusers.py",
        "        if self.sharded:\n            raise RuntimeError(",
        "        if False:\n            raise RuntimeError(",
        [pytest("python_tests/test_integration_diffusers.py", "-k", "round_trips and fsdp2")]),
    "diffusers-shadow-shapes-unchecked": (
        "python/fsdp_ema/integrations/diffusers.py",
        "                if name not in shapes or global_shape(value) != shapes[name]:",
        "                if name not in shapes:",
        [pytest("python_tests/test_integration_diffusers.py", "-k", "refusals")]),
    "diffusers-restore-shapes-unchecked": (
        "python/fsdp_ema/integrations/diffusers.py",
        "        if len(targets) != len(stored) or any(",
        "        if False and any(",
        [pytest("python_tests/test_integration_diffusers.py", "-k", "refusals")]),
    "diffusers-accelerate-folder-unchecked": (
        "python/fsdp_ema/integrations/diffusers.py",
        "            if not (isinstance(folder, str) and folder and os.path.basename(folder) == folder",
        "            if not (isinstance(folder, str) and folder",
        [pytest("python_tests/test_integration_diffusers.py", "-k", "round_trips and fsdp2")]),
    # --- trainer integrations (#41) --------------------------------------------------------------
    # async_save: the deferred rotation counted the step about to be saved as a kept checkpoint
    # (3 on disk with save_total_limit=1).
    "rotation-counts-a-folder-not-there": (
        "python/fsdp_ema/integrations/hf_checkpoints.py",
        "                                 & set(ordered))",
        "                                 | {saving})",
        [pytest("python_tests/test_integration_transformers.py", "-k", "limit_holds")]),
    "rotation-removes-the-folder-being-saved": (
        "python/fsdp_ema/integrations/hf_checkpoints.py",
        "             if os.path.abspath(path) != saving]",
        "             ]",
        [pytest("python_tests/test_integration_transformers.py", "-k",
                "never_removes_the_step_being_saved")]),
    # A search trial's EMA went into output_dir/checkpoint-N (another run's) and its rotation
    # removed that run's folders.
    "trial-ema-saved-into-output-dir": (
        "python/fsdp_ema/integrations/transformers.py",
        "        self._run_dir = run_folder(args, state)",
        "        self._run_dir = None",
        [pytest("python_tests/test_integration_transformers.py", "-k", "search_trial")]),
    "trial-rotation-in-output-dir": (
        "python/fsdp_ema/integrations/hf_checkpoints.py",
        "        folder = self.folder or args.output_dir",
        "        folder = args.output_dir",
        [pytest("python_tests/test_integration_transformers.py", "-k", "search_trial")]),
    "trial-folder-unread-not-refused": (
        "python/fsdp_ema/integrations/hf_checkpoints.py",
        "    if trial is None and not getattr(state, \"is_hyper_param_search\", False):",
        "    if trial is None:",
        [pytest("python_tests/test_integration_transformers.py", "-k", "trial_whose_folder")]),
    # fit(ckpt_path=<the final checkpoint>) skips training: the EMA stayed a fresh one.
    "fit-past-the-end-keeps-a-fresh-ema": (
        "python/fsdp_ema/integrations/lightning.py",
        "        # callback's EMA, its swap and its teacher are the checkpoint's, not a fresh one.\n"
        "        if self._restore is not None:",
        "        if False:",
        [pytest("python_tests/test_integration_lightning.py", "-k", "final_checkpoint")]),
    # A run resumed below an abandoned branch's checkpoints left them until its first rotation:
    # killed before it, resume_from_checkpoint=True continued that branch.
    "resumed-run-keeps-an-abandoned-branch": (
        "python/fsdp_ema/integrations/transformers.py",
        "        if state.global_step > 0:  # a resumed run: the checkpoints above it are not its",
        "        if False:  # a resumed run: the checkpoints above it are not its",
        [pytest("python_tests/test_integration_kills.py", "-k", "abandoned_branch")]),
    "abandoned-branch-removed-lowest-first": (
        "python/fsdp_ema/integrations/hf_checkpoints.py",
        "        for n, path in sorted(checkpoint_folders(self.folder or args.output_dir), "
        "reverse=True):",
        "        for n, path in sorted(checkpoint_folders(self.folder or args.output_dir)):",
        [pytest("python_tests/test_integration_transformers.py", "-k", "above_its_step")]),
    "abandoned-branch-removed-without-a-limit": (
        "python/fsdp_ema/integrations/hf_checkpoints.py",
        "            return []\n        kept = {os.path.abspath(k)",
        "            pass\n        kept = {os.path.abspath(k)",
        [pytest("python_tests/test_integration_transformers.py", "-k", "above_its_step")]),
    # The HF rotation: a folder it cannot remove counts as gone, no other checkpoint in its place.
    "rotation-replaces-a-folder-it-could-not-remove": (
        "python/fsdp_ema/integrations/hf_checkpoints.py",
        "        tried += 1\n        if _remove(path):",
        "        if _remove(path):\n            tried += 1",
        [pytest("python_tests/test_integration_transformers.py", "-k", "cannot_remove")]),
    # #41: the teacher of a submodule that is not its own FSDP2 unit is refused at module().
    "teacher-of-a-submodule-without-its-unit": (
        "python/fsdp_ema/ema/teacher.py",
        "        _check_own_units(model, managed)\n",
        "",
        [pytest("python_tests/test_teacher.py", "-k", "own_fsdp2_unit")]),
    # #41: an EMA in another dtype than the student: an FSDP2 teacher computes in the student's
    # dtype; a plain model's (or an mp_policy without param_dtype) refuses an input of the
    # student's dtype naming the fix; a plain model's mp_policy is refused, not ignored.
    "teacher-policy-keeps-the-ema-dtype": (
        "python/fsdp_ema/ema/teacher.py",
        "        if len(student) == 1 and teacher != student:\n",
        "        if False:\n",
        [pytest("python_tests/test_teacher.py", "-k", "another_dtype")]),
    "teacher-dtype-check-lets-the-input-through": (
        "python/fsdp_ema/ema/teacher_checks.py",
        "                raise RuntimeError(self.message(where))",
        "                pass",
        [pytest("python_tests/test_teacher.py", "-k", "another_dtype")]),
    "teacher-of-a-plain-model-ignores-mp-policy": (
        "python/fsdp_ema/ema/teacher.py",
        "        if self.mp_policy is not None and not fsdp2:\n",
        "        if False:\n",
        [pytest("python_tests/test_teacher.py", "-k", "another_dtype")]),
    # #41: a teacher made trainable is refused before its forward, by update() and by module();
    # one converted since (teacher.double()) refuses to run and module() builds a new one.
    "teacher-forward-runs-with-requires-grad": (
        "python/fsdp_ema/ema/teacher_checks.py",
        "        if not torch.compiler.is_compiling():\n            self.links.check_forward()",
        "        if False:\n            self.links.check_forward()",
        [pytest("python_tests/test_teacher.py", "-k", "trainable_or_converted")]),
    "update-ignores-a-trainable-teacher": (
        "python/fsdp_ema/ema/sharded.py",
        "                check_teachers(state.teachers, \"ShardedEMA.update()\")",
        "                pass",
        [pytest("python_tests/test_teacher.py", "-k", "trainable_or_converted")]),
    "module-returns-a-trainable-teacher": (
        "python/fsdp_ema/ema/teacher.py",
        "            teacher.links.refuse_grad(\"ShardedEMA.module()\")\n",
        "            pass\n",
        [pytest("python_tests/test_teacher.py", "-k", "trainable_or_converted")]),
    "module-returns-a-converted-teacher": (
        "python/fsdp_ema/ema/teacher.py",
        "        if teacher.links.replaced():",
        "        if False:",
        [pytest("python_tests/test_teacher.py", "-k", "trainable_or_converted")]),
    "teacher-links-miss-a-replaced-tensor": (
        "python/fsdp_ema/ema/teacher_checks.py",
        "            if t is None or not _same(local_of(t), expected):",
        "            if t is None:",
        [pytest("python_tests/test_teacher.py", "-k", "trainable_or_converted")]),
    # #41: a schedule's decay_at(0) says how its count relates to ShardedEMA.decay_at(k).
    "schedule-takes-t-0": (
        "python/fsdp_ema/ema/config.py",
        "    if t < 1:\n        raise ValueError(f\"{what}.decay_at: t counts",
        "    if t < 0:\n        raise ValueError(f\"{what}.decay_at: t counts",
        [pytest("python_tests/test_teacher.py", "-k", "counts_update_calls")]),
    # #41: training_state.json records no decay where a schedule gives the decays, and
    # load_training_state refuses an EMA of another schedule as ShardedEMA.load does.
    "training-state-records-an-unused-decay": (
        "python/fsdp_ema/store/training_state.py",
        "\"decay\": None if ema.schedule is not None else ema.decay,",
        "\"decay\": ema.decay,",
        [pytest("python_tests/test_teacher.py", "-k", "what_gives_the_decay")]),
    "load-training-state-takes-another-schedule": (
        "python/fsdp_ema/store/training_load.py",
        "        given[\"ema\"].state.check_position(saved, what=what, allow=allow_changes)",
        "        pass",
        [pytest("python_tests/test_teacher.py", "-k", "what_gives_the_decay")]),
    # #41: compile=True compiles the teacher with the student's torch.compile settings.
    "teacher-compiles-with-torch-compile-defaults": (
        "python/fsdp_ema/ema/teacher.py",
        "        if self.compile is not True:\n            return None",
        "        if True:\n            return None",
        [pytest("python_tests/test_teacher.py", "-k", "students_torch_compile")]),
    # --- #41: zero-copy loads each map the file anew --------------------------------------------
    "zero-copy-loads-share-one-mapping": (
        "ops/load/pipeline.cpp",
        "  LoadMappings maps;\n  std::vector<const format::StoredPiece*> exact",
        "  static LoadMappings maps;\n  std::vector<const format::StoredPiece*> exact",
        [ctest("CheckpointReader.ZeroCopyLoadsNeverShareMemory"),
         ctest("OwnedLoads.ReaderMmapOptInSharesTheFilePages")]),
    # --- #41: the seal binds a header's block checksums to its checksums ---------------------
    "seal-not-checked": (
        "format/shard/shard_header.cpp",
        "if (seal.digest() != *stored) {",
        "if (false) {",
        [ctest("ShardCorruption.InconsistentBlockChecksumsAreRefused"),
         pytest("python_tests/test_one_verdict.py", "-k", "edited_together")]),
    "unsealed-block-checksums-used": (
        "format/shard/shard_header.cpp",
        "    h.block_bytes = 0;\n    for (TensorInfo& t : h.tensors) t.block_checksums.clear();\n",
        "",
        [ctest("ShardCorruption.InconsistentBlockChecksumsAreRefused")]),
    # --- #41: a tensor's checksum and its block checksums in one pass ------------------------
    "one-pass-block-end-scrambled-key": (
        "format/include/fsdp_ema/format/xxh3_blocks_impl.h",
        "d.stripe(s16, secret() + kLastStripeKey);",
        "d.stripe(s16, secret() + 8 * (kUnitStripes - 1));",
        [ctest("OnePassHash.EqualsXxh3OfTheTensorAndOfEveryBlock"),
         ctest("OnePassHash.TheWriterStoresTheReferenceChecksums")]),
    "one-pass-240-byte-block-long-rule": (
        "format/core/checksum.cpp",
        "if (block_len <= 240) {",
        "if (block_len < 240) {",
        [ctest("OnePassHash.EqualsXxh3OfTheTensorAndOfEveryBlock")]),
    # --- #41: destinations that overlap each other or themselves, meta destinations ----------
    "self-overlap-element-map-sees-none": (
        "ops/common/memory.cpp",
        "shared = shared || used[k];",
        "shared = false;",
        [pytest("python_tests/test_load_into.py", "-k", "share_memory"),
         ctest("CheckpointReader.LoadIntoRefusesOverlappingAndMetaDestinations")]),
    "overlapping-op-checks-no-destination": (
        "ops/common/memory.cpp",
        "check_in_storage(kOp, tensors[i], label, i, /*written=*/true);",
        "check_in_storage(kOp, tensors[i], label, i, /*written=*/false);",
        [pytest("python_tests/test_layout_ops.py", "-k", "refuses_a_destination"),
         pytest("python_tests/test_load_into.py", "-k", "collective_load_refuses_a_destination")]),
    "collective-copied-destinations-unchecked": (
        "python/fsdp_ema/store/collective.py",
        "shared = _overlapping(in_place + [t for t in fresh if t.dest is not None])",
        "shared = _overlapping(in_place)",
        [pytest("python_tests/test_load_into.py", "-k", "collective_load_refuses_a_destination")]),
    "reader-takes-meta-destinations": (
        "ops/reader/checkpoint_reader.cpp",
        "TORCH_CHECK(!t.is_meta(), op, label(i),",
        "TORCH_CHECK(true, op, label(i),",
        [ctest("CheckpointReader.LoadIntoRefusesOverlappingAndMetaDestinations")]),
    "reader-destinations-may-share-memory": (
        "ops/reader/checkpoint_reader.cpp",
        "  ops::check_no_overlap(op.c_str(), tensors, label, {}, label,",
        "  if (false) ops::check_no_overlap(op.c_str(), tensors, label, {}, label,",
        [ctest("CheckpointReader.LoadIntoRefusesOverlappingAndMetaDestinations")]),
    # --- #41 item 4: load_training_state is all or nothing ---------------------------------------
    "training-state-load-reads-twice": (
        "python/fsdp_ema/store/training_load.py",
        "                                 staged=True)",
        "                                 staged=False)",
        [pytest("python_tests/test_training_state_atomic.py", "-k", "after_the_one_read")]),
    "load-written-without-the-agreement": (
        "python/fsdp_ema/store/collective.py",
        "    ckpt, by_request, fresh, values = run(check)\n",
        "    ckpt, by_request, fresh, values = check()\n",
        [pytest("python_tests/test_training_state_atomic.py", "-k", "corrupted_file_on_one_rank")]),
    "optimizer-values-set-before-the-agreement": (
        "python/fsdp_ema/store/training_load.py",
        "                self.values.append((entries, key, value))",
        "                entries[key] = value",
        [pytest("python_tests/test_training_state_atomic.py", "-k", "non_tensor_state")]),
    "refused-load-keeps-the-initialized-optimizer-state": (
        "python/fsdp_ema/store/training_load.py",
        "            optimizer.state.clear()",
        "            pass",
        [pytest("python_tests/test_training_state_atomic.py", "-k", "without_state")]),
    # save_pretrained over an earlier sharded save: from_pretrained would read the stale index.
    "save-pretrained-keeps-stale-weights": (
        "python/fsdp_ema/integrations/diffusers_files.py",
        "        if stale_index or DIFFUSERS_SHARD.fullmatch(name):",
        "        if False:",
        [pytest("python_tests/test_integration_diffusers.py", "-k", "earlier_sharded")]),
    # A whole EMA's save_pretrained on the main process only (the scripts' call): no collective.
    "save-pretrained-of-a-whole-ema-collective": (
        "python/fsdp_ema/integrations/diffusers_files.py",
        "    local = whole and not lora",
        "    local = False",
        [pytest("python_tests/test_integration_diffusers.py", "-k", "ddp_save_pretrained")]),
    "export-local-of-a-sharded-ema": (
        "python/fsdp_ema/ema/full.py",
        "        if local and any(p.kind != \"full\" for p in parts):",
        "        if False:",
        [pytest("python_tests/test_integration_diffusers.py", "-k", "round_trips and fsdp2")]),
    # A resumed job's optimizer (no state) gets its template from its parameters: no step.
    "fresh-optimizer-loaded-through-torch": (
        "python/fsdp_ema/store/training_load.py",
        "    if states.optimizer is not None and fresh_optimizer:",
        "    if states.optimizer is not None and False:",
        [pytest("python_tests/test_training_state.py", "-k", "optimizer_without_state")]),
    "fresh-template-from-another-optimizers-state": (
        "python/fsdp_ema/store/training_state_dicts.py",
        '    if not isinstance(saved, Mapping) or saved.get("type") != type(optimizer).__name__:',
        "    if not isinstance(saved, Mapping):",
        [pytest("python_tests/test_training_state.py", "-k", "another_class")]),
    "fresh-template-of-another-dtype-kind": (
        "python/fsdp_ema/store/training_state_dicts.py",
        '            check_dtype_kind(entry["tensor"], dtype, p.dtype)',
        "            pass",
        [pytest("python_tests/test_training_state.py", "-k", "integer_step")]),
    "fresh-template-for-any-saved-names": (
        "python/fsdp_ema/store/training_state_dicts.py",
        "    if set(by_fqn) != set(saved):",
        "    if False:",
        [pytest("python_tests/test_training_state.py", "-k", "optimizer_without_state")]),
    "mapped-guard-ignores-a-one-shot-handler": (
        "format/core/mapped_guard.cpp",
        "    if ((p.sa_flags & SA_RESETHAND) != 0) {",
        "    if (false) {",
        [ctest("MappedGuardDeathTest.AOneShotPreviousHandlerIsResetBeforeItRuns")]),
    "mapped-guard-never-reinstalled": (
        "format/core/mapped_guard.cpp",
        "  if (is_ours(now) || (!first && now.sa_handler != SIG_DFL)) return;",
        "  if (!first) return;",
        [pytest("python_tests/test_mapped_truncation.py", "-k", "faulthandler_disable")]),
    "diffusers-folder-for-another-registered-object": (
        "python/fsdp_ema/integrations/diffusers.py",
        '    return found if found is not None and found.get("obj") is obj else None',
        "    return found",
        [pytest("python_tests/test_integration_diffusers.py", "-k", "fsdp2")]),
    "reader-tied-values-not-compared": (
        "ops/reader/checkpoint_reader.cpp",
        "TORCH_CHECK(first || same_bits(it->second, value),",
        "TORCH_CHECK(true || same_bits(it->second, value),",
        [ctest("NnModuleLoad.TiedWeightsLoadOnceWhenTheCheckpointAgrees")]),
}


def log(msg):
    print(msg, flush=True)


def git(*args, cwd=ROOT, **kw):
    return subprocess.run(["git", "-C", cwd, *args], check=True, text=True, capture_output=True,
                          **kw).stdout


def prepare_tree():
    """TREE = HEAD of ROOT plus ROOT's uncommitted changes and untracked (not ignored) files."""
    head = git("rev-parse", "HEAD").strip()
    os.makedirs(SCRATCH, exist_ok=True)
    if not os.path.isdir(os.path.join(TREE, ".git")) and not os.path.isfile(
            os.path.join(TREE, ".git")):
        shutil.rmtree(TREE, ignore_errors=True)
        git("worktree", "prune")
        git("worktree", "add", "--detach", TREE, head)
    else:
        git("checkout", "--detach", "-f", head, cwd=TREE)
        git("clean", "-fdq", cwd=TREE)  # not -x: the build directory stays
    diff = subprocess.run(["git", "-C", ROOT, "diff", "HEAD", "--binary"], check=True,
                          capture_output=True).stdout
    if diff:
        subprocess.run(["git", "-C", TREE, "apply", "--whitespace=nowarn"], input=diff,
                       check=True)
    untracked = git("ls-files", "--others", "--exclude-standard", "-z").split("\0")
    for rel in filter(None, untracked):
        os.makedirs(os.path.dirname(os.path.join(TREE, rel)) or TREE, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), os.path.join(TREE, rel))
    return head, bool(diff), len([u for u in untracked if u])


def tree_env():
    env = dict(os.environ)
    for key in ("FSDP_EMA_ROOT", "FSDP_EMA_BUILD", "FSDP_EMA_LIBRARY", "CCACHE_BASEDIR",
                "PYTHONPATH"):
        env.pop(key, None)
    env["FSDP_EMA_BUILD"] = BUILD
    env["PYTHONPATH"] = os.path.join(TREE, "python")
    return env


def build():
    out = subprocess.run(["bash", os.path.join(TREE, "scripts", "build.sh")], cwd=TREE,
                         env=tree_env(), capture_output=True, text=True)
    return out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def run_tests(tests):
    """Runs every selection: (the ones that failed, the ones that passed, an output tail)."""
    failed, passed, tail = [], [], ""
    for kind, cmd in tests:
        label = describe(kind, cmd)
        try:
            out = subprocess.run(cmd, cwd=TREE, env=tree_env(), capture_output=True, text=True,
                                 timeout=1800)
        except subprocess.TimeoutExpired:
            failed.append(label + " (timed out)")
            continue
        if out.returncode != 0:
            failed.append(label)
            tail = tail or (out.stdout + out.stderr)[-2000:]
        else:
            passed.append(label)
    return failed, passed, tail


def describe(kind, cmd):
    if kind == "ctest":
        return "ctest -R " + cmd[cmd.index("-R") + 1]
    args = cmd[cmd.index("no:cacheprovider") + 1:]
    return "pytest " + " ".join(repr(a) if " " in a else a for a in args)


def check_sites():
    """Every mutant's old text must be in its file exactly once (scripts/test.sh runs this), so
    that code moved by a refactor can never silently retire a mutant."""
    bad = []
    for name, (path, old, _new, _tests) in MUTANTS.items():
        try:
            with open(os.path.join(ROOT, path)) as f:
                count = f.read().count(old)
        except FileNotFoundError:
            count = "no such file"
        if count != 1:
            bad.append(f"{name}: old text found {count} times in {path}")
    for line in bad:
        print(f"mutants.sh --check: {line}", file=sys.stderr)
    print(f"mutants.sh --check: {len(MUTANTS) - len(bad)} of {len(MUTANTS)} mutant sites found "
          f"exactly once")
    return 1 if bad else 0


def main(argv):
    if argv[:1] == ["--list"]:
        for name, (path, *_rest) in MUTANTS.items():
            print(f"{name:45s} {path}")
        return 0
    if argv[:1] == ["--check"]:
        return check_sites()
    unknown = [a for a in argv if a not in MUTANTS]
    if unknown:
        print(f"mutants.sh: unknown mutant(s) {unknown}; see --list", file=sys.stderr)
        return 2
    names = argv or list(MUTANTS)
    head, dirty, untracked = prepare_tree()
    log(f"== scratch copy {TREE}: HEAD {head[:12]}"
        f"{' + uncommitted changes' if dirty else ''}{f' + {untracked} untracked' if untracked else ''}")
    t0 = time.monotonic()
    ok, output = build()
    if not ok:
        log(output)
        log("mutants.sh: the unmutated copy does not build")
        return 1
    log(f"== built in {time.monotonic() - t0:.0f} s")

    baseline_failed = set()
    if not os.environ.get("FSDP_EMA_MUTANTS_NO_BASELINE"):
        seen = {}
        for name in names:
            for test in MUTANTS[name][3]:
                seen.setdefault(describe(*test), test)
        for label, test in seen.items():
            t = time.monotonic()
            failed, _, output = run_tests([test])
            log(f"   baseline {'FAIL' if failed else 'ok  '} {time.monotonic() - t:6.0f} s  {label}")
            if failed:
                log(output)
                baseline_failed.add(label)

    rows = []
    for name in names:
        path, old, new, tests = MUTANTS[name]
        full = os.path.join(TREE, path)
        t = time.monotonic()
        with open(full) as f:
            original = f.read()
        count = original.count(old)
        if count != 1:
            rows.append((name, path, "ERROR", 0, f"old text found {count} times (code moved?)"))
            log(f"-- {name}: ERROR, old text found {count} times in {path}")
            continue
        if any(describe(*test) in baseline_failed for test in tests):
            rows.append((name, path, "ERROR", 0, "its tests fail without the mutant"))
            continue
        try:
            with open(full, "w") as f:
                f.write(original.replace(old, new))
            built = True
            if not path.endswith(".py"):
                built, output = build()
            if not built:
                result, detail = "ERROR", "does not build"
                log(output)
            else:
                failed, passed, _ = run_tests(tests)
                result = "killed" if failed else "SURVIVED"
                detail = "; ".join(failed) if failed else "every selected test passed"
                if failed and passed:  # a selection that misses it guards another path
                    detail += " (passed: " + "; ".join(passed) + ")"
        finally:
            with open(full, "w") as f:
                f.write(original)
        elapsed = time.monotonic() - t
        rows.append((name, path, result, elapsed, detail))
        log(f"-- {name}: {result} in {elapsed:.0f} s ({detail})")
    if any(not p.endswith(".py") for n in names for p in [MUTANTS[n][0]]):
        build()  # leave the copy built unmutated

    width = max(len(r[0]) for r in rows)
    log("")
    log(f"{'mutant':{width}s}  {'file':32s} {'result':8s} {'time':>6s}  failing tests / why")
    for name, path, result, elapsed, detail in rows:
        log(f"{name:{width}s}  {path:32s} {result:8s} {elapsed:5.0f}s  {detail}")
    killed = sum(r[2] == "killed" for r in rows)
    log(f"\n{killed} of {len(rows)} killed, "
        f"{sum(r[2] == 'SURVIVED' for r in rows)} survived, "
        f"{sum(r[2] == 'ERROR' for r in rows)} error(s); total {time.monotonic() - t0:.0f} s")
    return 0 if killed == len(rows) else 1


sys.exit(main(sys.argv[1:]))
PY
exec nice -n "${FSDP_EMA_MUTANTS_NICE:-10}" "$FSDP_EMA_PYTHON" -c "$program" "$@"
