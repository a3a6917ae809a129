# shellcheck shell=bash disable=SC2034  # sourced: the variables set here are gpu_check.sh's
# Sourced by `bash scripts/gpu_check.sh --self-test` (ctest: gpu_check_self_test), never run on
# its own: gpu_check.sh's diagnostics against a fake cuobjdump and a fake build folder, in a few
# seconds, without a GPU, a build or a download. It checks that a diagnostic that cannot run
# (tool missing, failing as cuobjdump -sass does without nvdisasm, hanging, printing nothing, or
# no time left) is one WARNING line on the device and leaves the exit status alone, an ERROR in
# the dry run, that a bad verdict is a FAIL (exit 1), and that the diagnostics always return, so
# the tests and benchmarks after them always run.
st_dir="$(mktemp -d)"
trap 'rm -rf "$st_dir"' EXIT
st_fail=0
mkdir -p "$st_dir/bin" "$st_dir/build"
: >"$st_dir/lib.so"
# ninja -t commands reads build.ninja only: one .cu compiled for sm_90, as CMake writes it.
cat >"$st_dir/build/build.ninja" <<'EOF'
rule nvcc
  command = /usr/local/cuda/bin/nvcc --generate-code=arch=compute_90,code=[sm_90] -c $in -o $out
build update_cuda.cu.o: nvcc update_cuda.cu
build fsdp_ema: phony update_cuda.cu.o
EOF
# The fake cuobjdump prints what the real one prints for our library (names mangled the same way);
# FAKE_MODE picks a failure.
cat >"$st_dir/bin/cuobjdump" <<'EOF'
#!/usr/bin/env bash
mode="${FAKE_MODE:-good}"
ns=_ZN8fsdp_ema7kernels12_GLOBAL__N_1
names=("${ns}13update_kernelILi1EEEvPKNS0_15CudaUpdateEntryIXT_EEEiPKNS0_9CudaDecayE"
       "${ns}13update_kernelILi4EEEvPKNS0_15CudaUpdateEntryIXT_EEEiPKNS0_9CudaDecayE"
       "${ns}19batched_copy_kernelEPKNS0_11CopySegmentEi"
       "_ZN8fsdp_ema7kernels16fill_table_kernelINS0_15CudaUpdateEntryEEEvNS0_9TableFillIT_EE")
case "$1" in
  --list-elf)
    echo "ELF file    1: libfsdp_ema.1.sm_90.cubin"
    echo "ELF file    2: libfsdp_ema.2.sm_90.cubin"
    if [ "$mode" = ptx ]; then echo "PTX file    1: libfsdp_ema.1.sm_90.ptx"; fi ;;
  -res-usage)
    for n in "${names[@]}"; do
      echo " Function $n:"
      echo "  REG:40 STACK:0 SHARED:4 LOCAL:0 CONSTANT[0]:548 TEXTURE:0 SURFACE:0 SAMPLER:0"
    done ;;
  -sass)
    case "$mode" in
      no-nvdisasm)
        echo "cuobjdump fatal   : Could not find executable file 'nvdisasm'; you can try adding" \
             "path to environment variables PATH or NVDISASM_PATH" >&2
        exit 1 ;;
      hang) exec sleep 30 ;;
      empty) exit 0 ;;
    esac
    ld=LDG.E.128.CONSTANT
    if [ "$mode" = narrow ]; then ld=LDG.E.64; fi
    for n in "${names[@]}"; do
      printf '\t\tFunction : %s\n' "$n"
      printf '        /*00c0*/                   %s R8, desc[UR4][R2.64] ;\n' "$ld"
      printf '        /*00d0*/                   LDG.E R9, desc[UR4][R2.64] ;\n'
      printf '        /*00e0*/                   STG.E.128 desc[UR4][R4.64], R8 ;\n'
      printf '        /*00f0*/                   ST.E.128 [R6.64], R8 ;\n'
    done ;;
esac
EOF
chmod +x "$st_dir/bin/cuobjdump"

