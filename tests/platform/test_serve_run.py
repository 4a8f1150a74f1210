"""`serve run kvharbor.app` as a new user runs it: from a clean directory, default options."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvharbor.platform.ingress import DRAIN_VAR, FLAGS, PORTS, PRESET, haproxy_available, requested_mode
from kvharbor.platform.reasoning import split
from tests.conftest import assert_served_on_loopback_by, listeners_off_loopback


@pytest.mark.parametrize("shell", ["fresh", "ray-flags-exported", "proxy"],
                         ids=["fresh-shell", "ray-flags-exported", "serve-proxy"])
def test_serve_run_from_a_clean_directory(tmp_path, shell):
    """``fresh``: the default, the one gateway replica serves port 8000 itself (``direct``);
    a client that gives up on a non-streaming request gets it aborted.
    ``ray-flags-exported``: the user asked for HAProxy and the shell already has Ray's
    HAProxy flags (as the README tells config-file users to set); Serve's own default HTTP
    host is then every interface, and kvharbor must still serve on loopback only.
    ``proxy``: ``KVHARBOR_INGRESS=proxy``, Serve's proxy in front."""
    env = _fresh_shell_env()
    if shell == "ray-flags-exported":     # and HAProxy asked for, so Serve's default host applies
        env.update({flag: "1" for flag in FLAGS}, KVHARBOR_INGRESS="haproxy")
    elif shell == "proxy":
        env["KVHARBOR_INGRESS"] = "proxy"
    env["KVHARBOR_METRICS_PORT"] = "18185"
    proc, lines, ready_lines, ready, reader = _serve_run(["kvharbor.app"], tmp_path, env)
    try:
        body = None
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            try:
                r = httpx.post("http://127.0.0.1:8000/v1/completions",
                               headers={"Authorization": "Bearer kvh-demo-premium"},
                               json={"model": "kvharbor/tiny-llama", "prompt": "Hello", "max_tokens": 5},
                               timeout=30)
                if r.status_code == 200:
                    body = r.json()
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        assert proc.poll() is None, "".join(lines)[-3000:]
        assert body is not None, "no completion within 300 s"
        assert body["usage"]["completion_tokens"] >= 1
        # kvharbor's ingress (the gateway itself unless KVHARBOR_INGRESS says otherwise), on loopback only: with
        # HAProxy, Serve's own default would be every interface.
        health = httpx.get("http://127.0.0.1:8000/healthz", timeout=10).json()
        wanted = requested_mode(env, default="direct")       # the default app: one gateway
        assert health["ingress"] == ("proxy" if wanted == "haproxy" and not haproxy_available() else wanted)
        assert_served_on_loopback_by(8000, health["ingress"])
        # and every other port of the cluster (Ray's GCS, raylet, workers, Serve's gRPC), but
        # HAProxy's stats and metrics pages: Serve's HAProxy config binds them on every interface
        off = listeners_off_loopback(proc.pid)
        if health["ingress"] == "haproxy":
            assert len(off) <= 2 and all(name == "haproxy" and port != 8000 for _, port, name in off), off
            off = []
        assert off == []
        if health["ingress"] == "direct":
            _assert_a_client_timeout_aborts_the_request()
            _assert_a_killed_gateway_serves_the_port_again(within_s=60)
        # Ctrl-C once `serve run` says the app is up (the proxy may answer a moment before:
        # a SIGINT that lands while the CLI still deploys is Ray's to handle, not tested here).
        assert ready.wait(60), "`serve run` never printed that the app is ready"
        # ... at the address it serves (with direct ingress Serve's proxy has another port)
        assert "is ready at http://127.0.0.1:8000/" in ready_lines[0], ready_lines
    finally:
        killed = not _stop(proc)
        reader.join(timeout=30)
        out = "".join(lines)
    # Ctrl-C stops everything by itself: no SIGKILL needed, a clean exit, the port released.
    assert not killed, f"`serve run` ignored Ctrl-C three times over 90 s:\n{out[-3000:]}"
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{out[-3000:]}"
    assert not _accepts_connections("127.0.0.1", 8000), "port 8000 still served after Ctrl-C"
    assert "demo API keys are active" in out


