"""`/model`, the SDK's voice management, beyond the SDK's own calls (those are in test_sdk.py), and the body limits of
the routes that take voice files. PROTOCOL.md §6.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import ormsgpack
from conftest import MAX_MESSAGE
from liveserver import LiveServer


def test_model_routes_refuse_bad_requests_cleanly(srv: LiveServer, ref_wav: bytes) -> None:
    """/model (the SDK's voice management) beyond the SDK's own calls: msgpack bodies carry the voice files as bytes,
    JSON cannot (a clear 422); bad paging, unknown ids, oversized files and malformed bodies get their JSON error and
    store nothing."""
    with httpx.Client(base_url=srv.http, timeout=30) as h:
        before = h.get("/model", params={"page_size": 100}).json()["total"]
        body = ormsgpack.packb({"title": "Packed", "type": "tts", "train_mode": "fast", "voices": [ref_wav],
                                "texts": ["The quick brown fox."], "tags": "single", "visibility": "public"})
        r = h.post("/model", content=body, headers={"content-type": "application/msgpack"})
        assert r.status_code == 201, r.text
        made = r.json()
        assert made["title"] == "Packed" and made["tags"] == ["single"] and made["visibility"] == "public"
        refused = [
            (h.post("/model", json={"title": "J", "voices": ["UklGRg=="], "texts": ["x"]}), 422, "file"),
            (h.post("/model", content=b"\xc1", headers={"content-type": "application/msgpack"}), 400, "body"),
            (h.post("/model", json=[1, 2]), 422, "map"),
            (h.post("/model", files={"voices": ("a.wav", ref_wav)}, data={"texts": "x"}), 422, "title"),
            (h.post("/model", files={"voices": ("a.wav", ref_wav)}, data={"title": "T", "type": "svc", "texts": "x"}),
             422, "tts"),
            (h.post("/model", files={"voices": ("a.wav", b"not audio")}, data={"title": "T", "texts": "x"}), 422, ""),
            (h.post("/model", files={"voices": ("a.wav", b"\0" * (srv.rt.config.limits.max_reference_bytes + 1))},
                    data={"title": "T", "texts": "x"}), 413, "bytes"),
            (h.get("/model", params={"page_size": 0}), 422, "page_size"),
            (h.get("/model", params={"page_number": "two"}), 422, "integers"),
            (h.get("/model/nobody"), 404, "nobody"),
            (h.patch("/model/nobody", data={"title": "x"}), 404, "nobody"),
            (h.patch(f"/model/{made['_id']}", data={"visibility": "everyone"}), 422, "visibility"),
            (h.delete("/model/nobody"), 404, "nobody"),
        ]
        for r, status, words in refused:
            assert r.status_code == status, (r.request.method, r.request.url, r.text)
            assert r.json()["status"] == status and words in r.json()["message"], r.text
        assert h.get("/model", params={"page_size": 100}).json()["total"] == before + 1  # only the good one
        r = h.patch(f"/model/{made['_id']}", json={"description": "Edited", "tags": ["a", "b"]})
        assert r.status_code == 200 and r.json() == {"status": 200, "message": "ok"}
        got = h.get(f"/model/{made['_id']}").json()
        assert (got["description"], got["tags"], got["title"]) == ("Edited", ["a", "b"], "Packed")  # title kept
        assert h.patch(f"/model/{made['_id']}", json={"tags": []}).status_code == 200  # an empty list clears them
        assert h.get(f"/model/{made['_id']}").json()["tags"] == []
        r = h.patch(f"/model/{made['_id']}", json={"title": "  "})
        assert r.status_code == 422 and "blank" in r.json()["message"]
        assert len(h.get("/model", params={"page_size": 500}).json()["items"]) <= 100  # served, capped
        assert h.delete(f"/model/{made['_id']}").status_code == 200


def test_form_and_body_limits_hold_for_chunked_and_nested_bodies(srv: LiveServer, ref_wav: bytes) -> None:
    """A form body without Content-Length (chunked) is cut off at the route's limit while it streams in, not parsed
    whole first (Starlette's parser alone takes any size, spooling files to disk); deeply nested JSON is a 400, not
    a 500, for /model and /v1/references/*; a delete's body is bounded too."""
    limits = srv.rt.config.limits
    with httpx.Client(base_url=srv.http, timeout=60) as h:
        before = h.get("/model", params={"page_size": 100}).json()["total"]
        big = b"\0" * limits.max_reference_bytes
        for path, files, data in (
            ("/model", [("voices", ("a.wav", big))] * (limits.max_references + 3), {"title": "T"}),
            ("/v1/references/add", [("audio", ("a.wav", big + big + big))], {"id": "chunky", "text": "x"}),
        ):
            built = h.build_request("POST", path, files=files, data=data)

            def body(raw: bytes = built.read()) -> Iterator[bytes]:
                for i in range(0, len(raw), 1 << 18):
                    yield raw[i:i + (1 << 18)]

            r = h.post(path, content=body(), headers={"content-type": built.headers["content-type"]})
            assert r.status_code == 413 and r.json()["status"] == 413, (path, r.text)
        for method, path in (("POST", "/model"), ("POST", "/v1/references/add"), ("PATCH", f"/model/{'x' * 8}"),
                             ("DELETE", "/v1/references/delete")):
            r = h.request(method, path, content=b"[" * 100_000, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["status"] == 400, (path, r.text)
        r = h.request("DELETE", "/v1/references/delete", content=b" " * (MAX_MESSAGE + 1),
                      headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["status"] == 413
        assert h.get("/model", params={"page_size": 100}).json()["total"] == before  # nothing stored
