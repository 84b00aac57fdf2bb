"""The lab's SGLang stand-in under load: its finite capacity, max_tokens and latency histograms.

The stand-in runs for real (``python -m sglang.launch_server`` on 127.0.0.1); the rates come
from its state file, set high or the loads kept small so that each test takes a few seconds.
Tolerances are loose on purpose: the machine is shared and slow, so a latency is asserted
between what the model says and a generous margin above it.
"""

from __future__ import annotations

import http.client
import itertools
import json
import re
import statistics
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

from pdctl.lab.state import FakeHardware, write_hardware
from pdctl.lab.worker.common.capacity import Capacity, Pace, Rates
from pdctl.lab.worker.sglang import launch_server
from tests.lab.worker.test_sglang import (
    MODEL,
    Launcher,
    Reply,
    Worker,
    request,
    sse_events,
)

T = TypeVar("T")
SLACK = 1.0  # seconds a slow, shared machine may add on top of what the model says
SAMPLE = re.compile(r"^([a-zA-Z0-9_:]+)\{([^}]*)\} (\S+)$")


def set_state(worker: Worker, **settings: float) -> None:
    worker.state_path.write_text(json.dumps(settings))


def metrics(worker: Worker) -> dict[str, float]:
    """``name{labels}`` -> value, for every sample of /metrics."""
    reply = request(worker.port, "GET", "/metrics")
    assert reply.status == 200
    found: dict[str, float] = {}
    for line in reply.body.decode().splitlines():
        match = SAMPLE.match(line)
        if match:
            found[f"{match[1]}{{{match[2]}}}"] = float(match[3])
    return found


MODEL_LABEL = f'model_name="{MODEL}"'


def series(found: dict[str, float], name: str, extra: str = "") -> float:
    return found[f"sglang:{name}{{{MODEL_LABEL}{extra}}}"]


def words(count: int) -> str:
    return " ".join(f"w{i}" for i in range(count))


def chat(port: int, prompt: str, **fields: object) -> Reply:
    body = {"messages": [{"role": "user", "content": prompt}], **fields}
    return request(port, "POST", "/v1/chat/completions", body, timeout=60)


