"""Codec benchmark: our msgpack codec against plain msgpack, pickle and JSON+base64.

Two payloads, as the protocol issue specifies:
  (a) a state observation: 39 float32 + a task name;
  (b) two 224x224x3 uint8 images plus the state.
For each codec: encode, decode and round-trip time (median of repeated timed
loops), and decode throughput in GB/s of frame bytes. "plain msgpack" packs the
same dict with the arrays as raw bytes and no validation: the floor our codec
adds to. "json+base64" is the json_numpy route.

    .venv/bin/python bench/protocol_codec.py [--quick]
"""

from __future__ import annotations

import argparse
import base64
import json
import pickle
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.protocol.codec import packb, unpackb  # noqa: E402


def _payloads() -> dict[str, dict]:
    rng = np.random.default_rng(0)
    state = rng.standard_normal(39).astype(np.float32)
    images = {name: rng.integers(0, 255, (224, 224, 3), dtype=np.uint8) for name in ("top", "wrist")}
    return {
        "(a) state obs": {"state": state, "task": "reach-v3"},
        "(b) 2 images + state": {"state": state, "task": "reach-v3", "images": images},
    }


def _raw(obj):
    if isinstance(obj, np.ndarray):
        return obj.tobytes()
    if isinstance(obj, dict):
        return {k: _raw(v) for k, v in obj.items()}
    return obj


def _json_default(obj):
    if isinstance(obj, np.ndarray):
        return {"__numpy__": base64.b64encode(obj.tobytes()).decode(), "dtype": obj.dtype.str, "shape": obj.shape}
    raise TypeError


def _json_hook(obj):
    if "__numpy__" in obj:
        return np.frombuffer(base64.b64decode(obj["__numpy__"]), dtype=obj["dtype"]).reshape(obj["shape"])
    return obj


CODECS: dict[str, tuple[Callable, Callable, bool]] = {
    # name: (encode, decode, encode the raw-bytes variant of the payload)
    "evalforge": (packb, unpackb, False),
    "plain msgpack (raw bytes)": (lambda o: msgpack.packb(o, use_bin_type=True), lambda b: msgpack.unpackb(b, raw=False), True),
    "pickle": (lambda o: pickle.dumps(o, protocol=5), pickle.loads, False),
    "json+base64": (lambda o: json.dumps(o, default=_json_default).encode(), lambda b: json.loads(b, object_hook=_json_hook), False),
}


def _time(fn: Callable[[], object], budget_s: float) -> float:
    """Median seconds per call over timed loops that fill ``budget_s``."""
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.05:
        fn()
        n += 1
    per_loop = max(n, 1)
    samples = []
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline or len(samples) < 5:
        t0 = time.perf_counter()
        for _ in range(per_loop):
            fn()
        samples.append((time.perf_counter() - t0) / per_loop)
    return statistics.median(samples)


def run(budget_s: float) -> list[dict]:
    rows = []
    for payload_name, payload in _payloads().items():
        for codec_name, (encode, decode, raw) in CODECS.items():
            obj = _raw(payload) if raw else payload
            frame = encode(obj)
            enc = _time(lambda: encode(obj), budget_s)  # noqa: B023
            dec = _time(lambda: decode(frame), budget_s)  # noqa: B023
            rt = _time(lambda: decode(encode(obj)), budget_s)  # noqa: B023
            rows.append({"payload": payload_name, "codec": codec_name, "bytes": len(frame), "encode_us": enc * 1e6,
                         "decode_us": dec * 1e6, "roundtrip_us": rt * 1e6, "decode_GBps": len(frame) / dec / 1e9})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short timing loops (smoke run)")
    args = parser.parse_args()
    rows = run(0.05 if args.quick else 0.5)
    print(f"# protocol codec — {platform.processor() or platform.machine()}, {platform.python_version()}, "
          f"msgpack {'.'.join(map(str, msgpack.version))}, numpy {np.__version__}")
    print("| payload | codec | frame bytes | encode µs | decode µs | round trip µs | decode GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['payload']} | {r['codec']} | {r['bytes']} | {r['encode_us']:.2f} | {r['decode_us']:.2f} | "
              f"{r['roundtrip_us']:.2f} | {r['decode_GBps']:.2f} |")
    by = {(r["payload"], r["codec"]): r for r in rows}
    a, b = "(a) state obs", "(b) 2 images + state"
    ratio_a = by[a, "evalforge"]["roundtrip_us"] / by[a, "plain msgpack (raw bytes)"]["roundtrip_us"]
    gbps_b = by[b, "evalforge"]["decode_GBps"]
    vs_json = by[b, "json+base64"]["roundtrip_us"] / by[b, "evalforge"]["roundtrip_us"]
    print()
    print("| target | measured | met |")
    print("|---|---:|:-:|")
    print(f"| (a) round trip ≤ 2× plain msgpack | {ratio_a:.2f}× | {'yes' if ratio_a <= 2 else 'NO'} |")
    print(f"| (b) decode ≥ 10 GB/s | {gbps_b:.1f} GB/s | {'yes' if gbps_b >= 10 else 'NO'} |")
    print(f"| (b) round trip ≥ 20× faster than json+base64 | {vs_json:.0f}× | {'yes' if vs_json >= 20 else 'NO'} |")


if __name__ == "__main__":
    main()
