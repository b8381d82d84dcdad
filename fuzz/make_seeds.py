#!/usr/bin/env python3
"""Writes small valid seed inputs for the fuzz targets into fuzz/corpus/.

The corpus is git-ignored; this script is how it is rebuilt:

    python3 fuzz/make_seeds.py

Seeds are crafted, not cut from real files: a truncated real GGUF or
safetensors file is invalid, and libFuzzer finds deep paths much faster
starting from inputs the parser accepts.
"""

import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")

# GGUF value types.
U32, STRING, ARRAY = 4, 8, 9
# ggml tensor types and their (elements, bytes) per block.
F32, Q8_0 = 0, 8
BLOCKS = {F32: (1, 4), Q8_0: (32, 34)}


def gguf_str(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_kv(key, type_id, value):
    out = gguf_str(key) + struct.pack("<I", type_id)
    if type_id == U32:
        out += struct.pack("<I", value)
    elif type_id == STRING:
        out += gguf_str(value)
    elif type_id == ARRAY:
        elem_type, items = value
        assert elem_type == STRING
        out += struct.pack("<IQ", elem_type, len(items))
        out += b"".join(gguf_str(s) for s in items)
    else:
        raise ValueError(type_id)
    return out


def gguf(kvs, tensors, version=3, alignment=32):
    """kvs: [(key, type, value)]; tensors: [(name, dims, ggml type)]."""
    infos, data = b"", b""
    for name, dims, ty in tensors:
        elems, nbytes = BLOCKS[ty]
        n = 1
        for d in dims:
            n *= d
        assert dims[0] % elems == 0
        data += b"\0" * (-len(data) % alignment)
        offset = len(data)
        # Deterministic, non-zero payload.
        data += bytes((i * 7 + 1) & 0xFF for i in range(n // elems * nbytes))
        infos += gguf_str(name) + struct.pack("<I", len(dims))
        infos += b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", ty, offset)
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    head += b"".join(gguf_kv(*kv) for kv in kvs) + infos
    head += b"\0" * (-len(head) % alignment)
    return head + data


def safetensors(tensors, metadata=None):
    """tensors: [(name, dtype, shape)], laid out back to back."""
    sizes = {"F32": 4, "F16": 2, "BF16": 2}
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(data), len(data) + n],
        }
        data += bytes((i * 13 + 5) & 0xFF for i in range(n))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def ucx_message(kind, body, conn=7):
    """A ucx_wire input: the header's length, the header (kind, connection id), the body."""
    header = struct.pack("<BQ", kind, conn)
    return bytes([len(header)]) + header + body


def write(target, name, content):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(content)


def main():
    kvs = [
        ("general.architecture", STRING, "llama"),
        ("general.alignment", U32, 32),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, ["<s>", "</s>", "a", "b"])),
    ]
    tensors = [("tok_embd.weight", [4, 2], F32), ("blk.0.attn_q.weight", [32, 2], Q8_0)]
    write("gguf", "two_tensors_v3", gguf(kvs, tensors))
    write("gguf", "two_tensors_v2", gguf(kvs, tensors, version=2))
    write("gguf", "metadata_only", gguf(kvs[:1], []))

    write(
        "safetensors",
        "three_tensors",
        safetensors(
            [("a", "F32", [2, 3]), ("b", "BF16", [4]), ("c", "F16", [])],
            metadata={"format": "pt"},
        ),
    )
    write("safetensors", "empty", safetensors([]))

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "rope_scaling": None,
    }
    write("hf_config", "tiny_llama", json.dumps(config, indent=2).encode())

    # ucx_wire: one message of each fixed shape (kinds as in transport/ucx/wire.rs).
    res = struct.pack("<QI", 3, 4)  # reservation id, generation
    write("ucx_wire", "claim", ucx_message(2, res))
    write("ucx_wire", "layer", ucx_message(3, struct.pack("<Q6I", 5, 6, 29, 40, 2, 0xDEADBEEF, 4096)))
    write("ucx_wire", "bye", ucx_message(6, b""))
    write("ucx_wire", "key", ucx_message(7, struct.pack("<Q", 0x7F0012345000) + b"\x01\x02\x03"))
    write("ucx_wire", "grant", ucx_message(8, res + struct.pack("<QI", 1 << 20, 7)))
    write("ucx_wire", "refused", ucx_message(9, res + struct.pack("<H", 1)))
    write("ucx_wire", "pool_key", ucx_message(10, struct.pack("<QI", 0x7F0000001000, 729) + b"\x04\x05"))
    write("ucx_wire", "blocks", ucx_message(12, res + struct.pack("<3I", 3, 700, 12)))


if __name__ == "__main__":
    main()