def timed_stream(port: int, prompt: str, max_tokens: int) -> list[float]:
    """The arrival times of a chat stream's content chunks."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "max_tokens": max_tokens}))
    resp = conn.getresponse()
    stamps: list[float] = []
    try:
        while line := resp.readline():
            text = line.decode().strip()
            if not text.startswith("data: {"):
                continue
            choice = json.loads(text.removeprefix("data: "))["choices"][0]
            if choice["delta"].get("content"):
                stamps.append(time.monotonic())
    finally:
        conn.close()
    return stamps


def in_parallel(count: int, call: Callable[[int], T]) -> list[T]:
    """``call(0) .. call(count - 1)`` at once, each in its own thread."""
    results: dict[int, T] = {}

    def run(i: int) -> None:
        results[i] = call(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return [results[i] for i in range(count)]


# --------------------------------------------------------------------------- max_tokens


def test_max_tokens_sets_the_number_of_generated_tokens(launcher: Launcher) -> None:
    worker = launcher.start("null")
    set_state(worker, decode_tokens_per_s=100000, decode_token_floor_ms=0)
    out = chat(worker.port, "hello", max_tokens=12).json()
    choice = out["choices"][0]
    assert len(choice["message"]["content"].split()) == 12
    assert choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 12
    short = chat(worker.port, "hello", max_completion_tokens=2).json()
    assert (
        short["choices"][0]["message"]["content"]
        == worker.who().split()[0] + " " + (worker.who().split()[1])
    )
    natural = chat(worker.port, "hello").json()["choices"][0]
    assert natural["finish_reason"] == "stop"
    assert natural["message"]["content"] == f"{worker.who()} echo: hello"
    streamed = request(
        worker.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 7, "stream": True}
    )
    chunks = [json.loads(e) for e in sse_events(streamed.body)[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"][0]["text"]]
    assert len(texts) == 7
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    none = request(
        worker.port, "POST", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 0}}
    ).json()
    assert none["text"] == ""
    assert none["meta_info"]["completion_tokens"] == 0
    for bad in (-1, "5", 2.5, True):
        reply = chat(worker.port, "x", max_tokens=bad)
        assert reply.status == 400
        assert "max_tokens must be a non-negative integer" in reply.json()["error"]["message"]


# --------------------------------------------------------------------------- prefill


def test_ttft_grows_with_the_queued_prompt_load(launcher: Launcher) -> None:
    worker = launcher.start("prefill")
    set_state(worker, prefill_tokens_per_s=2000)
    prompt = words(400)  # 0.2 s of prefill each at 2,000 tokens/s

    def one(i: int) -> float:
        started = time.monotonic()
        reply = chat(worker.port, prompt, bootstrap_room=i, bootstrap_host="127.0.0.1")
        assert reply.status == 200
        return time.monotonic() - started

    alone = one(100)
    assert 0.19 <= alone <= 0.2 + SLACK
    queued: list[float] = []

    def watch() -> None:
        for _ in range(40):
            found = metrics(worker)
            queued.append(_queue(found))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    latencies = sorted(in_parallel(4, one))
    watcher.join()
    # One slot, arrival order: the k-th waits for the k-1 before it.
    for k, latency in enumerate(latencies, start=1):
        assert 0.2 * k - 0.02 <= latency <= 0.2 * k + SLACK, latencies
    assert max(queued) >= 1
    found = metrics(worker)
    assert series(found, "time_to_first_token_seconds_count") == 5
    total = alone + sum(latencies)
    assert total - 0.5 <= series(found, "time_to_first_token_seconds_sum") <= total
    assert series(found, "prompt_tokens_total") == 5 * 400
    assert series(found, "time_to_first_token_seconds_bucket", ',le="0.1"') == 0
    # The rate is re-read per request: twice as fast, half the time.
    set_state(worker, prefill_tokens_per_s=4000)
    assert 0.09 <= one(200) <= 0.1 + SLACK


def _queue(found: dict[str, float]) -> float:
    key = f'sglang:num_queue_reqs{{engine_type="prefill",{MODEL_LABEL},pp_rank="0",tp_rank="0"}}'
    return found[key]


# --------------------------------------------------------------------------- decode


def test_itl_grows_with_concurrent_streams_above_the_floor(launcher: Launcher) -> None:
    worker = launcher.start("null")
    set_state(
        worker, prefill_tokens_per_s=100000, decode_tokens_per_s=100, decode_token_floor_ms=20
    )
    alone = timed_stream(worker.port, "x", 15)
    assert len(alone) == 15
    gaps = [b - a for a, b in itertools.pairwise(alone)]
    # One stream: 1/100 s of the shared rate, below the 20 ms floor, so the floor holds.
    assert statistics.median(gaps) >= 0.018, gaps
    assert sum(gaps) <= 14 * 0.02 + SLACK
    streams = in_parallel(5, lambda _i: timed_stream(worker.port, "x", 15))
    shared = [b - a for s in streams for a, b in itertools.pairwise(s)]
    # Five streams share 100 tokens/s: 50 ms each between tokens.
    assert 0.04 <= statistics.median(shared) <= 0.05 + SLACK / 5, shared
    found = metrics(worker)
    count = series(found, "inter_token_latency_seconds_count")
    assert count == 6 * 14
    assert series(found, "inter_token_latency_seconds_bucket", ',le="0.015"') == 0
    assert series(found, "generation_tokens_total") == 6 * 15
    mean = series(found, "inter_token_latency_seconds_sum") / count
    assert (14 * 0.02 + 5 * 14 * 0.05) / count * 0.9 <= mean


def test_the_floor_comes_from_the_state_file(launcher: Launcher) -> None:
    worker = launcher.start("null")
    set_state(worker, decode_tokens_per_s=100000, decode_token_floor_ms=30)
    chat(worker.port, "x", max_tokens=6)
    found = metrics(worker)
    assert series(found, "inter_token_latency_seconds_count") == 5
    assert series(found, "inter_token_latency_seconds_bucket", ',le="0.025"') == 0
    assert series(found, "inter_token_latency_seconds_bucket", ',le="+Inf"') == 5
    set_state(worker, decode_tokens_per_s=100000, decode_token_floor_ms=0)
    chat(worker.port, "x", max_tokens=6)
    found = metrics(worker)
    assert series(found, "inter_token_latency_seconds_bucket", ',le="0.025"') >= 4


def test_histograms_are_sglangs_and_count_what_was_served(launcher: Launcher) -> None:
    worker = launcher.start("null")
    set_state(worker, prefill_tokens_per_s=100000, decode_tokens_per_s=100000)
    served = [(3, 4), (10, 1), (1, 9)]  # (prompt words, max_tokens)
    for prompt_words, limit in served:
        assert chat(worker.port, words(prompt_words), max_tokens=limit).status == 200
    text = request(worker.port, "GET", "/metrics").body.decode()
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert f"# TYPE sglang:{name}_seconds histogram" in text
    found = metrics(worker)
    assert series(found, "time_to_first_token_seconds_count") == 3
    assert series(found, "e2e_request_latency_seconds_count") == 3
    assert series(found, "inter_token_latency_seconds_count") == sum(n - 1 for _, n in served)
    assert series(found, "prompt_tokens_total") == sum(p for p, _ in served)
    assert series(found, "generation_tokens_total") == sum(n for _, n in served)
    ttft_le = [
        float(m[1])
        for m in re.finditer(r'sglang:time_to_first_token_seconds_bucket\{[^}]*le="([^"]+)"', text)
        if m[1] != "+Inf"
    ]
    assert ttft_le[:3] == [0.1, 0.2, 0.4] and ttft_le[-1] == 400.0  # SGLang's own bounds
    assert 'le="1.0"' in text and 'le="0.002"' in text
    buckets = [
        value
        for key, value in found.items()
        if key.startswith("sglang:inter_token_latency_seconds_bucket")
    ]
    assert buckets == sorted(buckets)  # cumulative
    assert buckets[-1] == series(found, "inter_token_latency_seconds_count")
    assert series(found, "time_to_first_token_seconds_sum") > 0


# --------------------------------------------------------------------------- P/D


def test_decode_waits_for_its_prefill_and_each_side_records_its_phase(
    launcher: Launcher,
) -> None:
    prefill, decode = launcher.start("prefill"), launcher.start("decode")
    set_state(prefill, prefill_tokens_per_s=2000)
    set_state(decode, decode_tokens_per_s=100000, decode_token_floor_ms=0)
    fields = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": 5,
        "max_tokens": 3,
    }
    prompt = words(600)  # 0.3 s of prefill
    legs: dict[str, float] = {}

    def leg(worker: Worker) -> None:
        started = time.monotonic()
        assert chat(worker.port, prompt, **fields).status == 200
        legs[worker.mode] = time.monotonic() - started

    # As SMG does: both legs at once; the decode answers once the KV cache is there.
    in_parallel(2, lambda i: leg([prefill, decode][i]))
    assert legs["prefill"] >= 0.29
    assert legs["decode"] >= 0.29
    on_prefill, on_decode = metrics(prefill), metrics(decode)
    assert series(on_prefill, "time_to_first_token_seconds_sum") >= 0.29
    assert series(on_prefill, "inter_token_latency_seconds_count") == 0
    assert series(on_decode, "inter_token_latency_seconds_count") == 2
    assert "room 5" not in decode.log()  # no hand-off warning: the prefill knew the room


def test_the_lab_state_file_carries_the_capacity(launcher: Launcher) -> None:
    """The file pdctl writes for a lab host (pdctl/lab/state.py) sets the worker's rates."""
    worker = launcher.start("prefill")
    hardware = FakeHardware(host_index=1, prefill_tokens_per_s=1000, decode_token_floor_ms=5)
    write_hardware(worker.state_path, hardware)
    started = time.monotonic()
    assert chat(worker.port, words(300)).status == 200  # 0.3 s at 1,000 tokens/s
    assert 0.29 <= time.monotonic() - started <= 0.3 + SLACK
    assert json.loads(worker.state_path.read_text())["decode_tokens_per_s"] == 400


