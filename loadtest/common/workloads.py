"""Seeded workload generators for the benchmarks: lists of request specs, usable outside Locust.

Each request is a :class:`loadtest.common.request_spec.RequestSpec` (the one the surfaces' sessions make
too): a chat request, its session and group, and when to send it (``arrival_s``, seconds from the
start). Everything here is pure: the same arguments
and seed give the same specs on every machine, so several routers can be driven by exactly the same
workload, and no tokenizer is needed (lengths are in words; with the tiny local tokenizer a word of
the built-in vocabulary is 1.1 to 1.2 tokens, with Llama 3's about 1.3).

:class:`SharedPrefixWorkload` follows SGLang's *generated-shared-prefix* benchmark and llm-d's
*customer groups*: ``num_groups`` groups (customers, repositories), each with a long shared prefix —
its system prompt and its repository context — and sessions within the groups; every session is a
multi-turn conversation whose prompt grows by each turn's question and the previous answer, so turn
``k`` extends turn ``k - 1``'s prompt. An optional ``common_prefix_words`` prefix is shared by every
group (a product's own instructions and tool definitions). ``group_skew`` spreads the sessions over
the groups with Zipf weights (0: equal), so that some groups are hot.

Arrivals: requests are sent at the times of a Poisson process of ``rate`` per second; the sessions'
turns are interleaved in a seeded random order, the ``k``-th request of a session being its turn
``k``. A replayer that wants closed-loop sessions (a user asks the next question only once the
answer arrived) may hold a turn until the session's previous turn has ended; the specs do not.

The answers kept in a conversation's history are synthetic text, not what an engine produced, so a
follow-up turn's prompt shares its predecessor's prompt as a prefix but not the tokens generated in
between — as with replayed datasets (SGLang's multi-turn benchmarks, ShareGPT).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from loadtest.common import arrivals
from loadtest.common.request_spec import RequestSpec

# Common words of code and prose; almost all are one token of the tiny tokenizer (trained on
# Python's standard library), the rest two.
_VOCAB_TEXT = """the of and to in is that for it as with was on be by this are from or at an which but
    not have has self return value data name file error list type key def class import none true false object
    path line string result args test index number function module default format level count item
    items start end time mode size message text code buffer state get set new old first last next
    other base info node tree open close read write call run user group config option options parse
    check find match print source target output input stream token block cache server client request
    response header body status event handler queue task thread lock process signal socket address
    port host local global package version update create delete remove insert append extend copy move
    load save dump sort filter reduce map join split strip lower upper replace encode decode length
    width height offset limit"""
VOCAB: tuple[str, ...] = tuple(_VOCAB_TEXT.split())


def poisson_arrivals(n: int, rate: float, rng: random.Random, start_s: float = 0.0) -> list[float]:
    """``n`` arrival times of a Poisson process of ``rate`` per second (exponential gaps)."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    return arrivals.poisson(rate, n=n, seed=rng, start_s=start_s)


def words(rng: random.Random, n: int) -> str:
    """``n`` random vocabulary words, as one space-separated string."""
    return " ".join(rng.choices(VOCAB, k=n))


