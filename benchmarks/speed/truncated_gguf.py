"""A draft model cut from a GGUF decoder: its first N layers, with its own embeddings, final norm and
head (an early exit, as self-speculative decoding drafts with), written as a GGUF of the same
tokenizer. For benchmarks of --speculative draft:MODEL where no smaller model of the tokenizer is at hand.

    python benchmarks/speed/truncated_gguf.py MODEL.gguf OUT.gguf --layers 10
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path


def truncate(source: Path, target: Path, layers: int) -> Path:
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = layers if name == f"{arch}.block_count" else field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, kind, sub_type=sub)
    block = re.compile(r"blk\.(\d+)\.")
    for tensor in reader.tensors:
        found = block.match(tensor.name)
        if found and int(found.group(1)) >= layers:
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--layers", type=int, required=True)
    args = parser.parse_args()
    print(truncate(args.source, args.target, args.layers))


if __name__ == "__main__":
    main()
