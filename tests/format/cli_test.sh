#!/usr/bin/env bash
# CLI tests for fsdp-ema: exit codes and output of inspect / verify / export on fixtures,
# including verify failing on a corrupted copy.
#   cli_test.sh FSDP_EMA MAKE_FIXTURE DATA_DIR WORK_DIR
set -u
CLI=$1 MAKE_FIXTURE=$2 DATA=$3 WORK=$4
rm -rf "$WORK" && mkdir -p "$WORK"
failures=0

# expect RC PATTERN... -- CMD...: runs CMD, checks its exit status and that its combined output
# matches every (grep -E) pattern.
expect() {
  local want_rc=$1; shift
  local patterns=()
  while [[ $1 != -- ]]; do patterns+=("$1"); shift; done
  shift
  local out rc
  out=$("$@" 2>&1); rc=$?
  if [[ $rc -ne $want_rc ]]; then
    echo "FAILED: '$*' exited $rc, expected $want_rc"; echo "$out" | sed 's/^/    /'
    failures=$((failures + 1)); return
  fi
  for p in "${patterns[@]}"; do
    if ! grep -Eq -- "$p" <<<"$out"; then
      echo "FAILED: '$*' output lacks /$p/"; echo "$out" | sed 's/^/    /'
      failures=$((failures + 1)); return
    fi
  done
  echo "ok: $*"
}

# Flips the lowest bit of the last byte of a file (tensor data: files end with data).
flip_last_byte() {
  local f=$1 size byte
  size=$(stat -c %s "$f")
  byte=$(tail -c 1 "$f" | od -An -tu1 | tr -d ' ')
  printf "$(printf '\\%03o' $((byte ^ 1)))" | dd of="$f" bs=1 seek=$((size - 1)) conv=notrunc status=none
}

"$MAKE_FIXTURE" "$WORK/ckpt" 3 || { echo "FAILED: make_fixture"; exit 1; }

expect 0 '^fsdp-ema [0-9]+\.[0-9]+\.[0-9]+ \(checkpoint format version 1\)' -- "$CLI" --version
expect 0 'inspect' 'verify' 'export' -- "$CLI" --help
expect 0 '--dtype' '--max-file-size' -- "$CLI" export --help
expect 2 'A subcommand is required|subcommand' -- "$CLI"
expect 2 'DIR' -- "$CLI" inspect
expect 2 'Directory does not exist' -- "$CLI" inspect "$WORK/nope"

expect 0 'format: +fsdp_ema' 'world size: +3' 'layer\.weight +F32 +\[7, 5\] +140 +3' \
  'step +I64 +\[\] +8 +1' 'total: 12 tensors, 721 bytes' -- "$CLI" inspect "$WORK/ckpt"
expect 0 '^OK: 12 tensors, 28 pieces' '28 checksums verified' -- "$CLI" verify "$WORK/ckpt"

cp -r "$WORK/ckpt" "$WORK/corrupt"
flip_last_byte "$WORK/corrupt/shard-00001-of-00003.safetensors"
expect 1 'FAIL: .*shard-00001-of-00003\.safetensors: tensor .*checksum mismatch' \
  'verify: 1 failure' -- "$CLI" verify "$WORK/corrupt"
expect 1 'checksum mismatch' -- "$CLI" export "$WORK/corrupt" "$WORK/corrupt_export" -q

cp -r "$WORK/ckpt" "$WORK/noindex"
rm "$WORK/noindex/fsdp_ema.index.json"
expect 1 'FAIL: .*incomplete checkpoint: fsdp_ema.index.json missing' -- "$CLI" verify "$WORK/noindex"
expect 1 'error: .*incomplete checkpoint' -- "$CLI" inspect "$WORK/noindex"

cp -r "$WORK/ckpt" "$WORK/stray"
cp "$WORK/ckpt/shard-00000-of-00003.safetensors" "$WORK/stray/old-shard.safetensors"
expect 0 'WARNING: .*old-shard\.safetensors: not listed in the index' -- "$CLI" verify "$WORK/stray"
expect 1 'FAIL: .*old-shard\.safetensors: not listed in the index' -- "$CLI" verify --strict \
  "$WORK/stray"

cp -r "$WORK/ckpt" "$WORK/truncated"
truncate -s -5 "$WORK/truncated/shard-00002-of-00003.safetensors"
expect 1 'FAIL: .*shard-00002-of-00003\.safetensors.*truncated' -- "$CLI" verify "$WORK/truncated"

expect 0 'exported 721 ' 'model\.safetensors' -- "$CLI" export "$WORK/ckpt" "$WORK/out1"
expect 0 'OK: 12 tensors' -- "$CLI" verify "$WORK/out1"
expect 1 'already holds model' -- "$CLI" export "$WORK/ckpt" "$WORK/out1"
expect 0 'model-00001-of-0000[0-9]\.safetensors' 'model\.safetensors\.index\.json' \
  -- "$CLI" export "$WORK/ckpt" "$WORK/out2" --dtype bf16 --max-file-size 200B
