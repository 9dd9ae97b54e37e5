"""Where the ingress sends one request, given the load it sees: pure functions.

* **Prompt placement** (conditional disaggregation by load): a prompt is prefilled on a
  decode replica when the prefill queue would break the TTFT SLO and the decode side has
  room within its TPOT SLO (``Policy.prompt_placement``). A prompt prefilled on a decode
  replica stalls that replica's decodes for its compute time, which adds ``stall / (output
  tokens - 1)`` to each decoding request's TPOT (TPOT is a mean over the request): the room
  is checked for the shortest request decoding there, from the observed TPOT p90 plus that
  share. At most ``max_prompts_per_replica`` prompts run there at once.
* **Lent replicas**: while prefill replicas are lent (role ``both``), a decode-heavy request
  (no more prompt tokens than output tokens) goes whole to the lent pool when it has fewer
  requests in flight per replica than the decode pool. A prompt-heavy one stays on the
  disaggregated path, so a lent replica's decodes are not stalled by long prompts it also
  decodes, and it drains sooner once reclaimed.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoscaling.policy import Policy


@dataclass(frozen=True, kw_only=True)
class PromptLoad:
    """The ingress's view when a prompt arrives (its own counts are exact, not sampled)."""

    prompt_tokens: int
    prefill_tokens_in_flight: int  # prompt tokens sent to the prefill pool, not back yet
    prefill_replicas: int
    decode_prompts_in_flight: int  # prompts prefilling on decode replicas now
    decode_replicas: int
    seconds_per_prompt_token: float | None  # measured prefill speed (None: not measured yet)
    tpot_p90_s: float | None = None  # observed over the policy's window
    decode_kv_usage: float | None = None
    decode_min_output_tokens: int | None = None  # the shortest request decoding on the decode pool (None: none)


@dataclass(frozen=True)
class Placement:
    on_decode: bool
    reason: str


def predicted_prefill_ttft_s(load: PromptLoad) -> float | None:
    """The queue ahead of this prompt at the prefill pool, plus its own compute."""
    if load.seconds_per_prompt_token is None or load.prefill_replicas <= 0:
        return None
    queued = load.prefill_tokens_in_flight / load.prefill_replicas
    return (queued + load.prompt_tokens) * load.seconds_per_prompt_token


def place_prompt(load: PromptLoad, policy: Policy) -> Placement:
    rule = policy.prompt_placement
    if not rule.enabled or load.decode_replicas <= 0:
        return Placement(False, "prompt placement off")
    if load.prefill_replicas <= 0:
        return Placement(False, "no prefill replica reported yet")
    predicted = predicted_prefill_ttft_s(load)
    if predicted is None:
        return Placement(False, "prefill speed not measured yet")
    limit_s = rule.ttft_slo_ratio * policy.slo.ttft_p90_ms / 1e3
    if predicted < limit_s:
        return Placement(False, f"predicted prefill TTFT {predicted:.2f}s < {limit_s:.2f}s")
    if load.decode_prompts_in_flight >= rule.max_prompts_per_replica * load.decode_replicas:
        return Placement(False, f"{load.decode_prompts_in_flight} prompts already prefilling on decode")
    if load.decode_kv_usage is not None and load.decode_kv_usage >= rule.max_kv_usage:
        return Placement(False, f"decode KV usage {load.decode_kv_usage:.2f} leaves no room")
    stall_s = load.prompt_tokens * load.seconds_per_prompt_token
    no_room = _tpot_room(load, stall_s, rule.max_tpot_slo_ratio * policy.slo.tpot_p90_ms / 1e3)
    if no_room is not None:
        return Placement(False, no_room)
    queued_s = load.decode_prompts_in_flight / load.decode_replicas * load.prompt_tokens
    if queued_s * load.seconds_per_prompt_token + stall_s >= predicted:
        return Placement(False, "no faster on decode")
    return Placement(True, f"predicted prefill TTFT {predicted:.2f}s >= {limit_s:.2f}s, decode has room")


def _tpot_room(load: PromptLoad, stall_s: float, limit_s: float) -> str | None:
    """Why the decodes in flight have no TPOT room for a stall of ``stall_s``; None: they have."""
    if load.decode_min_output_tokens is None:
        return None  # nothing decoding there: the stall delays no token
    if load.tpot_p90_s is None:
        return "decode TPOT not observed yet"
    expected_s = load.tpot_p90_s + stall_s / max(load.decode_min_output_tokens - 1, 1)
    if expected_s >= limit_s:
        return (
            f"decode TPOT p90 {load.tpot_p90_s * 1e3:.0f}ms + {stall_s:.2f}s stall over "
            f"{load.decode_min_output_tokens} tokens leaves no room"
        )
    return None


def decode_heavy(prompt_tokens: int, output_tokens: int) -> bool:
    """A request that belongs on a lent replica: no more prompt tokens than output tokens."""
    return prompt_tokens <= output_tokens


def prefer_lent(decode_in_flight: int, decode_replicas: int, lent_in_flight: int, lent_replicas: int) -> bool:
    """Send a whole request to the lent pool: it has fewer requests per replica."""
    if lent_replicas <= 0:
        return False
    if decode_replicas <= 0:
        return True
    return lent_in_flight / lent_replicas < decode_in_flight / decode_replicas
