import pickle

import pytest

from cluster.config import ModelConfig, parse_config
from cluster.policy.context import ContextDecision, fit_context, reserved_output
from cluster.wire.errors import Action, ContextLengthExceeded, InvalidRequest


def _m(name: str, window: int, overflow: str | None = None, default: int | None = None) -> ModelConfig:
    return ModelConfig(
        name=name,
        tokenizer="estimate:4",
        context_window=window,
        overflow_to=overflow,
        default_max_tokens=default,
    )


SMALL = _m("small", 100, "mid", default=16)
MID = _m("mid", 200, "big", default=64)
BIG = _m("big", 1000, None)
MODELS = {m.name: m for m in (SMALL, MID, BIG)}


class Counter:
    """count_tokens that returns fixed counts per model and records which were asked."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts
        self.calls: list[str] = []

    def __call__(self, model: str) -> int:
        self.calls.append(model)
        return self.counts[model]


def _fit(model, counts, max_tokens, models=MODELS, **kw):
    counter = Counter(counts)
    return fit_context(model, counter, max_tokens, models.get, **kw), counter.calls


# ---------------------------------------------------------------------------------------------
# Fits
# ---------------------------------------------------------------------------------------------


def test_fits_exactly():
    d, calls = _fit(SMALL, {"small": 50}, 50)
    assert d == ContextDecision("small", 50, 50, None)
    assert calls == ["small"]  # the overflow models are not tokenized


def test_no_max_tokens_gets_the_rest_of_the_window():
    # What OpenAI and vLLM promise: the answer runs until the model stops or the window ends.
    assert _fit(BIG, {"big": 100}, None)[0] == ContextDecision("big", 900, 100, None, None)
    assert _fit(BIG, {"big": 999}, None)[0] == ContextDecision("big", 1, 999, None, None)


def test_a_models_default_max_tokens_lowers_it_and_says_so():
    assert _fit(SMALL, {"small": 10}, None)[0] == ContextDecision("small", 16, 10, None, capped=16)


def test_default_max_tokens_shrinks_to_the_room_left():
    assert _fit(SMALL, {"small": 90}, None)[0] == ContextDecision("small", 10, 90, None)
    assert _fit(SMALL, {"small": 99}, None)[0] == ContextDecision("small", 1, 99, None)


# ---------------------------------------------------------------------------------------------
# The surface's output cap
# ---------------------------------------------------------------------------------------------


def test_surface_cap_lowers_the_default_and_is_reported():
    assert _fit(BIG, {"big": 100}, None, cap=50)[0] == ContextDecision("big", 50, 100, None, capped=50)
    # Below a model's own default too: the lower limit wins.
    assert _fit(SMALL, {"small": 10}, None, cap=8)[0] == ContextDecision("small", 8, 10, None, capped=8)


def test_surface_cap_lowers_an_explicit_larger_max_tokens_and_is_reported():
    assert _fit(BIG, {"big": 100}, 500, cap=50)[0] == ContextDecision("big", 50, 100, None, capped=50)


def test_explicit_max_tokens_at_or_below_the_cap_is_untouched():
    assert _fit(BIG, {"big": 100}, 20, cap=50)[0] == ContextDecision("big", 20, 100, None, None)
    assert _fit(BIG, {"big": 100}, 50, cap=50)[0] == ContextDecision("big", 50, 100, None, None)
    # A model's default_max_tokens never lowers what the client asked for.
    assert _fit(SMALL, {"small": 10}, 80)[0] == ContextDecision("small", 80, 10, None, None)


def test_a_cap_above_the_room_left_shortens_nothing():
    assert _fit(BIG, {"big": 980}, None, cap=50)[0] == ContextDecision("big", 20, 980, None, None)


def test_the_capped_ask_is_what_must_fit_the_window():
    # 50 + 80 overflows 'small', 50 + 40 fits it: the cap keeps the request where it was sent.
    d, calls = _fit(SMALL, {"small": 50}, 80, cap=40)
    assert d == ContextDecision("small", 40, 50, None, capped=40) and calls == ["small"]
    with pytest.raises(ContextLengthExceeded) as info:
        _fit(BIG, {"big": 990}, 500, cap=50)
    assert "(990 in the messages, 50 in the completion)" in info.value.message


def test_reservation_of_an_unasked_default_fits_the_budget():
    assert reserved_output(900, 100, None, asked=False) == 900  # no token budget: the whole rest
    assert reserved_output(900, 100, 10_000, asked=False) == 900  # fits the minute: all of it
    assert reserved_output(900, 100, 600, asked=False) == 500  # trimmed to what the minute holds
    assert reserved_output(900, 700, 600, asked=False) == 1  # the prompt alone is too large
    # What the client asked for is reserved whole, as a provider counts it.
    assert reserved_output(900, 100, 600, asked=True) == 900
    assert reserved_output(900, 100, 600, asked=True, n=3) == 2700  # each choice may use all of it
    assert reserved_output(900, 100, None, asked=False, n=2) == 1800
    assert reserved_output(900, 100, 1000, asked=False, n=2) == 900  # trimmed to the minute


# ---------------------------------------------------------------------------------------------
# Overflow
# ---------------------------------------------------------------------------------------------


def test_one_token_too_many_overflows():
    d, calls = _fit(SMALL, {"small": 50, "mid": 50}, 51)
    assert d == ContextDecision("mid", 51, 50, "small")
    assert calls == ["small", "mid"]


def test_prompt_filling_the_window_overflows_with_the_new_default():
    d, _ = _fit(SMALL, {"small": 100, "mid": 100}, None)
    assert d == ContextDecision("mid", 64, 100, "small", capped=64)


def test_overflow_counts_with_the_bigger_models_tokenizer():
    # 'mid' tokenizes the same text into more tokens: 150 + 60 > 200, so it goes on to 'big'.
    d, calls = _fit(SMALL, {"small": 60, "mid": 150, "big": 140}, 60)
    assert d == ContextDecision("big", 60, 140, "small")
    assert calls == ["small", "mid", "big"]
    # And the default completion is capped by the room the bigger tokenizer leaves.
    d, _ = _fit(SMALL, {"small": 100, "mid": 190, "big": 0}, None)
    assert d == ContextDecision("mid", 10, 190, "small")


def test_starting_midway_reports_that_model():
    d, _ = _fit(MID, {"mid": 150, "big": 150}, 100)
    assert d == ContextDecision("big", 100, 150, "mid")


def test_works_with_the_cluster_config_lookup():
    cfg = parse_config(
        {
            "models": [m.model_dump() for m in (SMALL, MID, BIG)],
            "backends": [{"name": "sim", "kind": "sim", "model": "small"}],
            "surfaces": [{"name": "chat"}],
        }
    )
    d = fit_context(cfg.model("small"), {"small": 300, "mid": 300, "big": 300}.__getitem__, 100, cfg.model)
    assert d == ContextDecision("big", 100, 300, "small")


# ---------------------------------------------------------------------------------------------
# Rejections
# ---------------------------------------------------------------------------------------------


def test_nothing_fits_gives_openai_style_400():
    with pytest.raises(ContextLengthExceeded) as info:
        _fit(BIG, {"big": 900}, 200)
    err = info.value
    assert err.status_code == 400
    assert err.code == "context_length_exceeded"
    assert err.error_type == "invalid_request_error"
    assert err.param == "messages"
    assert err.action is Action.CLIENT
    assert err.message == (
        "This model's maximum context length is 1000 tokens. However, you requested 1100 tokens "
        "(900 in the messages, 200 in the completion). "
        "Please reduce the length of the messages or completion."
    )
    assert err.to_openai()["error"]["code"] == "context_length_exceeded"


def test_nothing_fits_along_the_chain_names_every_model():
    with pytest.raises(ContextLengthExceeded) as info:
        _fit(SMALL, {"small": 900, "mid": 950, "big": 990}, 20)
    assert info.value.message == (
        "This model's maximum context length is 100 tokens. However, you requested 920 tokens "
        "(900 in the messages, 20 in the completion). "
        "Please reduce the length of the messages or completion. "
        "The models it overflows to do not fit it either: "
        "'mid' (maximum context length 200 tokens, 950 in the messages), "
        "'big' (maximum context length 1000 tokens, 990 in the messages)."
    )


def test_prompt_alone_filling_the_window_is_rejected():
    with pytest.raises(ContextLengthExceeded) as info:
        _fit(BIG, {"big": 1000}, None)
    assert info.value.message == (
        "This model's maximum context length is 1000 tokens. However, your messages resulted in 1000 tokens, "
        "which leaves no room for the completion. Please reduce the length of the messages."
    )


def test_completion_param_names_the_prompt():
    with pytest.raises(ContextLengthExceeded) as info:
        _fit(BIG, {"big": 990}, 20, param="prompt")
    assert info.value.param == "prompt"
    assert "(990 in the prompt, 20 in the completion)" in info.value.message


def test_cycle_ends_the_chain():
    a = _m("a", 10, "b")
    b = _m("b", 20, "a")
    models = {"a": a, "b": b}
    with pytest.raises(ContextLengthExceeded) as info:
        _fit(a, {"a": 50, "b": 50}, 1, models=models)
    assert "'b' (maximum context length 20 tokens" in info.value.message
    self_loop = _m("s", 10, "s")
    counter = Counter({"s": 50})
    with pytest.raises(ContextLengthExceeded):
        fit_context(self_loop, counter, 1, {"s": self_loop}.get)
    assert counter.calls == ["s"]


def test_cycle_does_not_stop_a_fit_before_it():
    a = _m("a", 10, "b")
    b = _m("b", 100, "a")
    d, calls = _fit(a, {"a": 50, "b": 50}, 1, models={"a": a, "b": b})
    assert d == ContextDecision("b", 1, 50, "a")
    assert calls == ["a", "b"]


def test_unknown_overflow_model_ends_the_chain():
    lonely = _m("lonely", 10, "ghost")
    with pytest.raises(ContextLengthExceeded):
        _fit(lonely, {"lonely": 50}, 1, models={"lonely": lonely})


def test_never_truncates_a_requested_max_tokens():
    with pytest.raises(ContextLengthExceeded):
        _fit(BIG, {"big": 500}, 501)
    assert _fit(BIG, {"big": 500}, 500)[0].max_tokens == 500


def test_bad_max_tokens_is_a_client_error():
    with pytest.raises(InvalidRequest) as info:
        _fit(SMALL, {"small": 1}, 0)
    assert info.value.param == "max_tokens"
    assert not isinstance(info.value, ContextLengthExceeded)


def test_error_pickles_with_its_fields():
    with pytest.raises(ContextLengthExceeded) as info:
        _fit(BIG, {"big": 2000}, 1)
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.message, again.param, again.code, again.status_code) == (
        info.value.message,
        "messages",
        "context_length_exceeded",
        400,
    )
