"""Codec benchmark: our pure-Python msgpack codec against openpi-client's own, side by side.

Three payloads:
  (a) a state observation: 39 float32 + a task name;
  (b) a 2-camera observation: two 224x224x3 uint8 images (``corner``, ``gripper``) plus the state;
  (c) (b) as a whole infer request through the message layer too: ours is ``InferRequest.to_wire``
      (its client-side image checks) + ``packb``, then ``unpackb`` + ``parse_request`` holding the
      images to the policy's cameras (``Observation.check_images``), as client and server do;
      openpi-client's codec encodes and decodes the same request dict (it has no message layer).
Codecs: ``evalforge`` (``services.protocol.codec``, every check of the protocol on),
``openpi-client`` (``openpi_client.msgpack_numpy`` from PyPI, the codec openpi's clients and
servers use; its frames are byte-identical to ours), "plain msgpack" (the arrays as raw bytes, no
NumPy and no checks: the floor both add to), pickle, and json+base64 (the json_numpy route).

Every codec's timing loops are interleaved round by round, so a change in machine load hits all
of them alike; each cell is the median over the rounds of the per-call time of one loop. The
second table is the head-to-head: openpi-client's time divided by ours (above 1: ours is faster).

    .venv/bin/python bench/protocol_codec.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pickle
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
from openpi_client import msgpack_numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.protocol.codec import packb, unpackb  # noqa: E402
from services.protocol.messages import InferRequest, Observation, parse_request  # noqa: E402

OURS, OPENPI = "evalforge", "openpi-client"
OURS_MESSAGES = "evalforge + messages"
CAMERAS = {"corner": (224, 224), "gripper": (224, 224)}


def _payloads() -> dict[str, dict]:
    rng = np.random.default_rng(0)
    state = rng.standard_normal(39).astype(np.float32)
    images = {name: rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for name, (h, w) in CAMERAS.items()}
    return {
        "(a) state obs": {"state": state, "task": "reach-v3"},
        "(b) 2 cameras 224² + state": {"state": state, "task": "reach-v3", "images": images},
    }


REQUEST_PAYLOAD = "(c) infer request, 2 cameras 224²"


def _request_codecs() -> tuple[dict[str, tuple[Callable, Callable]], InferRequest]:
    """(c): our message layer + codec, and openpi-client's codec on the same request dict."""
    obs = _payloads()["(b) 2 cameras 224² + state"]
    request = InferRequest(1, Observation(obs["state"], obs["task"], obs["images"]), episode_id="e", step=3)
    return {
        OURS_MESSAGES: (lambda r: packb(r.to_wire()), lambda f: parse_request(unpackb(f), CAMERAS)),
        OPENPI: (lambda r: msgpack_numpy.packb(r.to_wire()), msgpack_numpy.unpackb),
    }, request


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
    OURS: (packb, unpackb, False),
    OPENPI: (msgpack_numpy.packb, msgpack_numpy.unpackb, False),
    "plain msgpack (raw bytes)": (lambda o: msgpack.packb(o, use_bin_type=True), lambda b: msgpack.unpackb(b, raw=False), True),
    "pickle": (lambda o: pickle.dumps(o, protocol=5), pickle.loads, False),
    "json+base64": (lambda o: json.dumps(o, default=_json_default).encode(), lambda b: json.loads(b, object_hook=_json_hook), False),
}


def _calls_per_loop(fn: Callable[[], object], loop_s: float) -> int:
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < loop_s:
        fn()
        n += 1
    return max(n, 1)


def _interleaved(fns: dict[str, Callable[[], object]], rounds: int, loop_s: float) -> dict[str, float]:
    """Median seconds per call of each function, their timing loops taking turns round by round."""
    per_loop = {name: _calls_per_loop(fn, loop_s) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate who goes first
            fn, n = fns[name], per_loop[name]
            start = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - start) / n)
    return {name: statistics.median(values) for name, values in samples.items()}


