"""HAProxy's error page in the OpenAI shape (deployments/haproxy_errors.py): a whole, valid HTTP
response, and it replaces only Ray's own file where Ray put it."""

from __future__ import annotations

import json
from pathlib import Path

from deployments import haproxy_errors as he

RAY_PAGE = (
    b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\nContent-Length: 21\r\n\r\n"
    b"Internal Server Error"
)


def _parse(raw: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = head.decode("ascii").split("\r\n")
    return status, {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines)}, body


def test_the_page_is_a_503_with_retry_after_and_an_openai_error() -> None:
    status, headers, body = _parse(he.error_response())
    assert status == "HTTP/1.1 503 Service Unavailable"
    assert headers["content-type"] == "application/json"
    assert headers["retry-after"] == "1"
    assert int(headers["content-length"]) == len(body)
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "gateway_unavailable" and err["type"] == "overloaded_error"
    assert len(he.error_response()) < 16384  # HAProxy's buffer (tune.bufsize): a page must fit


def test_install_replaces_rays_page_where_ray_put_it(tmp_path: Path) -> None:
    loc = str(tmp_path / "hap" / "haproxy.cfg")
    page = tmp_path / "hap" / "node-1" / "500.http"
    page.parent.mkdir(parents=True)
    page.write_bytes(RAY_PAGE)
    assert he.error_file_path("node-1", loc) == page
    assert he.install("node-1", loc) is he.Installed.REPLACED  # HAProxy takes it at a reload
    assert page.read_bytes() == he.error_response()
    assert he.install("node-1", loc) is he.Installed.OURS  # again: nothing to do, no reload
    assert sorted(p.name for p in page.parent.iterdir()) == ["500.http"]  # no temporary left


def test_install_writes_nothing_where_ray_wrote_no_page(tmp_path: Path) -> None:
    loc = str(tmp_path / "hap" / "haproxy.cfg")
    assert he.install("node-1", loc) is he.Installed.ABSENT
    assert not (tmp_path / "hap").exists()
    (tmp_path / "hap" / "node-2").mkdir(parents=True)  # another node's folder, or Ray moved it
    assert he.install("node-1", loc) is he.Installed.ABSENT
    assert list((tmp_path / "hap" / "node-2").iterdir()) == []
