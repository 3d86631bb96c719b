#!/usr/bin/env python3
"""The official Fish Audio SDK against a local rtts server: stream a few sentences to a WAV file.

    pip install "fish-audio-sdk>=1.3,<1.4"
    rtts serve &                                     # listens once warmed up: wait for /v1/health
    until curl -sf localhost:8080/v1/health >/dev/null; do sleep 1; done
    python clients/example_sdk.py --out hello.wav
"""

from __future__ import annotations

import argparse

from fishaudio import FishAudio, FlushEvent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", default="http://127.0.0.1:8080")
    p.add_argument("--api-key", default="local")  # the SDK insists on a non-empty key; rtts checks it only if set
    p.add_argument("--reference-id", default=None)
    p.add_argument("--out", default="hello.wav")
    args = p.parse_args()
    client = FishAudio(api_key=args.api_key, base_url=args.base_url)
    pieces = ["Hello there. ", FlushEvent(), "This audio is streamed by rtts, ", "one sentence at a time."]
    audio = b"".join(client.tts.stream_websocket(iter(pieces), format="wav", reference_id=args.reference_id,
                                                 latency="balanced"))
    with open(args.out, "wb") as f:
        f.write(audio)
    print(f"wrote {len(audio)} bytes to {args.out}")


if __name__ == "__main__":
    main()