def test_bucket_flags_set_the_bounds_as_in_sglang(launcher: Launcher) -> None:
    worker = launcher.start(
        "null", "--bucket-time-to-first-token", "0.5", "0.01", "0.05", "--enable-metrics"
    )
    set_state(worker, prefill_tokens_per_s=100000, decode_tokens_per_s=100000)
    assert chat(worker.port, "x", max_tokens=1).status == 200
    text = request(worker.port, "GET", "/metrics").body.decode()
    bounds = re.findall(r'sglang:time_to_first_token_seconds_bucket\{[^}]*le="([^"]+)"', text)
    assert bounds == ["0.01", "0.05", "0.5", "+Inf"]
    assert 'sglang:inter_token_latency_seconds_bucket{model_name="' in text  # SGLang's default
    assert "--bucket-time-to-first-token" not in worker.log()  # a known flag: no warning


# --------------------------------------------------------------------------- counted before sent


@pytest.mark.parametrize("native", [False, True], ids=["openai", "generate"])
def test_a_stream_is_counted_before_its_finishing_event(native: bool) -> None:
    """SGLang's tokenizer manager counts a finished request (collect_metrics) in the step that
    wakes the HTTP handler to send it, so a client holding the whole answer sees it counted.
    The stand-in counts before it yields the finishing event: no test or scaler reading
    /metrics right after an answer races the bookkeeping."""
    answer = launch_server.Answer(text="a b c", prompt_tokens=2, completion_tokens=3)
    rates = Rates(prefill_tokens_per_s=1e9, decode_tokens_per_s=1e9, decode_floor_s=0.0)
    pace = Pace(
        capacity=Capacity(),
        mode="null",
        rates=rates,
        latency=0.0,
        prompt_tokens=2,
        kv_from=None,
        started=time.monotonic(),
        warn=print,
    )
    events: list[str] = []
    counted_after: list[int] = []
    ctx = launch_server.StreamContext(
        rid="r",
        model=MODEL,
        chat=True,
        started=pace.started,
        pace=pace,
        include_usage=False,
        complete=lambda: counted_after.append(len(events)),
    )
    stream = launch_server.generate_events if native else launch_server.openai_events
    for event in stream(ctx, answer, launch_server.pieces(answer.text)):
        if not events and counted_after:
            pytest.fail("counted before any event")
        events.append(event)
    finishing = next(
        i
        for i, event in enumerate(events)
        if (json.loads(event).get("meta_info") or {}).get("finish_reason")
        or json.loads(event).get("choices", [{}])[0].get("finish_reason")
    )
    assert counted_after == [finishing]  # once, just before the finishing event
