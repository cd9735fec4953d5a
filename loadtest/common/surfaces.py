"""Request shapes per product surface, and the sessions that produce them.

* **Tab** (code completion as you type): ``/v1/completions`` with a short code prefix that grows
  a few tokens per keystroke burst, short outputs, a high request rate per user, a tight TTFT
  objective, and frequent cancels: the user keeps typing and the editor drops the request.
* **Chat**: ``/v1/chat/completions`` with a shared system prompt and a conversation that grows by
  one user and one assistant message per turn; medium outputs; people read between turns.
* **Agent**: a large repository context shared by every agent session (a money prefix for the
  cache), then turns that each append the model's previous answer and a tool result: prompts grow
  turn by turn, outputs are long, tool calls keep the think time short.

Pure and seeded: a :class:`Session` draws from the ``random.Random`` it is given; the text is
made of common words (about one token per word with Llama-style tokenizers), so token counts are
close to the numbers here. ``scale`` multiplies prompt and output sizes (small machines, tiny
models) and ``context_window`` keeps every request inside the model's window: the shared context is
clipped to 40 % of it, and a session whose history would overflow ends and a new one starts, as
an agent would compact its context.

In an open-loop benchmark the assistant's reply in the history is a synthetic text of the
requested length (the schedule is fixed before the run, so every configuration gets the same
requests); a closed-loop user (Locust) calls :meth:`Session.observe` with the real reply.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from loadtest.common.request_spec import Kind, RequestSpec

_WORDS = tuple(
    [
        "the",
        "a",
        "of",
        "to",
        "and",
        "in",
        "is",
        "for",
        "on",
        "that",
        "with",
        "as",
        "by",
        "at",
        "from",
        "this",
        "be",
        "are",
        "it",
        "or",
        "not",
        "we",
        "can",
        "return",
        "def",
        "if",
        "else",
        "self",
        "value",
        "data",
        "list",
        "name",
        "file",
        "error",
        "test",
        "user",
        "node",
        "item",
        "index",
        "result",
        "count",
    ]
)
_IDENTS = ("parse", "load", "items", "cache", "route", "token", "block", "score", "queue", "event", "batch")


@dataclass(frozen=True)
class SurfaceShape:
    """What one surface's requests look like (token counts before ``scale``)."""

    name: str
    kind: Kind
    shared_tokens: int  # context every session of the surface shares (repo, system prompt)
    prompt_tokens: tuple[int, int]  # a session's own first prompt (Tab: the file prefix)
    turn_tokens: tuple[int, int]  # what each later turn adds (keystrokes, a message, a tool result)
    output_tokens: tuple[int, int]
    turns: tuple[int, int]  # requests per session
    cancel_probability: float  # share of requests the client abandons mid-stream
    cancel_after_s: tuple[float, float]  # when it abandons them
    ttft_slo_ms: float  # default objective (a cluster config's surface overrides it)
    think_time_s: tuple[float, float]  # a closed-loop user's pause between requests
    weight: float  # share of arrivals in the mixed workload


SHAPES: dict[str, SurfaceShape] = {
    "tab": SurfaceShape(
        name="tab",
        kind="completion",
        shared_tokens=0,
        prompt_tokens=(200, 600),
        turn_tokens=(2, 12),
        output_tokens=(8, 48),
        turns=(4, 16),
        cancel_probability=0.35,
        cancel_after_s=(0.03, 0.25),
        ttft_slo_ms=100.0,
        think_time_s=(0.1, 0.6),
        weight=0.6,
    ),
    "chat": SurfaceShape(
        name="chat",
        kind="chat",
        shared_tokens=200,
        prompt_tokens=(20, 200),
        turn_tokens=(20, 200),
        output_tokens=(100, 400),
        turns=(1, 6),
        cancel_probability=0.02,
        cancel_after_s=(0.5, 3.0),
        ttft_slo_ms=1000.0,
        think_time_s=(2.0, 8.0),
        weight=0.3,
    ),
    "agent": SurfaceShape(
        name="agent",
        kind="chat",
        shared_tokens=3000,
        prompt_tokens=(100, 400),
        turn_tokens=(200, 800),
        output_tokens=(200, 1000),
        turns=(3, 10),
        cancel_probability=0.0,
        cancel_after_s=(0.0, 0.0),
        ttft_slo_ms=3000.0,
        think_time_s=(0.2, 1.0),
        weight=0.1,
    ),
}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(0, n)))


