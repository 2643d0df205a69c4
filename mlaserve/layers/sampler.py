"""The sampler: per-request penalties, logit bias, min_new_tokens, temperature, top-k / top-p / min-p and seeded draws.

Legend: `B` requests (one logits row each), `V` vocabulary, `k` top log-probs asked for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from mlaserve.core import SamplingParams
from mlaserve.kernels.sampling import greedy_ids, gumbel_argmax, gumbel_argmax_ref

GREEDY_EPS = 1e-5   # temperatures below this are treated as 0 (dividing by them overflows fp32 logits)


def _wrap_int64(x: int) -> int:
    """Any Python int -> the int64 with the same low 64 bits (user seeds may be negative or huge)."""
    return (x + 2**63) % 2**64 - 2**63


def _index_rows(id_lists: list[list[int]], vocab_size: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row token lists into (rows, ids): two [N] int64 tensors on `device`."""
    lens = [len(ids) for ids in id_lists]
    flat = [t for ids in id_lists for t in ids]
    assert all(0 <= t < vocab_size for t in flat), f"token ids must be in [0, {vocab_size})"
    rows = torch.tensor([b for b, n in enumerate(lens) for _ in range(n)], dtype=torch.int64)   # no repeat_interleave: ms on the CPU
    return rows.to(device), torch.tensor(flat, dtype=torch.int64, device=device)


