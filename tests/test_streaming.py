"""`"stream": true` on `reprorl serve`: server-sent events whose chunks add up to the
unstreamed answer (text, log-probs, ids, endings), with vLLM's chunk keys and its usage rules."""

from __future__ import annotations

import json

import pytest
import requests
from test_server import MAX_LEN, running_server

COMPLETION_KEYS = {"index", "text", "logprobs", "finish_reason", "stop_reason",
                   "prompt_token_ids", "token_ids"}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with running_server(tiny_model, tmp_path_factory.mktemp("stream-server"),
                        "--max-model-len", str(MAX_LEN)) as (url, _):
        yield url


def events(url: str, path: str, body: dict) -> list:
    """The stream's events, parsed; the last must be [DONE]."""
    with requests.post(f"{url}{path}", json=body, stream=True, timeout=120) as response:
        assert response.status_code == 200, response.text
        assert response.headers["Content-Type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines(decode_unicode=True) if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def whole(url: str, path: str, body: dict) -> dict:
    response = requests.post(f"{url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("extra", [
    {},
    {"stop": ["e", "th"], "logprobs": 2, "return_token_ids": True},
    {"stop": ["e"], "include_stop_str_in_output": True, "echo": True},
], ids=["plain", "stop-strings-logprobs-ids", "included-stop-echo"])
def test_a_streamed_completion_adds_up_to_the_unstreamed_one(server, extra):
    body = {"prompt": ["One.", "Two, then."], "n": 2, "max_tokens": 12, "seed": 5,
            "temperature": 1.0, **extra}
    answer = whole(server, "/v1/completions", body)
    chunks = events(server, "/v1/completions",
                    {**body, "stream": True, "stream_options": {"include_usage": True}})
    *parts, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == {
        k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    for part in parts:
        assert part["object"] == "text_completion" and part["id"].startswith("cmpl-")
        assert set(part["choices"][0]) == COMPLETION_KEYS and "usage" not in part
    for expected in answer["choices"]:
        mine = [p["choices"][0] for p in parts if p["choices"][0]["index"] == expected["index"]]
        assert "".join(c["text"] for c in mine) == expected["text"]
        assert [c["finish_reason"] for c in mine[:-1]] == [None] * (len(mine) - 1)
        assert (mine[-1]["finish_reason"], mine[-1]["stop_reason"]) == (
            expected["finish_reason"], expected["stop_reason"])
        if expected["logprobs"] is not None:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                assert [x for c in mine for x in c["logprobs"][key]] == (
                    expected["logprobs"][key])
        if expected["token_ids"] is not None:
            assert [t for c in mine for t in c["token_ids"]] == expected["token_ids"]
            assert mine[0]["prompt_token_ids"] == expected["prompt_token_ids"]
            assert all(c["prompt_token_ids"] is None for c in mine[1:])


def test_a_streamed_chat_and_continuous_usage(server):
    body = {"messages": [{"role": "user", "content": "Hello there."}], "n": 2,
            "max_completion_tokens": 10, "seed": 3, "temperature": 1.0, "logprobs": True,
            "top_logprobs": 1}
    answer = whole(server, "/v1/chat/completions", body)
    chunks = events(server, "/v1/chat/completions", {
        **body, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    for index, expected in enumerate(answer["choices"]):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["object"] == "chat.completion.chunk" for c in mine)
        content = "".join(c["choices"][0]["delta"]["content"] for c in mine[1:])
        assert content == expected["message"]["content"]
        assert mine[-1]["choices"][0]["finish_reason"] == expected["finish_reason"]
        assert [t for c in mine[1:] for t in c["choices"][0]["logprobs"]["content"]] == (
            expected["logprobs"]["content"])
        counted = [c["usage"]["completion_tokens"] for c in mine[1:]]
        assert counted == sorted(counted) and counted[-1] == len(
            expected["logprobs"]["content"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == (
        answer["usage"]["completion_tokens"])


def test_stream_requests_refused_by_name(server):
    url = f"{server}/v1/completions"
    response = requests.post(url, json={"prompt": "x", "max_tokens": 2,
                                        "stream_options": {"include_usage": True}}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "Stream options can only be defined when `stream=True`.")
    response = requests.post(f"{server}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "stream": True, "tools": [{
            "type": "function", "function": {"name": "f", "parameters": {}}}]}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream"
    without = events(server, "/v1/completions", {"prompt": "x", "max_tokens": 2,
                                                 "stream": True})
    assert all(chunk["choices"] for chunk in without)  # no usage chunk unless asked
    assert without[-1]["system_fingerprint"] == "reprorl-serve"