def code(rng: random.Random, n_tokens: int) -> str:
    """Python-looking lines of about ``n_tokens`` tokens."""
    lines: list[str] = []
    budget = n_tokens
    while budget > 0:
        a, b = rng.choice(_IDENTS), rng.choice(_IDENTS)
        k = rng.randrange(100)
        lines.append(f"def {a}_{b}_{k}(x):\n    return {b}(x) + {k}\n")
        budget -= 22
    return "".join(lines)


def shared_context(surface: str, n_tokens: int) -> str:
    """The text every session of a surface shares: the same for every run (its own fixed seed)."""
    rng = random.Random(f"shared-{surface}")
    if surface == "agent":
        return "You are a coding agent. Repository files follow.\n" + code(rng, n_tokens)
    return "You are a helpful assistant. " + words(rng, n_tokens)


def _draw(rng: random.Random, lo_hi: tuple[int, int], scale: float) -> int:
    lo, hi = lo_hi
    return max(1, round(rng.randint(lo, hi) * scale))


@dataclass
class Session:
    """A conversation (Chat, Agent) or an editing session (Tab): one request per :meth:`next`."""

    shape: SurfaceShape
    session_id: str
    rng: random.Random
    scale: float = 1.0
    context_window: int | None = None
    turns_left: int = 0
    turn: int = 0
    history: list[dict[str, str]] = field(default_factory=list)
    prefix: str = ""  # Tab: the file up to the cursor
    tokens: int = 0  # estimated prompt tokens so far
    _pending_reply: int = 0

    def __post_init__(self) -> None:
        s, rng = self.shape, self.rng
        self.turns_left = rng.randint(*s.turns)
        first = _draw(rng, s.prompt_tokens, self.scale)
        if s.kind == "completion":
            self.prefix = code(rng, first)
            self.tokens = first
        else:
            shared = round(s.shared_tokens * self.scale)
            if self.context_window is not None:  # a small model still gets a (smaller) shared context
                shared = min(shared, int(0.4 * self.context_window))
            if shared:
                self.history.append({"role": "system", "content": shared_context(s.name, shared)})
            self.history.append({"role": "user", "content": words(rng, first)})
            self.tokens = shared + first

    @property
    def done(self) -> bool:
        return self.turns_left <= 0

    def next(self, t: float = 0.0) -> RequestSpec | None:
        """The session's next request, or None when it is over (turns used, or the window full)."""
        if self.done:
            return None
        s, rng = self.shape, self.rng
        if self.turn > 0:
            self._grow()
        out = _draw(rng, s.output_tokens, self.scale)
        if self.context_window is not None:
            room = int(0.85 * self.context_window) - self.tokens - 32  # estimates run ~15 % low
            if room < 1 or (self.turn > 0 and room < out):
                self.turns_left = 0
                return None
            out = min(out, room)
        cancel = None
        if s.cancel_probability and rng.random() < s.cancel_probability:
            cancel = rng.uniform(*s.cancel_after_s)
        spec = RequestSpec(
            surface=s.name,
            kind=s.kind,
            session_id=self.session_id,
            turn=self.turn,
            max_tokens=out,
            messages=[dict(m) for m in self.history] if s.kind == "chat" else None,
            prompt=self.prefix if s.kind == "completion" else None,
            cancel_after_s=cancel,
            arrival_s=t,
            prompt_tokens_est=self.tokens,
        )
        self.turn += 1
        self.turns_left -= 1
        self._pending_reply = out
        return spec

    def observe(self, reply: str) -> None:
        """Use the real reply in the history (a closed-loop user) instead of a synthetic one."""
        if self.shape.kind == "chat" and self._pending_reply:
            self.history.append({"role": "assistant", "content": reply})
            self.tokens += max(1, len(reply.split()))
            self._pending_reply = 0

    def _grow(self) -> None:
        s, rng = self.shape, self.rng
        add = _draw(rng, s.turn_tokens, self.scale)
        if s.kind == "completion":  # the user typed a bit more (and accepted nothing)
            self.prefix += words(rng, add)
            self.tokens += add
            return
        if self._pending_reply:  # open loop: a synthetic reply of the requested length
            self.history.append({"role": "assistant", "content": words(rng, self._pending_reply)})
            self.tokens += self._pending_reply
            self._pending_reply = 0
        role_text = f"Tool result:\n{code(rng, add)}" if s.name == "agent" else words(rng, add)
        self.history.append({"role": "user", "content": role_text})
        self.tokens += add