[[ -f "$WORK/out2/model.safetensors.index.json" ]] || { echo "FAILED: no HF index"; failures=$((failures + 1)); }
expect 0 'layer\.weight +BF16 +\[7, 5\] +70 ' 'ids +I32 +\[10\] +40 ' -- "$CLI" inspect "$WORK/out2"
expect 0 '' -- "$CLI" export "$WORK/ckpt" "$WORK/out2" --overwrite --quiet
[[ $(ls "$WORK/out2") == model.safetensors ]] || { echo "FAILED: stale export files left"; failures=$((failures + 1)); }
expect 2 'must be f64, f32, f16, bf16' -- "$CLI" export "$WORK/ckpt" "$WORK/out3" --dtype int8
expect 2 'max-file-size' -- "$CLI" export "$WORK/ckpt" "$WORK/out3" --max-file-size lots

# Training-state checkpoints (tests/format/make_training_state_fixture.py): --what selects the
# "ema." or "model." tensors and strips the prefix; the optimizer state and metadata stay out.
TS="$DATA/training_state"
expect 0 'exported 60 ' -- "$CLI" export --what ema "$TS" "$WORK/ts_ema"
expect 0 '^weight +F32 +\[3, 4\] +48 ' '^bias +F32 +\[3\] +12 ' 'total: 2 tensors, 60 bytes' \
  -- "$CLI" inspect "$WORK/ts_ema"
expect 0 'exported 30 ' -- "$CLI" export --what model --dtype bf16 "$TS" "$WORK/ts_model"
expect 0 '^weight +BF16 +\[3, 4\] +24 ' 'total: 2 tensors, 30 bytes' -- "$CLI" inspect "$WORK/ts_model"
if "$CLI" inspect "$WORK/ts_ema" | grep -Eq '(ema|model|optim|meta)\.'; then
  echo "FAILED: --what left prefixed or unselected tensors"; failures=$((failures + 1))
fi
expect 0 'exported 1,?117 ' -- "$CLI" export --what all "$TS" "$WORK/ts_all"
# Without --what a training state exports its EMA, names without the prefix; the small export
# prints no progress (only work that takes a while does), just the summary.
expect 0 'training-state checkpoint: exporting its EMA' 'exported 60 ' \
  -- "$CLI" export "$TS" "$WORK/ts_default"
expect 0 '^weight +F32 +\[3, 4\] +48 ' 'total: 2 tensors, 60 bytes' -- "$CLI" inspect "$WORK/ts_default"
if "$CLI" export "$TS" "$WORK/ts_default2" 2>&1 >/dev/null | grep -q .; then
  echo "FAILED: a small export printed progress on stderr"; failures=$((failures + 1))
else
  echo "ok: a small export prints no progress"
fi
expect 1 'no tensor name starts with "ema\."' -- "$CLI" export --what ema "$WORK/ckpt" "$WORK/ts_none"
expect 2 'opt not in' -- "$CLI" export --what opt "$TS" "$WORK/ts_bad"

expect 0 'DCP HuggingFace' 'world size: +4' 'layer\.weight +F32 +\[7, 5\] +140 +4' \
  -- "$CLI" inspect "$DATA/dcp_hf_sharded"
expect 0 '^OK: 8 tensors, 22 pieces' 'DCP files carry no checksums' -- "$CLI" verify "$DATA/dcp_hf_sharded"

# Every command reads under the checkpoint's shared directory lock (fsdp_ema/format/layout.h):
# while another process holds it exclusively (what a commit or a removal does), the CLI waits,
# and reads once it is released; a shared holder (a rank writing its shard file) does not block it.
if command -v flock >/dev/null; then
  rm -f "$WORK/lock_holder"
  flock -o -x "$WORK/ckpt" bash -c 'echo $$ > "$0"; exec sleep 60' "$WORK/lock_holder" &
  locker=$!
  for _ in $(seq 100); do [[ -s "$WORK/lock_holder" ]] && break; sleep 0.1; done
  "$CLI" verify "$WORK/ckpt" > "$WORK/locked_verify.out" 2>&1 &
  reader=$!
  sleep 1.5
  if ! kill -0 "$reader" 2>/dev/null; then
    echo "FAILED: verify finished while the directory was locked exclusively"
    failures=$((failures + 1))
  else
    echo "ok: verify waits for an exclusive holder of the directory lock"
  fi
  kill "$locker" "$(cat "$WORK/lock_holder")" 2>/dev/null
  wait "$locker" 2>/dev/null
  if wait "$reader" && grep -q '^OK: 12 tensors' "$WORK/locked_verify.out"; then
    echo "ok: verify reads once the exclusive lock is released"
  else
    echo "FAILED: verify after the lock was released"; sed 's/^/    /' "$WORK/locked_verify.out"
    failures=$((failures + 1))
  fi
  rm -f "$WORK/lock_holder"
  flock -o -s "$WORK/ckpt" bash -c 'echo $$ > "$0"; exec sleep 60' "$WORK/lock_holder" &
  locker=$!
  for _ in $(seq 100); do [[ -s "$WORK/lock_holder" ]] && break; sleep 0.1; done
  expect 0 '^OK: 12 tensors' -- timeout 30 "$CLI" verify "$WORK/ckpt"
  expect 0 'total: 12 tensors' -- timeout 30 "$CLI" inspect "$WORK/ckpt"
  kill "$locker" "$(cat "$WORK/lock_holder")" 2>/dev/null
  wait "$locker" 2>/dev/null
else
  echo "FAILED: flock(1) (util-linux) is needed for the directory-lock checks"
  failures=$((failures + 1))
fi

if [[ $failures -ne 0 ]]; then
  echo "$failures CLI check(s) failed"; exit 1
fi
echo "all CLI checks passed"