def run(rounds: int, loop_s: float) -> list[dict]:
    rows = []
    for payload_name, payload in _payloads().items():
        frames, fns = {}, {}
        for codec_name, (encode, decode, raw) in CODECS.items():
            obj = _raw(payload) if raw else payload
            frame = frames[codec_name] = encode(obj)
            fns[codec_name, "encode"] = lambda e=encode, o=obj: e(o)
            fns[codec_name, "decode"] = lambda d=decode, f=frame: d(f)
            fns[codec_name, "roundtrip"] = lambda e=encode, d=decode, o=obj: d(e(o))
        assert frames[OURS] == frames[OPENPI], "our frames and openpi-client's differ"
        times = _interleaved(fns, rounds, loop_s)
        for codec_name in CODECS:
            size = len(frames[codec_name])
            rows.append({"payload": payload_name, "codec": codec_name, "bytes": size,
                         "encode_us": times[codec_name, "encode"] * 1e6, "decode_us": times[codec_name, "decode"] * 1e6,
                         "roundtrip_us": times[codec_name, "roundtrip"] * 1e6,
                         "decode_GBps": size / times[codec_name, "decode"] / 1e9})
    codecs, request = _request_codecs()
    fns, frames = {}, {}
    for codec_name, (encode, decode) in codecs.items():
        frame = frames[codec_name] = encode(request)
        fns[codec_name, "encode"] = lambda e=encode: e(request)
        fns[codec_name, "decode"] = lambda d=decode, f=frame: d(f)
        fns[codec_name, "roundtrip"] = lambda e=encode, d=decode: d(e(request))
    assert frames[OURS_MESSAGES] == frames[OPENPI], "our request frame and openpi-client's differ"
    times = _interleaved(fns, rounds, loop_s)
    for codec_name in codecs:
        size = len(frames[codec_name])
        rows.append({"payload": REQUEST_PAYLOAD, "codec": codec_name, "bytes": size,
                     "encode_us": times[codec_name, "encode"] * 1e6, "decode_us": times[codec_name, "decode"] * 1e6,
                     "roundtrip_us": times[codec_name, "roundtrip"] * 1e6,
                     "decode_GBps": size / times[codec_name, "decode"] / 1e9})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few, short timing loops (smoke run)")
    parser.add_argument("--rounds", type=int, default=25, help="timing rounds per cell (default 25)")
    args = parser.parse_args()
    rounds, loop_s = (5, 0.005) if args.quick else (args.rounds, 0.02)
    rows = run(rounds, loop_s)
    from importlib.metadata import version

    print(f"# protocol codec — {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"msgpack {'.'.join(map(str, msgpack.version))}, numpy {np.__version__}, "
          f"openpi-client {version('openpi-client')}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"median of {rounds} interleaved rounds")
    print("| payload | codec | frame bytes | encode µs | decode µs | round trip µs | decode GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['payload']} | {r['codec']} | {r['bytes']} | {r['encode_us']:.2f} | {r['decode_us']:.2f} | "
              f"{r['roundtrip_us']:.2f} | {r['decode_GBps']:.2f} |")
    by = {(r["payload"], r["codec"]): r for r in rows}
    payloads = list(_payloads())
    print()
    print(f"| payload | {OPENPI} ÷ ours: encode | decode | round trip | faster on all three |")
    print("|---|---:|---:|---:|:-:|")
    for payload, ours_name in [*((p, OURS) for p in payloads), (REQUEST_PAYLOAD, OURS_MESSAGES)]:
        ours, theirs = by[payload, ours_name], by[payload, OPENPI]
        ratios = [theirs[k] / ours[k] for k in ("encode_us", "decode_us", "roundtrip_us")]
        print(f"| {payload} ({ours_name}) | {ratios[0]:.2f}× | {ratios[1]:.2f}× | {ratios[2]:.2f}× | "
              f"{'yes' if min(ratios) > 1 else 'NO'} |")
    a, b = payloads
    ratio_a = by[a, OURS]["roundtrip_us"] / by[a, "plain msgpack (raw bytes)"]["roundtrip_us"]
    gbps_b = by[b, OURS]["decode_GBps"]
    vs_json = by[b, "json+base64"]["roundtrip_us"] / by[b, OURS]["roundtrip_us"]
    print()
    print("| target | measured | met |")
    print("|---|---:|:-:|")
    print(f"| (a) round trip ≤ 2× plain msgpack | {ratio_a:.2f}× | {'yes' if ratio_a <= 2 else 'NO'} |")
    print(f"| (b) decode ≥ 10 GB/s | {gbps_b:.1f} GB/s | {'yes' if gbps_b >= 10 else 'NO'} |")
    print(f"| (b) round trip ≥ 20× faster than json+base64 | {vs_json:.0f}× | {'yes' if vs_json >= 20 else 'NO'} |")


if __name__ == "__main__":
    main()
