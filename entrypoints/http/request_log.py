"""`--enable-log-requests` (vLLM's flag): one INFO line per accepted request with its id and sizes; never the
prompt or the output text."""

from __future__ import annotations

import logging

from ...sampling_params import SamplingParams

logger = logging.getLogger("replayllm.requests")


def enable_request_log(enabled: bool) -> None:
    logger.setLevel(logging.INFO if enabled else logging.WARNING)


def log_request(request_id: str, prompt_lens: list[int], params: SamplingParams) -> None:
    if not logger.isEnabledFor(logging.INFO):
        return
    trace_token_ids = params.trace_decode_token_ids
    logger.info("request %s: %d prompt(s) of %s tokens, n=%d, max_tokens=%s, temperature=%g, logprobs=%s%s",
                request_id, len(prompt_lens), prompt_lens, params.n, params.max_tokens, params.temperature,
                params.logprobs, f", trace of {len(trace_token_ids)} tokens" if trace_token_ids is not None else "")
