"""One provider adapter's running counts: requests, errors, settled and unsettled usage and cost, and
how far our prompt estimate is from what the provider reports. What ``stats().extra`` exports."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.wire.protocol import Usage

EWMA_ALPHA = 0.1


@dataclass
class ProviderCounters:
    started: int = 0
    finished: int = 0
    aborted: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    auth_failures: int = 0
    budget_denied: int = 0
    usage_estimated: int = 0  # streams the provider reported no usage for
    cost_usd_total: float = 0.0
    prompt_tokens_total: int = 0
    completion_tokens_total: int = 0
    # streams that reached the provider and ended without usage (cancels, stalls, breaks)
    cancelled_requests: int = 0
    cancelled_prompt_tokens_total: int = 0
    cancelled_completion_tokens_total: int = 0
    cancelled_cost_usd_total: float = 0.0
    # (our input estimate - the provider's prompt_tokens) / the provider's: > 0 over-reserves
    est_err_last: float | None = None
    est_err_ewma: float | None = None
    est_abs_err_sum: float = 0.0
    est_samples: int = 0

    def settled(self, usage: Usage, cost: float) -> None:
        self.cost_usd_total += cost
        self.prompt_tokens_total += usage.prompt_tokens
        self.completion_tokens_total += usage.completion_tokens
        self.finished += 1

    def unsettled(self, usage: Usage, cost: float) -> None:
        self.cancelled_requests += 1
        self.cancelled_prompt_tokens_total += usage.prompt_tokens
        self.cancelled_completion_tokens_total += usage.completion_tokens
        self.cancelled_cost_usd_total += cost

    def error(self, name: str, *, auth: bool) -> None:
        self.errors[name] = self.errors.get(name, 0) + 1
        if auth:
            self.auth_failures += 1

    def observe_estimate(self, estimate: int, reported: int) -> None:
        if reported <= 0:
            return
        err = (estimate - reported) / reported
        self.est_err_last = err
        self.est_err_ewma = (
            err if self.est_err_ewma is None else (1 - EWMA_ALPHA) * self.est_err_ewma + EWMA_ALPHA * err
        )
        self.est_abs_err_sum += abs(err)
        self.est_samples += 1

    def extra(self) -> dict[str, float | None]:
        """Flat numbers for metrics, in the order ``stats().extra`` has always listed them."""
        out: dict[str, float | None] = {
            "prompt_estimate_error": self.est_err_ewma,
            "prompt_estimate_error_last": self.est_err_last,
            "prompt_estimate_abs_error_mean": self.est_abs_err_sum / self.est_samples
            if self.est_samples
            else None,
            "prompt_estimate_samples": self.est_samples,
            "usage_estimated": self.usage_estimated,
            "cost_usd_total": self.cost_usd_total,
            "prompt_tokens_total": self.prompt_tokens_total,
            "completion_tokens_total": self.completion_tokens_total,
            "cancelled_requests": self.cancelled_requests,
            "cancelled_prompt_tokens_total": self.cancelled_prompt_tokens_total,
            "cancelled_completion_tokens_total": self.cancelled_completion_tokens_total,
            "cancelled_cost_usd_total": self.cancelled_cost_usd_total,
            "auth_failures": self.auth_failures,
            "budget_denied": self.budget_denied,
        }
        out.update({f"errors_{name}": n for name, n in self.errors.items()})
        return out