def _serve_run(args: list[str], cwd: Path, env: dict[str, str]):
    """Start ``serve run *args`` as from a terminal; (process, its output lines, the lines
    saying the app is ready, an event set at the first, the thread reading the output)."""
    serve_bin = Path(sys.executable).parent / "serve"
    # As from a fresh terminal: SIGINT neither ignored nor blocked. A child inherits an ignored
    # disposition and the signal mask across exec, and this pytest process (Ray's and torch's
    # threads, earlier tests) may have either; then `serve run` never sees Ctrl-C.
    terminal = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
                "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])")
    proc = subprocess.Popen([sys.executable, "-c", terminal, str(serve_bin), "run", *args],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []
    ready_lines: list[str] = []
    ready = threading.Event()

    def read_output() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "is ready at" in line:
                ready_lines.append(line)
                ready.set()

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    return proc, lines, ready_lines, ready, reader


def _stop(proc: subprocess.Popen) -> bool:
    """Ctrl-C ``proc`` (SIGKILL its group if it ignores three); True if Ctrl-C stopped it."""
    stopped = _ctrl_c(proc, presses=3, every_s=30)
    if not stopped:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return stopped


def test_serve_run_serves_a_local_checkpoint_as_the_offline_engine_does(tmp_path):
    """The README's way to serve one's own model: ``serve run kvharbor:build_app
    model=<checkpoint directory>``. A tiny random Qwen3 checkpoint (transformers' forward:
    not an architecture of kvharbor's own) whose tokenizer has no chat template, given one
    with ``chat_template=<file>``, answers completions and chat over HTTP with the offline
    engine's text for the same requests, and /v1/models gives the context it is served with
    (``max_model_len=384``, vLLM's, below the model's 512; a longer request is a 400). Its
    generation_config.json sets default sampling (top_k 1, a repetition penalty, 6 new
    tokens): a chat that sets none is answered as the offline engine's default sampling
    answers it, and the fields a request sets win. It is served as ``served_model_name=
    tiny-qwen3,qwen3-alias`` (vLLM's): requests name either, answers carry the first, and
    the checkpoint's path is a 404. Started with ``enable_auto_tool_choice=true
    tool_call_parser=hermes`` (vLLM's), a chat that sends tools (``tool_choice`` "auto" by
    default) is served: this model writes no call, so the answer is its text, special tokens
    kept (as vLLM's hermes parser asks). With ``reasoning_parser=qwen3`` that text is the
    message's ``reasoning`` (it never closes ``</think>``), unless the chat turns thinking off
    (``chat_template_kwargs``), as the other chats here do; usage counts its reasoning tokens."""
    from kvharbor import LLM, SamplingParams
    from kvharbor.engine.model_info import model_context_length
    from tests.engine.test_chat_template import TEMPLATE
    from tests.engine.test_other_architectures import ARCHITECTURES, save_checkpoint

    checkpoint = save_checkpoint(ARCHITECTURES["qwen3"], tmp_path / "qwen3")
    (Path(checkpoint) / "chat_template.jinja").unlink()          # a base model's tokenizer
    generation = Path(checkpoint) / "generation_config.json"
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "temperature": 0.7,
                                      "top_k": 1, "repetition_penalty": 3.0, "max_new_tokens": 6}))
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**_fresh_shell_env(), "KVHARBOR_HTTP_PORT": str(port), "KVHARBOR_METRICS_PORT": "18186"}
    proc, lines, _, _, reader = _serve_run(["kvharbor:build_app", f"model={checkpoint}", "replicas=1",
                                            f"chat_template={template}", "max_model_len=384",
                                            "served_model_name=tiny-qwen3,qwen3-alias",
                                            "enable_auto_tool_choice=true", "tool_call_parser=hermes",
                                            "reasoning_parser=qwen3"],
                                           tmp_path, env)
    base, key = f"http://127.0.0.1:{port}", {"Authorization": "Bearer kvh-demo-standard"}
    greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "repetition_penalty": 1}
    try:
        answer, deadline = None, time.time() + 300
        while answer is None and time.time() < deadline and proc.poll() is None:
            try:
                r = httpx.post(base + "/v1/completions", headers=key, timeout=30,
                               json={"model": "tiny-qwen3", "prompt": "Hello", **greedy})
                answer = r.json() if r.status_code == 200 else None
            except httpx.HTTPError:
                pass
            time.sleep(0 if answer else 2)
        assert answer is not None, "".join(lines)[-3000:]
        chat = httpx.post(base + "/v1/chat/completions", headers=key, timeout=30,
                          json={"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Hi"}],
                                **greedy, **NO_THINKING}).json()
        hi = [{"role": "user", "content": "Hi"}]
        unset = httpx.post(base + "/v1/chat/completions", headers=key, timeout=30,
                           json={"model": "qwen3-alias", "messages": hi, **NO_THINKING}).json()
        too_long = httpx.post(base + "/v1/completions", headers=key, timeout=30,
                              json={"model": "tiny-qwen3", "prompt": "x" * 380, "max_tokens": 8})
        by_path = httpx.post(base + "/v1/completions", headers=key, timeout=30,
                             json={"model": checkpoint, "prompt": "Hello"})
        cards = httpx.get(base + "/v1/models", headers=key, timeout=10).json()["data"]
        auto = httpx.post(base + "/v1/chat/completions", headers=key, timeout=30,
                          json={"model": "tiny-qwen3", "messages": hi, "tools": TOOLS, **greedy,
                                "logit_bias": {"257": 100}}).json()          # <s>, a special token
        budget = httpx.post(base + "/v1/chat/completions", headers=key, timeout=30,
                            json={"model": "tiny-qwen3", "messages": hi, **greedy, "max_tokens": 16,
                                  "thinking_token_budget": 2}).json()
        hidden = httpx.post(base + "/v1/chat/completions", headers=key, timeout=30,
                            json={"model": "tiny-qwen3", "messages": hi, **greedy, "include_reasoning": False,
                                  "logprobs": True, "return_token_ids": True}).json()
        plain = {"max_tokens": 8, "temperature": 0}
        thought = httpx.post(base + "/v1/chat/completions", headers=key, timeout=30,
                             json={"model": "tiny-qwen3", "messages": hi, **plain}).json()
        said = {"model": "tiny-qwen3", "input": "Hi", "max_output_tokens": 8, "temperature": 0}
        response = httpx.post(base + "/v1/responses", headers=key, timeout=30, json=said).json()
        with httpx.stream("POST", base + "/v1/responses", headers=key, timeout=30,
                          json={**said, "stream": True}) as streamed:
            events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
    finally:
        stopped = _stop(proc)
        reader.join(timeout=30)
    # the Responses API: the reasoning the chat answer has, as a reasoning item (never closed: no message)
    assert [(i["type"], i["content"][0]["text"]) for i in response["output"]] == \
        [("reasoning", thought["choices"][0]["message"]["reasoning"])], response
    assert response["status"] == "incomplete" and response["usage"]["output_tokens_details"] == \
        thought["usage"]["completion_tokens_details"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == \
        thought["choices"][0]["message"]["reasoning"]
    assert events[-1]["response"]["output"] == [{**response["output"][0], "id": events[-1]["response"]["output"][0]["id"]}]
    llm = LLM(model=checkpoint, device="cpu", num_kv_blocks=64)
    sp = SamplingParams(**greedy)
    assert answer["choices"][0]["text"] == llm.generate(["Hello"], sp)[0].outputs[0].text
    assert chat["choices"][0]["message"]["content"] == \
        llm.chat([{"role": "user", "content": "Hi"}], sp, chat_template=str(template))[0].outputs[0].text
    default = llm.chat(hi, chat_template=str(template))[0].outputs[0]
    assert unset["choices"][0]["message"]["content"] == default.text
    assert unset["usage"]["completion_tokens"] == len(default.token_ids) <= 6
    assert [(c["id"], c["root"], c["max_model_len"]) for c in cards] == [
        ("tiny-qwen3", checkpoint, 384), ("qwen3-alias", checkpoint, 384)]
    assert (answer["model"], unset["model"]) == ("tiny-qwen3", "tiny-qwen3")
    assert by_path.status_code == 404 and by_path.json()["error"]["code"] == "model_not_found"
    assert model_context_length(checkpoint) == 512              # the model's own
    assert too_long.status_code == 400 and "context of 384 tokens" in too_long.json()["error"]["message"]
    spoken = llm.chat(hi, SamplingParams(**greedy, skip_special_tokens=False, logit_bias={257: 100}),
                      chat_template=str(template), tools=TOOLS)[0].outputs[0].text
    assert spoken == "<s>" * 8                  # kept: a parser must see tags that are special tokens
    # thinking (Qwen3's default) and no </think>: all reasoning
    assert auto["choices"][0]["message"] == {"role": "assistant", "content": None, "reasoning": spoken}, auto
    assert auto["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}    # the replica's count
    assert chat["choices"][0]["message"]["reasoning"] is None
    assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}    # thinking off
    # include_reasoning false: nothing spells the reasoning, logprobs and token ids neither (vLLM's)
    assert hidden["choices"][0]["message"]["reasoning"] is None and hidden["choices"][0]["logprobs"] is None
    assert "token_ids" not in hidden["choices"][0] and "prompt_token_ids" not in hidden, hidden
    # thinking_token_budget (vLLM's): </think> forced after 2 tokens of thought, then the answer
    spent = LLM(model=checkpoint, device="cpu", num_kv_blocks=64, reasoning_parser="qwen3").chat(
        hi, SamplingParams(**{**greedy, "max_tokens": 16}, thinking_token_budget=2), chat_template=str(template))[0]
    assert "</think>" in spent.outputs[0].text, spent
    message = budget["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == split(spent.outputs[0].text, "qwen3"), budget
    assert budget["usage"]["completion_tokens_details"] == {"reasoning_tokens": spent.num_reasoning_tokens}
    assert stopped, "".join(lines)[-3000:]


TOOLS = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}    # the test template ignores it


def _fresh_shell_env() -> dict[str, str]:
    """As from a fresh terminal: none of this session's cluster settings (its ingress ports)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("RAY_ADDRESS", "RAY_SERVE_", "KVHARBOR_INGRESS"))
            and k not in (*FLAGS, *PORTS, DRAIN_VAR, PRESET)}


def test_serve_run_on_a_port_already_taken_says_so_before_starting_ray():
    """Something already listens on the app's port (an HAProxy left by a killed cluster, in
    the case seen): `serve run` stops at once with a line naming the port and what to do,
    before any Ray process starts (it used to start the cluster and fail the deployment
    with Serve's NoAvailablePortError in a 40-line trace)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {**_fresh_shell_env(), "KVHARBOR_HTTP_PORT": str(port)}
        done = subprocess.run([str(Path(sys.executable).parent / "serve"), "run", "kvharbor.app"],
                              env=env, capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert f"cannot serve HTTP on 127.0.0.1:{port}" in out, out[-3000:]
    assert "KVHARBOR_HTTP_PORT" in out
    assert "Started a local Ray instance" not in out, out[-3000:]


def _in_flight(key: str) -> int:
    """The requests in flight of ``key``'s tenant (a tenant's key sees its own usage)."""
    tenants = httpx.get("http://127.0.0.1:8000/admin/tenants", timeout=10,
                        headers={"Authorization": f"Bearer {key}"}).json()["tenants"]
    (usage,) = [t["usage"] for t in tenants.values()]
    return usage["in_flight"]


def _assert_a_client_timeout_aborts_the_request() -> None:
    """A 3,000-token completion whose client gives up after 1.5 s: its tenant's request
    leaves flight within 5 s. (Through HAProxy, which misses that close, it was still in
    flight after 5 s in 3 of 3 runs: the check can fail.)"""
    key = "kvh-demo-standard"
    assert _in_flight(key) == 0
    with pytest.raises(httpx.TimeoutException):
        httpx.post("http://127.0.0.1:8000/v1/completions", timeout=1.5,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": "kvharbor/tiny-llama", "prompt": "a" * 64, "max_tokens": 3000,
                         "ignore_eos": True, "temperature": 0})
    gave_up = time.monotonic()
    while _in_flight(key) and time.monotonic() - gave_up < 5.0:
        time.sleep(0.1)
    assert _in_flight(key) == 0, "the request ran on after its client gave up"


def _assert_a_killed_gateway_serves_the_port_again(within_s: float) -> None:
    """SIGKILL the process serving port 8000 (the gateway replica, with direct ingress): Serve
    starts another that takes the port again and serves (11.8 s here; Serve's default port
    quarantine, meant for HAProxy, would hold the port back 150 s)."""
    import psutil

    owners = {c.pid for c in psutil.net_connections(kind="tcp")
              if c.status == psutil.CONN_LISTEN and c.laddr.port == 8000 and c.pid}
    assert owners and all("Gateway" in " ".join(psutil.Process(pid).cmdline()) for pid in owners), owners
    for pid in owners:
        os.kill(pid, signal.SIGKILL)
    killed, outcomes = time.monotonic(), []
    while time.monotonic() - killed < within_s:
        try:
            r = httpx.post("http://127.0.0.1:8000/v1/completions", timeout=10,
                           headers={"Authorization": "Bearer kvh-demo-premium"},
                           json={"model": "kvharbor/tiny-llama", "prompt": "Hello", "max_tokens": 2})
            outcomes.append(r.status_code)
            if r.status_code == 200:
                print(f"a new gateway served {time.monotonic() - killed:.1f} s after the kill")
                return
        except httpx.HTTPError as e:
            outcomes.append(type(e).__name__)
        time.sleep(0.5)
    raise AssertionError(f"port 8000 not served again {within_s} s after the gateway was killed: "
                         f"{outcomes[:3]} ... {outcomes[-3:]}")


def _ctrl_c(proc: subprocess.Popen, presses: int, every_s: float) -> bool:
    """Press Ctrl-C (SIGINT to the process group, as a terminal does) until ``proc`` exits, at
    most ``presses`` times ``every_s`` apart. True if it exited. In both clean-clone suite runs
    of 2026-11-23 the CLI sat 90 s after one SIGINT without logging "Got KeyboardInterrupt"
    (alone it exits within seconds; cause not found, inside Ray's CLI); a user presses again."""
    for press in range(presses):
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=every_s)
            print(f"serve run exited after {press + 1} Ctrl-C")
            return True
        except subprocess.TimeoutExpired:
            continue
    return False


def _accepts_connections(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex((host, port)) == 0