def _token_mask(id_lists: list[list[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[B, V] bool: True at the ids of each row's list."""
    rows, ids = _index_rows(id_lists, vocab_size, device)
    mask = torch.zeros(len(id_lists), vocab_size, dtype=torch.bool, device=device)
    mask[rows, ids] = True
    return mask


def _stop_ids(p: SamplingParams, eos_token_ids: list[int], vocab_size: int) -> list[int]:
    """Ids masked while a request is below min_new_tokens: its stop_token_ids, and eos unless ignore_eos."""
    if p.min_new_tokens == 0:
        return []
    ids = (p.stop_token_ids or []) + ([] if p.ignore_eos else eos_token_ids)
    return [t for t in ids if 0 <= t < vocab_size]


def _bias_rows(biases: list[dict[int, float]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[B, V] f32: each row's logit_bias scattered into zeros."""
    rows, ids = _index_rows([list(b) for b in biases], vocab_size, device)
    values = torch.tensor([v for b in biases for v in b.values()], dtype=torch.float32, device=device)
    out = torch.zeros(len(biases), vocab_size, dtype=torch.float32, device=device)
    out[rows, ids] = values
    return out


@dataclass
class SamplingBatch:
    """Per-batch sampling tensors, built for each step's batch (`build`).

    All [B] tensors live on the logits' device. Optional [B, V] tensors are None when no row needs them.
    """

    temperatures: torch.Tensor            # [B] f32 (rows in `greedy` are never divided by it)
    top_ps: torch.Tensor                  # [B] f32 in (0, 1]
    top_ks: torch.Tensor                  # [B] int32, V for "off"
    min_ps: torch.Tensor                  # [B] f32 in [0, 1]
    repetition_penalties: torch.Tensor    # [B] f32, 1 for "off"
    frequency_penalties: torch.Tensor     # [B] f32
    presence_penalties: torch.Tensor      # [B] f32
    seeds: torch.Tensor                   # [B] int64
    steps: torch.Tensor                   # [B] int64: tokens generated so far by the request (RNG counter)
    min_new_tokens: torch.Tensor          # [B] int64
    greedy: torch.Tensor                  # [B] bool: temperature == 0 or top_k == 1
    vocab_size: int
    all_greedy: bool
    need_penalties: bool
    need_top_p_k_min_p: bool
    token_counts: torch.Tensor | None = None   # [B, V] int32: count of each token in the request's output
    seen_mask: torch.Tensor | None = None      # [B, V] bool: token in prompt or output (repetition penalty)
    stop_mask: torch.Tensor | None = None      # [B, V] bool: eos / stop_token_ids of rows with min_new_tokens
    logit_bias: torch.Tensor | None = None     # [B, V] f32: added to the logits (OpenAI logit_bias)
    token_bitmask: torch.Tensor | None = None  # [B, W] int32: allowed tokens (structured output), bit t of row b

    @property
    def batch_size(self) -> int:
        return self.seeds.shape[0]

    @property
    def min_tokens_mask(self) -> torch.Tensor | None:
        """[B, V] bool: tokens to mask with -inf now (stop ids of rows with steps < min_new_tokens)."""
        if self.stop_mask is None:
            return None
        return self.stop_mask & (self.steps < self.min_new_tokens)[:, None]

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], steps: list[int], prompt_ids: list[list[int]],
              output_ids: list[list[int]], vocab_size: int, eos_token_ids: list[int],
              device: torch.device | str) -> SamplingBatch:
        """Gather the per-request controls of a batch into tensors.

        Args:
            params: one SamplingParams per request.
            seeds: the request's sampling seed (RequestSpec.seed: its own or one the server drew), kept for
                its lifetime.
            steps: tokens generated so far per request (== len(output_ids[b]) in the usual case).
            prompt_ids / output_ids: token ids so far (for penalties); only read when a row needs them.
            eos_token_ids: the model's eos ids; masked, with each row's stop_token_ids, while
                steps < min_new_tokens (eos is not masked for rows with ignore_eos).
        """
        b = len(params)
        assert len(seeds) == len(steps) == len(prompt_ids) == len(output_ids) == b, "one entry per request"

        def f32(vals: list[float]) -> torch.Tensor:
            return torch.tensor(vals, dtype=torch.float32, device=device)

        greedy = [p.temperature < GREEDY_EPS or p.top_k == 1 for p in params]
        top_ks = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        filtering = [not g and (p.top_p < 1 or k < vocab_size or p.min_p > 0)
                     for p, g, k in zip(params, greedy, top_ks)]
        need_rep = any(r != 1 for r in rep)
        need_counts = any(f != 0 or q != 0 for f, q in zip(freq, pres))
        batch = cls(
            temperatures=f32([p.temperature for p in params]),
            top_ps=f32([p.top_p for p in params]),
            top_ks=torch.tensor(top_ks, dtype=torch.int32, device=device),
            min_ps=f32([p.min_p for p in params]),
            repetition_penalties=f32(rep), frequency_penalties=f32(freq), presence_penalties=f32(pres),
            seeds=torch.tensor([_wrap_int64(s) for s in seeds], dtype=torch.int64, device=device),
            steps=torch.tensor(steps, dtype=torch.int64, device=device),
            min_new_tokens=torch.tensor([p.min_new_tokens for p in params], dtype=torch.int64, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            vocab_size=vocab_size, all_greedy=all(greedy),
            need_penalties=need_rep or need_counts, need_top_p_k_min_p=any(filtering),
        )
        if need_counts:
            rows, ids = _index_rows(output_ids, vocab_size, device)
            batch.token_counts = torch.zeros(b, vocab_size, dtype=torch.int32, device=device)
            batch.token_counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        if need_rep:
            batch.seen_mask = _token_mask([p + o for p, o in zip(prompt_ids, output_ids)], vocab_size, device)
        if any(p.logit_bias for p in params):
            batch.logit_bias = _bias_rows([p.logit_bias or {} for p in params], vocab_size, device)
        if any(p.min_new_tokens > s for p, s in zip(params, steps)):
            batch.stop_mask = _token_mask([_stop_ids(p, eos_token_ids, vocab_size) for p in params],
                                          vocab_size, device)
        return batch


class SampleOutput(NamedTuple):
    next_ids: torch.Tensor                                        # [B] int64
    logprobs: torch.Tensor | None                                 # [B] f32: raw log-prob of next_ids
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None        # (values [B, k] f32 descending, ids [B, k] int64)


def logprobs_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[n, ids[n]] of the RAW distribution. logits: [N, V], ids: [N] -> [N] f32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, ids.long()[:, None]).squeeze(1)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest raw log-probs per row, descending: (values [N, k] f32, ids [N, k] int64)."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1, sorted=True)
    return values, ids


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Copy of logits [B, V] with the tokens whose bit is clear in bitmask [B, W] (W = ceil(V / 32) int32 words,
    bit t % 32 of word t // 32 for token t) set to -inf."""
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :logits.shape[1]]     # [B, V]
    return logits.masked_fill(~allowed, float("-inf"))


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Penalised copy of logits [B, V]: repetition first, then frequency and presence.

    Repetition (CTRL, Keskar et al. 2019), for tokens in prompt or output: x / r if x > 0 else x * r.
    Frequency and presence (OpenAI), on the output so far: x - f * count - p * (count > 0).
    """
    x = logits
    if batch.seen_mask is not None:
        r = batch.repetition_penalties[:, None]                               # [B, 1]
        x = torch.where(batch.seen_mask, torch.where(x > 0, x / r, x * r), x)
    if batch.token_counts is not None:
        counts = batch.token_counts.float()                                   # [B, V]
        x = x - batch.frequency_penalties[:, None] * counts - batch.presence_penalties[:, None] * (counts > 0).float()
    return x


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                            min_ps: torch.Tensor) -> torch.Tensor:
    """Filtered copy of temperature-scaled logits [B, V]: removed tokens become -inf.

    top-k keeps the k largest (ties: lower id first). top-p keeps the smallest prefix of the sorted
    top-k-renormalised probs whose mass reaches top_p (so the top token always survives; top_p == 1 is off).
    min-p drops tokens with p < min_p * p_max (the ratio does not depend on renormalisation).
    """
    sorted_x, order = torch.sort(logits, dim=-1, descending=True, stable=True)   # [B, V]
    rank = torch.arange(logits.shape[1], device=logits.device)
    remove = rank[None, :] >= top_ks[:, None]
    sorted_x = sorted_x.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)                                      # [B, V], descending
    mass_before = probs.cumsum(dim=-1) - probs                                   # exclusive: 0 at rank 0
    remove |= (mass_before >= top_ps[:, None]) & (top_ps[:, None] < 1)
    remove |= probs < min_ps[:, None] * probs[:, :1]
    return torch.empty_like(logits).scatter_(1, order, sorted_x.masked_fill(remove, float("-inf")))


class Sampler:
    """Turns the last-token logits of a batch into next token ids (and raw log-probs when asked).

    Per row, in order: penalties -> logit bias -> min_new_tokens masking of stop ids -> grammar bitmask -> temperature -> top-k -> top-p ->
    min-p -> Gumbel-max draw keyed by (seed, step, token id). Greedy rows (temperature 0 or top_k 1) take
    the argmax of the penalised logits (ties: lowest id). A request's token depends only on its own logits,
    params, seed and step: never on the other requests of the batch or on its row.
    Returned log-probs are of the RAW model distribution, log_softmax(logits), before any of the above.
    """

    def __init__(self, use_triton: bool = False) -> None:
        self.use_triton = use_triton      # the Triton draw kernel, else its torch reference (the model's kernel set)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, *, return_logprob: bool = False,
                 top_logprobs_num: int = 0) -> SampleOutput:
        """Sample one token per row. logits: [B, V] float32 -> SampleOutput (see the class docstring)."""
        assert logits.dim() == 2 and logits.dtype == torch.float32, \
            f"logits must be [B, V] float32, got {tuple(logits.shape)} {logits.dtype}"
        assert logits.shape == (batch.batch_size, batch.vocab_size), \
            f"logits {tuple(logits.shape)} do not match the batch ({batch.batch_size}, {batch.vocab_size})"
        x = apply_penalties(logits, batch) if batch.need_penalties else logits
        if batch.logit_bias is not None:
            x = x + batch.logit_bias
        stop = batch.min_tokens_mask
        if stop is not None:
            x = x.masked_fill(stop, float("-inf"))
        if batch.token_bitmask is not None:
            x = apply_token_bitmask(x, batch.token_bitmask)
        next_ids = greedy_ids(x, self.use_triton) if batch.all_greedy else self._sample(x, batch)
        if not (return_logprob or top_logprobs_num > 0):
            return SampleOutput(next_ids, None, None)
        logp = torch.log_softmax(logits, dim=-1)                                  # [B, V] raw
        chosen = logp.gather(1, next_ids[:, None]).squeeze(1) if return_logprob else None
        top = tuple(logp.topk(top_logprobs_num, dim=-1, sorted=True)) if top_logprobs_num > 0 else None
        return SampleOutput(next_ids, chosen, top)

    def _sample(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # x: [B, V] penalised + masked logits -> [B] int64
        temps = torch.where(batch.greedy, torch.ones_like(batch.temperatures), batch.temperatures)
        scaled = x / temps[:, None]
        if batch.need_top_p_k_min_p:
            scaled = apply_top_k_top_p_min_p(scaled, batch.top_ks, batch.top_ps, batch.min_ps)
        draw = gumbel_argmax if self.use_triton else gumbel_argmax_ref
        sampled = draw(scaled.contiguous(), batch.seeds, batch.steps)
        return torch.where(batch.greedy, greedy_ids(x, self.use_triton), sampled)