def parse_mix(text: str) -> dict[str, float]:
    """``"tab=6,chat=3,agent=1"`` or a single surface name → normalized weights."""
    if text in SHAPES:
        return {text: 1.0}
    if text in ("mixed", "mix"):
        weights = {n: s.weight for n, s in SHAPES.items()}
    else:
        weights = {}
        for part in text.split(","):
            name, _, w = part.partition("=")
            name = name.strip()
            if name not in SHAPES:
                raise ValueError(f"unknown surface '{name}' (known: {', '.join(SHAPES)})")
            weights[name] = float(w) if w else 1.0
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("surface weights must add up to more than 0")
    return {k: v / total for k, v in weights.items()}


def schedule(
    times: list[float],
    mix: dict[str, float],
    *,
    seed: int = 0,
    scale: float = 1.0,
    context_window: int | None = None,
    shapes: dict[str, SurfaceShape] | None = None,
    sessions_per_surface: int = 8,
) -> list[RequestSpec]:
    """An open-loop workload: each arrival time gets a surface (by ``mix``) and the next request of
    one of that surface's live sessions (up to ``sessions_per_surface`` interleave; a finished
    session is replaced by a new one). Same arguments, same requests."""
    shapes = shapes or SHAPES
    rng = random.Random(seed)
    names = sorted(mix)
    cum: list[float] = []
    acc = 0.0
    for n in names:
        acc += mix[n]
        cum.append(acc)
    live: dict[str, list[Session]] = {n: [] for n in names}
    counter = 0
    out: list[RequestSpec] = []
    for t in times:
        x = rng.random() * acc
        name = next((n for n, c in zip(names, cum, strict=True) if x < c), names[-1])
        pool = live[name]
        spec = None
        for _ in range(4):  # a session that cannot continue is replaced, a few times at most
            if len(pool) < sessions_per_surface:
                counter += 1
                pool.append(
                    Session(
                        shapes[name],
                        f"{name}-{seed}-{counter}",
                        random.Random(rng.getrandbits(64)),
                        scale,
                        context_window,
                    )
                )
            sess = pool[rng.randrange(len(pool))]
            spec = sess.next(t)
            if sess.done:
                pool.remove(sess)
            if spec is not None:
                break
        if spec is not None:
            out.append(spec)
    return out


def iter_user_requests(
    surface: str,
    session_prefix: str,
    rng: random.Random,
    scale: float = 1.0,
    context_window: int | None = None,
) -> Iterator[tuple[Session, RequestSpec]]:
    """A closed-loop user's endless requests: one session after another (Locust users)."""
    n = 0
    while True:
        n += 1
        sess = Session(SHAPES[surface], f"{session_prefix}-{n}", rng, scale, context_window)
        while (spec := sess.next()) is not None:
            yield sess, spec