# scenario NAME DRY FAKE_MODE CUOBJDUMP T_DIAG T_RUN: the diagnostics in a subshell, their summary
# lines in NAME.txt, then "end: status N" (written only if they returned).
scenario() {
  (
    DRY="$2" CUOBJDUMP="$4" T_DIAG="$5" T_RUN="$6"
    export FAKE_MODE="$3"
    BUILD="$st_dir/build" LIB="$st_dir/lib.so" STAGE="$st_dir/stage"
    SUMMARY="$st_dir/$1.txt" LOG="$st_dir/$1.log"
    status=0
    : >"$SUMMARY"
    diagnostics >/dev/null
    echo "end: status $status" >>"$SUMMARY"
  )
}
# expect NAME REGEX...: each REGEX matches a line of NAME's summary.
expect() {
  local name="$1" re
  shift
  for re in "$@"; do
    if ! grep -qE -- "$re" "$st_dir/$name.txt"; then
      echo "gpu_check self-test, $name: no summary line matches '$re'; the summary:"
      sed 's/^/  | /' "$st_dir/$name.txt"
      st_fail=1
    fi
  done
}
# refuse NAME REGEX: no line of NAME's summary matches.
refuse() {
  if grep -qE -- "$2" "$st_dir/$1.txt"; then
    echo "gpu_check self-test, $1: a summary line matches '$2':"
    sed 's/^/  | /' "$st_dir/$1.txt"
    st_fail=1
  fi
}

fake="$st_dir/bin/cuobjdump"
scenario good 0 good "$fake" 20 0
expect good '^   nvcc flags: ran; verdict: PASS: --generate-code=arch=compute_90,code=\[sm_90\]' \
  '^   cubins: ran; verdict: PASS: 2 cubins, all sm_90; no PTX$' \
  '^   registers: ran; verdict: INFO: update_kernelILi1E REG 40 no spills; update_kernelILi4E REG 40' \
  '^   sass: ran; verdict: INFO: 4 functions disassembled, 3 of our 3 kernels among them$' \
  '^   16-byte loads: ran; verdict: PASS: batched_copy_kernel: 1 of 2 LDG 16-byte, 1 of 1 STG' \
  '16-byte, 1 generic LD/ST; update_kernelILi1E: 1 of 2 LDG 16-byte, 1 of 1 STG 16-byte, 1 generic' \
  '^end: status 0$'
refuse good 'WARNING|ERROR|FAIL'

scenario missing 0 good "$st_dir/none/cuobjdump" 20 0
expect missing '^   nvcc flags: ran; verdict: PASS' \
  '^   cubins: WARNING: skipped: .*/none/cuobjdump not found' \
  '^   registers: WARNING: skipped: .*not found' '^   sass: WARNING: skipped: .*not found' \
  '^   16-byte loads: WARNING: skipped: needs the SASS listing' '^end: status 0$'

scenario no_nvdisasm 0 no-nvdisasm "$fake" 20 0
expect no_nvdisasm '^   cubins: ran; verdict: PASS' '^   registers: ran; verdict: INFO' \
  "^   sass: WARNING: skipped: cuobjdump -sass .*lib.so: exit 1: cuobjdump fatal : .*'nvdisasm'" \
  '^   16-byte loads: WARNING: skipped' '^end: status 0$'

scenario hang 0 hang "$fake" 1 0
expect hang '^   sass: WARNING: skipped: cuobjdump -sass .*: timed out after 1 s$' \
  '^   16-byte loads: WARNING: skipped' '^end: status 0$'

scenario empty 0 empty "$fake" 20 0
expect empty '^   sass: WARNING: skipped: .*exit 0 but printed nothing$' '^end: status 0$'

scenario late 0 good "$fake" 20 1
expect late "^   cubins: WARNING: skipped: no time left of the run's 1 s$" \
  '^   sass: WARNING: skipped: no time left' '^end: status 0$'

scenario narrow 0 narrow "$fake" 20 0
expect narrow '^   sass: ran' \
  '^   16-byte loads: ran; verdict: FAIL: no LDG.E.128 in update_kernelILi1E update_kernelILi4E batc' \
  '^end: status 1$'

scenario ptx 0 ptx "$fake" 20 0
expect ptx "^   cubins: ran; verdict: FAIL: cubins 'sm_90' and 1 PTX files; want sm_90 only$" \
  '^   16-byte loads: ran; verdict: PASS' '^end: status 1$'

scenario dry_missing 1 good "$st_dir/none/cuobjdump" 20 0
expect dry_missing '^   cubins: ERROR: did not run: .*not found' '^   sass: ERROR: did not run' \
  '^end: status 1$'
refuse dry_missing 'WARNING'

scenario dry_no_nvdisasm 1 no-nvdisasm "$fake" 20 0
expect dry_no_nvdisasm "^   sass: ERROR: did not run: .*nvdisasm" '^end: status 1$'

if [ $st_fail -eq 0 ]; then
  echo "gpu_check self-test: 10 scenarios passed (missing, failing, hanging and silent tools are" \
       "warnings on the device and errors in the dry run; bad verdicts fail; the run goes on)"
fi
[ $st_fail -eq 0 ]
