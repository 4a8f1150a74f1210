"""`kvharbor dashboards push` against a recording fake of Grafana's HTTP API on loopback."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvharbor.observability import cli
from kvharbor.observability.catalog import DASHBOARDS
from kvharbor.observability.dashboards import build_dashboard

TOKEN = "glsa_test_token_123"


class FakeGrafana(ThreadingHTTPServer):
    """Answers the folder and dashboard endpoints; records (method, path, auth, body)."""

    def __init__(self, folders: list[dict]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.folders = folders
        self.requests: list[tuple[str, str, str, object]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _reply(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> object:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.requests.append((self.command, self.path.split("?")[0],
                                     self.headers.get("Authorization", ""), body))
        return body

    def do_GET(self):  # noqa: N802 - http.server naming
        self._record()
        if self.path.startswith("/api/folders"):
            return self._reply(200, self.server.folders)
        self._reply(404, {"message": "not found"})

    def do_POST(self):  # noqa: N802
        body = self._record()
        if self.path == "/api/folders":
            folder = {"uid": "new-folder-uid", "title": body["title"], "id": 7}
            self.server.folders.append(folder)
            return self._reply(200, folder)
        if self.path == "/api/dashboards/db":
            uid = body["dashboard"]["uid"]
            return self._reply(200, {"status": "success", "uid": uid, "version": 1})
        self._reply(404, {"message": "not found"})

    def log_message(self, *args):  # keep test output quiet
        pass


@pytest.fixture
def grafana(request):
    server = FakeGrafana(list(getattr(request, "param", [])))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _dashboard_posts(server: FakeGrafana) -> list[dict]:
    return [body for method, path, _, body in server.requests
            if method == "POST" and path == "/api/dashboards/db"]


def test_push_creates_missing_folder_and_uploads_every_dashboard(grafana, capsys):
    code = cli.main(["dashboards", "push", "--url", grafana.url, "--token", TOKEN,
                     "--folder", "LLM serving"])
    assert code == 0
    assert all(auth == f"Bearer {TOKEN}" for _, _, auth, _ in grafana.requests)
    folder_posts = [b for m, p, _, b in grafana.requests if (m, p) == ("POST", "/api/folders")]
    assert folder_posts == [{"title": "LLM serving"}]
    posts = _dashboard_posts(grafana)
    assert [p["dashboard"]["uid"] for p in posts] == [s.uid for s in DASHBOARDS]
    for post, spec in zip(posts, DASHBOARDS):
        assert post["overwrite"] is True and post["folderUid"] == "new-folder-uid"
        assert post["dashboard"] == build_dashboard(spec)
    assert "pushed" in capsys.readouterr().out


@pytest.mark.parametrize("grafana", [[{"uid": "existing", "title": "kvharbor", "id": 3}]],
                         indirect=True)
def test_push_reuses_an_existing_folder(grafana):
    assert cli.main(["dashboards", "push", "--url", grafana.url, "--token", TOKEN]) == 0
    assert not [1 for m, p, _, _ in grafana.requests if (m, p) == ("POST", "/api/folders")]
    assert {p["folderUid"] for p in _dashboard_posts(grafana)} == {"existing"}
    assert len(_dashboard_posts(grafana)) == len(DASHBOARDS)


def test_push_to_an_unreachable_server_fails_with_a_message(capsys):
    from tests.observability.promql import free_port

    url = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["dashboards", "push", "--url", url, "--token", TOKEN,
                     "--timeout", "2"]) == 1
    assert "find or create folder" in capsys.readouterr().err


def test_token_comes_from_a_file_or_the_environment_not_only_the_command_line(
        grafana, tmp_path, monkeypatch):
    """A token on the command line is visible in `ps`; a file or $GRAFANA_TOKEN is not."""
    token_file = tmp_path / "grafana-token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv("GRAFANA_TOKEN", "from-env")
    assert cli.main(["dashboards", "push", "--url", grafana.url, "--token-file", str(token_file)]) == 0
    assert {auth for _, _, auth, _ in grafana.requests} == {f"Bearer {TOKEN}"}
    grafana.requests.clear()
    assert cli.main(["dashboards", "push", "--url", grafana.url]) == 0
    assert {auth for _, _, auth, _ in grafana.requests} == {"Bearer from-env"}


def test_push_without_any_token_says_how_to_give_one(grafana, monkeypatch, capsys):
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    assert cli.main(["dashboards", "push", "--url", grafana.url]) == 2
    assert "GRAFANA_TOKEN" in capsys.readouterr().err
    assert grafana.requests == []


def test_a_token_on_the_command_line_wins_over_the_environment(grafana, monkeypatch):
    monkeypatch.setenv("GRAFANA_TOKEN", "from-env")
    assert cli.main(["dashboards", "push", "--url", grafana.url, "--token", TOKEN]) == 0
    assert {auth for _, _, auth, _ in grafana.requests} == {f"Bearer {TOKEN}"}


@pytest.mark.parametrize("content, words", [("\n", "no Grafana token"),
                                            (None, "cannot read --token-file")])
def test_an_empty_or_unreadable_token_file_sends_nothing(grafana, tmp_path, monkeypatch, capsys,
                                                         content, words):
    monkeypatch.setenv("GRAFANA_TOKEN", "from-env")      # a file named is the token's only source
    token_file = tmp_path / "grafana-token"
    if content is not None:
        token_file.write_text(content)
    argv = ["dashboards", "push", "--url", grafana.url, "--token-file", str(token_file)]
    assert cli.main(argv) == 2
    assert words in capsys.readouterr().err
    assert grafana.requests == []


def test_push_gives_up_on_a_silent_server_after_its_timeout(capsys):
    """A server that accepts the connection and never answers: --timeout 0.5 ends the push in
    well under the default 10 s."""
    import socket
    import time

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        code = cli.main(["dashboards", "push", "--url", url, "--token", TOKEN, "--timeout", "0.5"])
        elapsed = time.monotonic() - start
    assert code == 1 and "error: " in capsys.readouterr().err
    assert elapsed < 5, elapsed
