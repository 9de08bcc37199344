"""Check a checkpoint's safetensors files before the server loads them — no torch needed.

A truncated or mismatched ``model.safetensors`` used to pass the start-up checks and
crash the engine after "serving" was announced (a 43-line traceback with hf, 233 with
vLLM). ``check_weights(directory)`` reads each ``*.safetensors`` file's header (an
8-byte little-endian length, then JSON: tensor name → dtype, shape, byte offsets) and
refuses, naming the file, the tensor and the fix:

- a header longer than the file, or not JSON of that shape;
- a tensor whose byte range does not fit the file (a truncated copy), or whose size
  is not ``prod(shape) × itemsize`` of its dtype;
- weights that do not fit ``config.json``: the embedding and the LM head must be
  ``[vocab_size, hidden_size]`` and there must be ``num_hidden_layers`` layers.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 100 << 20
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FIX = "re-export or re-copy the checkpoint"


class WeightsError(ValueError):
    """The checkpoint's weights cannot be loaded; the message names the file and what is wrong."""


def read_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensors of one safetensors file (name → dtype, shape, data_offsets), each checked against the file."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise WeightsError(f"{path}: {size} bytes, too short to be a safetensors file; {_FIX}")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise WeightsError(f"{path}: header says {length} bytes but the file has {size}: truncated or not "
                               f"safetensors; {_FIX}")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WeightsError(f"{path}: the safetensors header is not JSON ({exc}); {_FIX}") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: the safetensors header is not a JSON object; {_FIX}")
    data_bytes = size - 8 - length
    tensors = {name: info for name, info in header.items() if name != "__metadata__"}
    for name, info in tensors.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
            itemsize = _ITEMSIZE[dtype]
        except (KeyError, TypeError, ValueError):
            raise WeightsError(f"{path}: tensor {name!r} has a malformed header entry; {_FIX}") from None
        if not 0 <= begin <= end <= data_bytes:
            raise WeightsError(f"{path}: tensor {name!r} needs bytes {begin}..{end} but the file holds {data_bytes} "
                               f"bytes of data: the file is truncated; {_FIX}")
        if end - begin != math.prod(shape) * itemsize:
            raise WeightsError(f"{path}: tensor {name!r} ({dtype}, shape {shape}) takes {end - begin} bytes instead "
                               f"of {math.prod(shape) * itemsize}; {_FIX}")
    return tensors


def check_weights(directory: str | Path) -> None:
    """Refuse (``WeightsError``) a checkpoint whose safetensors files are damaged or do not fit config.json."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{directory}: no *.safetensors file; the checkpoint needs its weights (model.safetensors)")
    shapes = {name: [int(d) for d in info["shape"]] for path in files for name, info in read_header(path).items()}
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{directory / 'config.json'}: cannot be read as JSON ({exc})") from None
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    vocab, hidden, layers = config.get("vocab_size"), config.get("hidden_size"), config.get("num_hidden_layers")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in shapes and vocab and hidden and shapes[name] != [vocab, hidden]:
            raise WeightsError(f"{directory}: {name} has shape {shapes[name]} but config.json says "
                               f"[vocab_size, hidden_size] = [{vocab}, {hidden}]; the weights and config.json "
                               "are from different models")
    found = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    if layers and found and found != set(range(layers)):
        raise WeightsError(f"{directory}: the weights hold {len(found)} layers but config.json says "
                           f"num_hidden_layers = {layers}; the weights and config.json are from different models")
