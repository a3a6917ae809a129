"""Regenerates the libFuzzer seed corpus in tests/fuzz/corpus/: small valid and near-valid
safetensors files and index files.

    fsdp_ema_format_make_fixture /tmp/fx 2
    python3 tests/fuzz/make_corpus.py /tmp/fx
"""

import json
import os
import shutil
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")
DATA = os.path.join(HERE, "..", "format", "data")


def safetensors(header, data=b"", pad=8):
    text = header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))
    text += " " * ((-(8 + len(text))) % pad)
    return struct.pack("<Q", len(text)) + text.encode() + data


def main():
    fixture = sys.argv[1]
    shutil.rmtree(CORPUS, ignore_errors=True)
    os.makedirs(CORPUS)
    seeds = {}
    # Valid files: ours (both ranks), DCP's, the safetensors package's.
    for name in sorted(os.listdir(fixture)):
        with open(os.path.join(fixture, name), "rb") as f:
            seeds["ours_" + name.replace(".safetensors", "").replace(".", "_")] = f.read()
    dcp_shard = os.path.join(DATA, "dcp_hf_sharded", "shard-00004-model-00001-of-00001.safetensors")
    with open(dcp_shard, "rb") as f:
        seeds["dcp_shard"] = f.read()
    with open(os.path.join(DATA, "python_safetensors.safetensors"), "rb") as f:
        seeds["python_safetensors"] = f.read()

    def t(dt, shape, b, e):
        return {"dtype": dt, "shape": shape, "data_offsets": [b, e]}

    seeds["two_tensors"] = safetensors({"a": t("F32", [2], 0, 8), "b": t("U8", [3], 8, 11)},
                                       bytes(11))
    seeds["empty_header"] = safetensors({})
    seeds["metadata_only"] = safetensors({"__metadata__": {"format": "pt"}})
    sharded = {"__metadata__": {
        "format": "pt", "DCP_VERSION": "1.0",
        "DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [2, 0]}}),
        "fsdp_ema_format_version": "1", "fsdp_ema_rank": "1", "fsdp_ema_world_size": "2",
        "fsdp_ema_global_shapes": json.dumps({"w": [4, 2]}),
        "fsdp_ema_checksums": json.dumps({"w": "xxh3-64:0000000000000000"})},
        "w": t("BF16", [2, 2], 0, 8)}
    seeds["ours_bad_checksum"] = safetensors(sharded, bytes(8), pad=64)
    # Near-valid: each breaks one rule.
    seeds["gap"] = safetensors({"a": t("F32", [2], 0, 8), "b": t("U8", [3], 9, 12)}, bytes(12))
    seeds["overlap"] = safetensors({"a": t("F32", [2], 0, 8), "b": t("U8", [3], 6, 9)}, bytes(9))
    seeds["trailing"] = safetensors({"a": t("F32", [2], 0, 8)}, bytes(10))
    seeds["past_end"] = safetensors({"a": t("F32", [2], 0, 8)}, bytes(4))
    seeds["unknown_dtype"] = safetensors({"a": t("F4", [2], 0, 1)}, bytes(1))
    seeds["duplicate_key"] = safetensors('{"a":' + json.dumps(t("U8", [1], 0, 1)) + ',"a":' +
                                         json.dumps(t("U8", [1], 0, 1)) + "}", bytes(1))
    seeds["huge_length"] = struct.pack("<Q", 1 << 40) + b"{}"
    seeds["truncated"] = seeds["two_tensors"][:20]
    seeds["overflow_shape"] = safetensors({"a": t("F64", [1 << 40, 1 << 30], 0, 8)}, bytes(8))
    # Indices.
    def piece(f, o, s):
        return {"file": f, "offsets": o, "shape": s, "checksum": "xxh3-64:00000000000000ff"}

    index = {"format": "fsdp_ema", "format_version": 1, "world_size": 2, "metadata": {"k": "v"},
             "tensors": {"w": {"dtype": "F32", "shape": [4, 2], "pieces": [
                 piece("shard-00000-of-00002.safetensors", [0, 0], [2, 2]),
                 piece("shard-00001-of-00002.safetensors", [2, 0], [2, 2])]},
                 "s": {"dtype": "I64", "shape": [], "pieces": [
                     piece("shard-00000-of-00002.safetensors", [], [])]}}}
    seeds["index_valid"] = json.dumps(index).encode()
    grid = json.loads(json.dumps(index))
    grid["tensors"]["w"]["pieces"] = [piece("a.safetensors", [0, 0], [2, 1]),
                                      piece("b.safetensors", [0, 1], [2, 1]),
                                      piece("c.safetensors", [2, 0], [2, 2])]
    seeds["index_grid"] = json.dumps(grid).encode()
    bad = json.loads(json.dumps(index))
    bad["tensors"]["w"]["pieces"][1]["file"] = "../x.safetensors"
    seeds["index_traversal"] = json.dumps(bad).encode()
    bad = json.loads(json.dumps(index))
    bad["tensors"]["w"]["pieces"][1]["offsets"] = [1, 0]
    seeds["index_overlap"] = json.dumps(bad).encode()
    # Edge values a serializer may drop or mangle: a zero checksum, escaped names and metadata.
    edge = json.loads(json.dumps(index))
    edge["tensors"]["w"]["pieces"][0]["checksum"] = "xxh3-64:0000000000000000"
    edge["metadata"] = {"": "", "quote\"and\\": "line\nbreak\u00e9\t"}
    edge["tensors"]["n\u00e9\"x"] = edge["tensors"].pop("s")
    seeds["index_edges"] = json.dumps(edge).encode()
    for name, blob in seeds.items():
        with open(os.path.join(CORPUS, name), "wb") as f:
            f.write(blob)
    print(len(seeds), "seeds,", sum(len(b) for b in seeds.values()), "bytes")


if __name__ == "__main__":
    main()
