"""The provider adapters against the loopback servers: real HTTP, real wire formats, real faults.

No Ray Serve: the adapters are plain objects (the app's shared budget: test_budget_scope.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from cluster.config import BackendConfig, ModelConfig
from cluster.providers.budget import ProviderBudget, Reservation
from cluster.wire import errors as E
from cluster.wire.protocol import Chunk, GenerateRequest, Sampling
from deployments.budgets.provider_budget import LocalBudget
from deployments.providers.providers import (
    AnthropicProviderBackend,
    OpenAIProviderBackend,
    ProviderBackend,
    aclose_shared_session,
    build_provider_backend,
)
from fixtures.servers import AnthropicServer, LoopbackServer, OpenAIServer

KEY = "sk-test-Zx9vQ2mL7pK4nR8sT1uW"
KEY_ENV = "LLMC_TEST_PROVIDER_KEY"


@pytest_asyncio.fixture(autouse=True, loop_scope="function")
async def _close_pool() -> AsyncIterator[None]:
    yield
    await aclose_shared_session()  # each test has its own loop (this one): leave no connections behind


@pytest.fixture(scope="module", autouse=True)
def _key_env() -> Iterator[None]:
    old = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = KEY
    yield
    if old is None:
        os.environ.pop(KEY_ENV, None)
    else:
        os.environ[KEY_ENV] = old


@pytest.fixture(scope="module")
def openai_srv() -> Iterator[OpenAIServer]:
    with OpenAIServer(api_key=KEY, output_tokens=5) as srv:
        yield srv


@pytest.fixture(scope="module")
def anthropic_srv() -> Iterator[AnthropicServer]:
    with AnthropicServer(api_key=KEY, output_tokens=5) as srv:
        yield srv


@pytest.fixture(params=["openai", "anthropic"])
def srv(
    request: pytest.FixtureRequest, openai_srv: OpenAIServer, anthropic_srv: AnthropicServer
) -> LoopbackServer:
    s = openai_srv if request.param == "openai" else anthropic_srv
    s.reset()
    s.default_fault = None
    return s


def make(
    srv: LoopbackServer, *, tokenizer: str | None = None, wait_s: float = 0.0, **provider: Any
) -> ProviderBackend:
    api = "anthropic" if isinstance(srv, AnthropicServer) else "openai"
    cfg = {
        "api": api,
        "base_url": srv.base_url,
        "api_key_env": KEY_ENV,
        "connect_timeout_s": 2.0,
        "first_token_timeout_s": 2.0,
        "between_tokens_timeout_s": 2.0,
        **provider,
    }
    backend = BackendConfig(name=f"{api}-test", kind="provider", model="m", provider=cfg)
    tok = tokenizer or ("tiktoken:gpt-4o" if api == "openai" else "estimate:3.5")
    model = ModelConfig(name="m", tokenizer=tok, context_window=8192)
    budget = LocalBudget(ProviderBudget.from_config(backend.provider))  # type: ignore[arg-type]
    return build_provider_backend(backend, model, "replica-0", budget=budget, admission_wait_s=wait_s)


def req(rid: str = "req-1", max_tokens: int = 8, **kw: Any) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model="m",
        kind=kw.pop("kind", "chat"),
        prompt_token_ids=kw.pop("prompt_token_ids", []),
        sampling=Sampling(max_tokens=max_tokens, **kw),
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hello to the tests."},
        ],
        prompt_text="Once upon a time",
    )


async def collect(backend: ProviderBackend, r: GenerateRequest) -> tuple[list[Chunk], BaseException | None]:
    """Everything the adapter produced: its chunks and the one error it ended with, if any."""
    chunks: list[Chunk] = []
    try:
        async for c in backend.generate(r):
            chunks.append(c)
    except E.ClusterError as exc:
        return chunks, exc
    return chunks, None


async def wait_for(pred: Any, timeout: float = 1.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        await asyncio.sleep(0.01)
    return bool(pred())


# ------------------------------------------------------------------------------------------------
# The happy paths
# ------------------------------------------------------------------------------------------------


async def test_stream_and_usage(srv: LoopbackServer) -> None:
    be = make(srv)
    chunks, err = await collect(be, req(max_tokens=5))
    assert err is None
    assert "".join(c.text for c in chunks) == "Hello alpha beta gamma delta"
    final = chunks[-1]
    assert final.finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    rec = srv.stats().records[-1]
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (
        rec.prompt_tokens,
        rec.completion_tokens,
    )
    assert all(c.replica == "replica-0" and c.backend == be.backend_name for c in chunks)
    st = be.stats()
    assert (st.requests_started, st.requests_finished, st.running, st.kind) == (1, 1, 0, "provider")


async def test_stop_sequence_and_natural_end(srv: LoopbackServer) -> None:
    be = make(srv)
    chunks, err = await collect(be, req(max_tokens=50, stop=["gamma"]))
    assert err is None and chunks[-1].finish_reason == "stop"
    assert "".join(c.text for c in chunks) == "Hello alpha beta "
    chunks, err = await collect(be, req(max_tokens=50))  # the server's answer (5 tokens) ends first
    assert err is None and chunks[-1].finish_reason == "stop"


async def test_openai_text_completion(openai_srv: OpenAIServer) -> None:
    be = make(openai_srv)
    chunks, err = await collect(be, req(kind="completion", max_tokens=3))
    assert err is None and "".join(c.text for c in chunks) == "Hello alpha beta"
    assert openai_srv.stats().records[-1].path == "/v1/completions"


async def test_usage_estimated_when_the_provider_reports_none(openai_srv: OpenAIServer) -> None:
    be = make(openai_srv)
    openai_srv.push_faults("no_usage")
    chunks, err = await collect(be, req(max_tokens=5))
    assert err is None and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert be.stats().extra["usage_estimated"] == 1


# ------------------------------------------------------------------------------------------------
# Faults: the right error, and always a clean end (a final chunk or exactly one error)
# ------------------------------------------------------------------------------------------------

FAULTS = [
    # fault,           error type,             status, content chunks before the error
    ("429:3", E.RateLimited, 429, 0),
    ("529", E.Overloaded, 503, 0),
    ("500", E.BackendUnavailable, 502, 0),
    ("503", E.BackendUnavailable, 502, 0),
    ("400", E.InvalidRequest, 400, 0),
    ("422", E.InvalidRequest, 422, 0),
    ("404", E.NotFound, 404, 0),
    ("401", E.ProviderAuthError, 502, 0),
    ("403", E.ProviderAuthError, 502, 0),
    ("hang", E.UpstreamTimeout, 504, 0),
    ("slow_first:3", E.UpstreamTimeout, 504, 0),
    ("malformed:0", E.BackendUnavailable, 502, 0),
    ("error_event:0", None, None, 0),  # mapped by the event's type: see below
    ("drop:0", E.BackendUnavailable, 502, 0),
    ("stall:2", E.StreamInterrupted, 502, 2),
    ("malformed:2", E.StreamInterrupted, 502, 2),
    ("error_event:2", E.StreamInterrupted, 502, 2),
    ("drop:2", E.StreamInterrupted, 502, 2),
]


@pytest.mark.parametrize(("fault", "cls", "status", "before"), FAULTS, ids=[f[0] for f in FAULTS])
async def test_fault_maps_to_error(
    srv: LoopbackServer, fault: str, cls: type[E.ClusterError] | None, status: int | None, before: int
) -> None:
    # Short clocks only where the fault is a timeout: elsewhere a busy machine must not turn into one.
    clock = 0.5 if fault.split(":")[0] in ("hang", "slow_first", "stall") else 5.0
    be = make(srv, first_token_timeout_s=clock, between_tokens_timeout_s=clock)
    srv.push_faults(fault)
    t0 = time.monotonic()
    chunks, err = await collect(be, req())
    if cls is None:  # a provider error event before content: OpenAI's server_error, Anthropic's overloaded
        cls, status = (E.Overloaded, 503) if isinstance(srv, AnthropicServer) else (E.BackendUnavailable, 502)
    assert type(err) is cls and err.status_code == status, srv.stats().records
    assert len(chunks) == before and all(c.text and c.finish_reason is None for c in chunks)
    assert time.monotonic() - t0 < 2.0
    assert err.backend == be.backend_name
    assert pickle.loads(pickle.dumps(err)).status_code == status
    if fault == "429:3":
        assert err.retry_after_s == 3.0
    if cls in (E.InvalidRequest, E.NotFound):
        assert "refused on purpose" in err.message or "m" in err.message  # the provider's own message
    st = be.stats()
    assert st.running == 0 and st.extra["budget_in_flight"] == 0  # nothing leaked
    assert st.extra[f"errors_{cls.__name__}"] == 1
    if cls is E.ProviderAuthError:
        assert st.extra["auth_failures"] == 1


async def test_wrong_key_is_a_provider_auth_error(
    srv: LoopbackServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-wrong-key")
    be = make(srv)
    chunks, err = await collect(be, req())
    assert isinstance(err, E.ProviderAuthError) and err.status_code == 502 and not chunks
    assert be.stats().extra["auth_failures"] == 1


async def test_anthropic_truncated_stream(anthropic_srv: AnthropicServer) -> None:
    anthropic_srv.push_faults("no_done")
    chunks, err = await collect(make(anthropic_srv), req())
    assert isinstance(err, E.StreamInterrupted) and len(chunks) == 5


async def test_connect_refused() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = OpenAIServer(port=port)  # never started: only its URL is used
    chunks, err = await collect(make(dead), req())
    assert isinstance(err, E.BackendUnavailable) and err.action == E.Action.RETRY_ELSEWHERE and not chunks


async def test_total_timeout_and_request_deadline(openai_srv: OpenAIServer) -> None:
    openai_srv.push_faults("delay:0.3")
    be = make(openai_srv, total_timeout_s=1.0)
    chunks, err = await collect(be, req(max_tokens=8))
    assert isinstance(err, E.StreamInterrupted) and 1 <= len(chunks) <= 4
    r = req()
    r.deadline = time.time() + 0.3
    openai_srv.push_faults("hang")
    t0 = time.monotonic()
    _, err = await collect(make(openai_srv), r)
    assert isinstance(err, E.UpstreamTimeout) and time.monotonic() - t0 < 1.0


async def test_first_token_clock_ignores_bytes_that_are_not_content(srv: LoopbackServer) -> None:
    # slow_first sends the opening event (OpenAI's role chunk; message_start, ping) at once, then waits.
    srv.push_faults("slow_first:0.6")
    _, err = await collect(make(srv, first_token_timeout_s=0.3, between_tokens_timeout_s=5.0), req())
    assert isinstance(err, E.UpstreamTimeout)
    # Had the silence clock started at the opening bytes, 1 s of waiting would trip its 0.5 s.
    srv.push_faults("slow_first:1.0")
    chunks, err = await collect(make(srv, first_token_timeout_s=5.0, between_tokens_timeout_s=0.5), req())
    assert err is None and chunks[-1].finish_reason is not None


# ------------------------------------------------------------------------------------------------
# Cancellation closes the upstream
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["delay:0.2", "hang", "stall:1"])
async def test_cancelling_the_consumer_closes_the_upstream(srv: LoopbackServer, fault: str) -> None:
    be = make(srv, first_token_timeout_s=30, between_tokens_timeout_s=30)
    srv.push_faults(fault)
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in be.generate(req(max_tokens=100)):
            first.set()

    task = asyncio.create_task(consume())
    if fault == "hang":
        assert await wait_for(lambda: srv.stats().in_flight == 1)
    else:
        await asyncio.wait_for(first.wait(), 2.0)
    await asyncio.sleep(0.05)
    task.cancel()
    t0 = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_for(lambda: srv.stats().disconnects == 1, timeout=1.0), srv.stats()
    assert time.monotonic() - t0 < 1.0
    assert srv.stats().in_flight == 0
    st = be.stats()
    assert st.running == 0 and st.extra["budget_in_flight"] == 0


async def test_closing_the_iterator_closes_the_upstream(srv: LoopbackServer) -> None:
    be = make(srv)
    srv.push_faults("delay:0.2")
    gen = be.generate(req(max_tokens=100))
    assert (await anext(gen)).text
    await gen.aclose()  # the router stops reading (a hedge lost)
    assert await wait_for(lambda: srv.stats().disconnects == 1)
    assert be.stats().extra["budget_in_flight"] == 0


async def test_a_second_cancel_while_the_upstream_closes_still_frees_the_budget_slot(
    srv: LoopbackServer,
) -> None:
    """Issue 15 item 3: the cleanup used two shielded awaits in a row; a cancel landing during the
    first (closing the connection) skipped the second (the release), and the slot stayed taken
    until the reservation expired (the total timeout + 60 s). Cancel on every loop turn until done."""
    be = make(srv, max_in_flight=1, first_token_timeout_s=30, between_tokens_timeout_s=30)
    srv.push_faults("stall:2")
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in be.generate(req(max_tokens=100)):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 2.0)
    cancels = 0
    while not task.done():
        task.cancel()
        cancels += 1
        await asyncio.sleep(0)
    assert cancels >= 2  # the cleanup took loop turns: later cancels landed inside it
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_for(lambda: be.stats().extra["budget_in_flight"] == 0, timeout=2.0), be.stats()
    chunks, err = await collect(be, req("next", max_tokens=3))  # the one slot is free again
    assert err is None and chunks[-1].finish_reason is not None


@pytest.mark.parametrize("how", ["cancel", "stall"])
async def test_tokens_of_a_stream_that_ended_without_usage_are_counted_as_cancelled(
    srv: LoopbackServer, how: str
) -> None:
    """Issue 15 item 5: the provider bills a stream we cancelled (a client gone, a lost hedge) or
    gave up on (a stall): its prompt as sent and the output we received are counted, apart from the
    settled totals, and charged to the TPM window."""
    be = make(srv, tpm=100_000, first_token_timeout_s=5, between_tokens_timeout_s=0.3)
    seen: list[tuple[Any, ...]] = []
    be.on_unsettled = lambda r, usage, cost: seen.append((r.request_id, usage, cost))
    srv.push_faults("stall:3")
    texts: list[str] = []

    async def consume() -> None:
        async for c in be.generate(req("gone", max_tokens=100)):
            if c.text:
                texts.append(c.text)

    task = asyncio.create_task(consume())
    if how == "cancel":
        assert await wait_for(lambda: len(texts) == 3, timeout=2.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        with pytest.raises(E.ClusterError):
            await asyncio.wait_for(task, 5.0)
    assert len(texts) == 3
    extra = be.stats().extra
    out = be.counter.count("".join(texts))
    assert out > 0
    prompt = extra["cancelled_prompt_tokens_total"]
    assert prompt > 0 and extra["cancelled_completion_tokens_total"] == out
    assert extra["cancelled_requests"] == 1
    assert extra["prompt_tokens_total"] == 0 and extra["completion_tokens_total"] == 0  # not settled
    assert [(rid, u.prompt_tokens, u.completion_tokens) for rid, u, _ in seen] == [("gone", prompt, out)]
    assert extra["budget_window_tokens"] == prompt + out  # what the provider counts against the TPM

    chunks, err = await collect(be, req("done", max_tokens=3))  # a finished one is not "cancelled"
    assert err is None and chunks[-1].usage is not None
    assert be.stats().extra["cancelled_requests"] == 1 and len(seen) == 1


@pytest.mark.parametrize("fault", ["delay:0.2", "hang"])
async def test_abort_ends_the_stream_and_the_upstream(srv: LoopbackServer, fault: str) -> None:
    be = make(srv, first_token_timeout_s=30)
    srv.push_faults(fault)
    got: list[Chunk] = []

    async def consume() -> None:
        async for c in be.generate(req("to-abort", max_tokens=100)):
            got.append(c)

    task = asyncio.create_task(consume())
    assert await wait_for(lambda: srv.stats().in_flight == 1 and (fault == "hang" or len(got) >= 1))
    await be.abort("to-abort")
    await asyncio.wait_for(task, 2.0)
    assert got[-1].finish_reason == "abort" and got[-1].usage is not None
    assert await wait_for(lambda: srv.stats().disconnects == 1)
    assert be.stats().requests_aborted == 1


# ------------------------------------------------------------------------------------------------
# Budgets under load
# ------------------------------------------------------------------------------------------------


def _max_in_window(times_tokens: list[tuple[float, int]], width: float) -> tuple[int, int]:
    """The most requests, and the most tokens, that arrived within any interval of ``width``."""
    items = sorted(times_tokens)
    best_n = best_t = 0
    j = 0
    tokens = 0
    for i, (t, tok) in enumerate(items):
        tokens += tok
        while items[j][0] <= t - width:
            tokens -= items[j][1]
            j += 1
        best_n, best_t = max(best_n, i - j + 1), max(best_t, tokens)
    return best_n, best_t


class _RecordingBudget(LocalBudget):
    """The in-process budget, noting when each request was admitted."""

    def __init__(self, budget: ProviderBudget) -> None:
        super().__init__(budget)
        self.admitted_at: dict[str, float] = {}

    async def reserve(self, request_id: str, input_tokens: int, max_tokens: int, wait_s: float = 0.0) -> Any:
        adm = await super().reserve(request_id, input_tokens, max_tokens, wait_s)
        if isinstance(adm, Reservation):
            self.admitted_at[request_id] = time.monotonic()
        return adm


async def test_200_concurrent_calls_respect_rpm_tpm_and_in_flight(openai_srv: OpenAIServer) -> None:
    openai_srv.reset()
    openai_srv.default_fault = "delay:0.005,tokens:4"
    window, rpm, tpm, cap = 0.5, 50, 1000, 8
    be = make(
        openai_srv, tokenizer="estimate:4", wait_s=60.0, first_token_timeout_s=30, between_tokens_timeout_s=30
    )
    budget = be.budget = _RecordingBudget(
        ProviderBudget(rpm=rpm, tpm=tpm, max_in_flight=cap, window_s=window)
    )
    calls = (collect(be, req(f"c{i}", max_tokens=16)) for i in range(200))
    results = await asyncio.wait_for(asyncio.gather(*calls), 60)
    openai_srv.default_fault = None
    assert all(err is None and chunks[-1].finish_reason for chunks, err in results), (
        "no call may fail or hang"
    )
    stats = openai_srv.wait_settled()
    assert stats.requests == 200 and stats.in_flight == 0
    assert stats.max_in_flight <= cap
    # Every request the server counted was admitted by the budget; the server's token counts, placed
    # at their admission times, never exceed the limits in any window (arrival times would add the
    # admission-to-arrival lag, which a loaded machine stretches past the window itself).
    admitted = [(budget.admitted_at[r.client_request_id or ""], r) for r in stats.records]
    n, toks = _max_in_window([(t, r.prompt_tokens + r.completion_tokens) for t, r in admitted], window)
    assert n <= rpm and toks <= tpm, (n, toks)
    # The budget did bind: 200 calls could not all go at once.
    assert max(budget.admitted_at.values()) - min(budget.admitted_at.values()) >= 200 / rpm * window - window
    snap = be.stats()
    assert snap.running == 0 and snap.extra["budget_in_flight"] == 0 and snap.requests_finished == 200


async def test_server_in_flight_count_settles_after_the_client_finishes(openai_srv: OpenAIServer) -> None:
    """Defect 11 (a flaky in-flight count): the client has the whole answer before the server's
    handler returns. With the handler held open after its last byte, a plain ``stats()`` still
    counts the request (the race made deterministic); ``wait_settled`` waits it out."""
    openai_srv.reset()
    be = make(openai_srv)
    openai_srv.push_faults("linger:0.3")
    chunks, err = await collect(be, req("linger"))
    assert err is None and chunks[-1].finish_reason == "stop"
    assert openai_srv.stats().in_flight == 1  # the window the flaky test fell into
    settled = openai_srv.wait_settled(timeout_s=5.0)
    assert settled.in_flight == 0 and settled.records[-1].t_end is not None


async def test_over_budget_is_an_immediate_429(openai_srv: OpenAIServer) -> None:
    openai_srv.reset()
    openai_srv.default_fault = "delay:0.05"
    be = make(openai_srv, max_in_flight=4)
    results = await asyncio.gather(*(collect(be, req(f"d{i}")) for i in range(20)))
    openai_srv.default_fault = None
    errors = [err for _, err in results if err is not None]
    assert len(errors) == 16 and all(isinstance(e, E.RateLimited) and e.retry_after_s for e in errors)
    assert openai_srv.stats().max_in_flight == 4 and be.stats().extra["budget_denied"] == 16


# ------------------------------------------------------------------------------------------------
# The key never leaks
# ------------------------------------------------------------------------------------------------


def _everything_said(err: BaseException | None) -> str:
    parts = []
    while err is not None:
        parts += [str(err), repr(err), repr(getattr(err, "__dict__", {}))]
        if isinstance(err, E.ClusterError):  # what crosses processes (the cause stays behind)
            parts.append(repr(pickle.dumps(err)))
        err = err.__cause__ or err.__context__
    return "\n".join(parts)


async def test_the_key_is_nowhere(srv: LoopbackServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # every logger: ours, httpx, httpcore, asyncio
    be = make(srv, first_token_timeout_s=0.3, between_tokens_timeout_s=0.3)
    said = [repr(be), str(vars(be))]
    for fault in [None, "echo_key", "401", "429", "500", "error_event:1", "stall:1", "malformed:0", "drop:1"]:
        if fault:
            srv.push_faults(fault)
        chunks, err = await collect(be, req())
        said += [repr(chunks), _everything_said(err)]
        if err is not None:
            said.append(repr(err.to_openai()))
    said += [repr(be.stats())]
    echoed = [r for r in srv.stats().records if r.fault == "echo_key"]
    assert [r.outcome for r in echoed] == ["status:400"], srv.stats().records  # the server echoed the key
    text = "\n".join(said) + "\n".join(
        r.getMessage() + repr(r.args) + str(r.exc_text) for r in caplog.records
    )
    assert caplog.records, "the calls should have logged something"
    assert KEY not in text
    assert KEY[-12:] not in text


# ------------------------------------------------------------------------------------------------
# Token counting: the estimate's error is a number on the backend
# ------------------------------------------------------------------------------------------------


async def test_estimate_error_exposed(srv: LoopbackServer) -> None:
    be = make(srv)
    r = req()
    estimate = be.counter.count_chat(r.messages or [])
    _, err = await collect(be, r)
    assert err is None
    reported = srv.stats().records[-1].prompt_tokens
    extra = be.stats().extra
    assert extra["prompt_estimate_error_last"] == pytest.approx((estimate - reported) / reported)
    assert extra["prompt_estimate_samples"] == 1 and extra["tokenizer_exact"] == (srv.name == "openai")
    # The router's own count, when it sent one, is the reservation.
    _, err = await collect(be, req("r2", prompt_token_ids=list(range(40))))
    assert err is None
    assert be.stats().extra["prompt_estimate_error_last"] == pytest.approx((40 - reported) / reported)


def test_adapter_classes_by_api(openai_srv: OpenAIServer, anthropic_srv: AnthropicServer) -> None:
    assert isinstance(make(openai_srv), OpenAIProviderBackend)
    assert isinstance(make(anthropic_srv), AnthropicProviderBackend)


async def test_the_shared_client_carries_no_cookie_from_one_answer_to_the_next_request() -> None:
    """Every tenant's provider calls share one client: a Set-Cookie on one answer must not be sent
    with anyone's next request."""
    from aiohttp import web

    from deployments.providers.providers import shared_session

    seen: list[str | None] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("cookie"))
        resp = web.json_response({"ok": True})
        resp.set_cookie("session", "tenant-a-secret")
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        session = shared_session()
        for _ in range(2):
            async with session.get(f"http://127.0.0.1:{port}/") as r:
                assert r.headers.get("set-cookie", "").startswith("session=")
        assert seen == [None, None]
        assert len(session.cookie_jar) == 0
    finally:
        await runner.cleanup()