def zipf_shares(n: int, total: int, skew: float) -> list[int]:
    """``total`` items over ``n`` bins with weights ``1 / (i + 1) ** skew`` (largest remainder),
    every bin getting at least one while ``total >= n``."""
    if n <= 0:
        raise ValueError("n must be positive")
    weights = [1.0 / (i + 1) ** skew for i in range(n)]
    floor = 1 if total >= n else 0
    rest = total - floor * n
    exact = [rest * w / sum(weights) for w in weights]
    shares = [floor + math.floor(x) for x in exact]
    by_remainder = sorted(range(n), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


@dataclass(frozen=True, slots=True)
class SharedPrefixWorkload:
    """Groups with long shared prefixes, sessions within groups, multi-turn growing prompts."""

    num_groups: int = 8
    sessions_per_group: int = 4  # on average; group_skew moves sessions to the first groups
    turns: int = 4
    common_prefix_words: int = 0  # shared by every group (product instructions, tool definitions)
    system_prompt_words: int = 400  # per group
    context_words: int = 1600  # per group: the repository context after the system prompt
    question_words: int = 40  # per turn
    answer_words: int = 60  # per turn, kept in the history of later turns
    max_tokens: int = 32
    group_skew: float = 0.0  # Zipf exponent of sessions per group (0: equal)
    rate: float = 4.0  # requests per second, Poisson
    name: str = "g"  # prefix of group and session ids (tells two merged workloads apart)
    surface: str | None = None
    start_s: float = 0.0

    def params(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def num_sessions(self) -> int:
        return self.num_groups * self.sessions_per_group

    @property
    def num_requests(self) -> int:
        return self.num_sessions * self.turns

    def shared_prefix(self, group: int, rng: random.Random, common: str) -> str:
        gid = f"{self.name}{group}"
        parts = [common] if common else []
        parts.append(f"You are the coding assistant of team {gid}. {words(rng, self.system_prompt_words)}")
        parts.append(f"Repository {gid} context: {words(rng, self.context_words)}")
        return "\n\n".join(parts)

    def generate(self, seed: int) -> list[RequestSpec]:
        """The workload's requests in arrival order; the same seed gives the same list."""
        if self.num_groups <= 0 or self.sessions_per_group <= 0 or self.turns <= 0:
            raise ValueError("num_groups, sessions_per_group and turns must be positive")
        rng = random.Random(seed)
        common = words(rng, self.common_prefix_words) if self.common_prefix_words else ""
        prefixes = [self.shared_prefix(g, rng, common) for g in range(self.num_groups)]
        shares = zipf_shares(self.num_groups, self.num_sessions, self.group_skew)
        sessions = [g for g, k in enumerate(shares) for _ in range(k)]  # session index -> group
        order = [s for s in range(len(sessions)) for _ in range(self.turns)]
        rng.shuffle(order)
        times = poisson_arrivals(len(order), self.rate, rng, self.start_s)
        history: dict[int, list[dict[str, str]]] = {}
        turn_of: dict[int, int] = {}
        out: list[RequestSpec] = []
        for t, s in zip(times, order, strict=True):
            g = sessions[s]
            msgs = history.setdefault(s, [{"role": "system", "content": prefixes[g]}])
            k = turn_of.get(s, 0)
            if k:
                msgs.append({"role": "assistant", "content": words(rng, self.answer_words)})
            msgs.append({"role": "user", "content": f"Question {k + 1}: {words(rng, self.question_words)}"})
            turn_of[s] = k + 1
            out.append(
                RequestSpec(
                    arrival_s=t,
                    session_id=f"{self.name}{g}-s{s}",
                    messages=[dict(m) for m in msgs],
                    max_tokens=self.max_tokens,
                    group=f"{self.name}{g}",
                    turn=k,
                    surface=self.surface,
                )
            )
        return out


def merge(*workloads: Iterable[RequestSpec]) -> list[RequestSpec]:
    """Several workloads as one, in arrival order (stable for equal times)."""
    return sorted((r for w in workloads for r in w), key=lambda r: r.arrival_s)


def prompt_chars(spec: RequestSpec) -> int:
    return sum(len(m["content"]) for m in spec.messages or ())


def summary(specs: Sequence[RequestSpec]) -> dict[str, Any]:
    """Counts for a benchmark's metadata: requests, sessions, groups, duration, prompt sizes."""
    if not specs:
        return {"requests": 0}
    chars = sorted(prompt_chars(s) for s in specs)
    return {
        "requests": len(specs),
        "sessions": len({s.session_id for s in specs}),
        "groups": len({s.group for s in specs}),
        "duration_s": round(specs[-1].arrival_s - specs[0].arrival_s, 3),
        "prompt_chars_p50": chars[len(chars) // 2],
        "prompt_chars_max": chars[-1],
        "max_tokens_total": sum(s.max_tokens for s in specs),
    }
