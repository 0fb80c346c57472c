"""The speculative decoding loop: one loop for every drafter kind, chains and trees alike.

    out = generate(target, input_ids, drafter=drafter, max_new_tokens=128)
    out.tokens  # (batch, new) the new token ids
    out.stats   # tau, acceptance per position, target passes, draft/verify seconds, ...

`drafter=None` is plain autoregressive decoding through this same loop (an empty draft every
step); `drafter="prompt_lookup"` is the training-free n-gram drafter.

Output is exact (greedy, or the target's distribution at T > 0) unless a Medusa drafter is asked
for typical acceptance (`acceptance="typical"`) at T > 0: then it is lossy, and the stats say so.

Invariants the loop keeps between steps: the target's KV cache holds the first `cached` tokens of
the sequence, and the tokens after them (`pending`: the whole prompt at first, then the last bonus
token, then sometimes more) are fed at the start of the next verification. So prefill is simply
the first step's pending tokens, and every target pass emits tokens.

Batch size is 1. The types are batch-shaped (DraftTree.tokens (batch, n), q (batch, n, vocab),
DraftContext.tokens (batch, seq)); batch > 1 would further need per-row trees (parents per row),
per-row accepted lengths, hence left padding with a padding-aware 4D mask and per-row position
ids, and compaction that gathers a different path per row into a common (padded) length.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from specdraft.core import (
    DecodeConfig,
    DraftContext,
    DraftTree,
    SamplingSettings,
    check_fingerprint,
    compact,
    eos_ids,
    owner_of,
    process_logits,
)
from specdraft.drafters.base import Drafter, hf_model_kind, warn_once
from specdraft.drafters.prompt_lookup import CopyingSession, PromptLookupDrafter
from specdraft.inference.metrics import Stats
from specdraft.inference.tree import tree_attention
from specdraft.inference.verify import verify_greedy, verify_sampling
from specdraft.targets.target import Target


@dataclass
class GenerateOutput:
    tokens: torch.Tensor  # (batch, new) new token ids, EOS included when one ended the output
    stats: Stats


@torch.no_grad()
def generate(
    target: Target,
    input_ids: torch.Tensor | list[int],
    drafter=None,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    decode: DecodeConfig | None = None,
    stop_at_eos: bool = True,
    **settings,
) -> GenerateOutput:
    """Decode up to `max_new_tokens` after `input_ids` (batch 1), stopping after an EOS token.

    drafter: None (plain decoding), "prompt_lookup", a drafter from `load_drafter`, or any HF
    causal LM sharing the target's vocabulary (drafts as a two-model drafter).
    temperature 0 is greedy: output equals the target's greedy decoding token for token. Above
    0, output follows the target's distribution after temperature, top-k and top-p exactly,
    except with acceptance="typical" (Medusa only), which is lossy (stats.lossy).
    decode: how the drafter drafts (specdraft.core.DecodeConfig, or its kind's subclass:
    `drafter.decode_class`); None: the kind's defaults. The settings a trained drafter was saved
    or tuned with are `load_decoding(path)`: pass them to decode as it was tuned. settings:
    decoding keys that override `decode` for this call, e.g. gamma=8, tree_top_k=4,
    lookup_ngram=2, or a kind's own (exit_layer=3 for LayerSkip). Then the batch_schedule
    entry for the batch decoded applies (off: plain decoding, and stats.drafter_off says so).
    stop_at_eos=False decodes max_new_tokens whatever they hold: the continuation past an EOS,
    which the simulation of serving compares drafts with (inference/continuations.py).
    """
    seq_ids = _check_inputs(target, input_ids, max_new_tokens, temperature, top_p, top_k)
    sampling = SamplingSettings(temperature=float(temperature), top_k=int(top_k), top_p=top_p)
    device = target.device
    generator = torch.Generator(device=device).manual_seed(seed)
    session, stats, decode = _start_session(
        target, drafter, sampling, generator, decode, settings, seq_ids.shape[0]
    )
    # a session's own acceptance rule (Medusa's typical) applies at temperature > 0 only; at 0
    # every rule is greedy verification: exact, nothing to mark
    stats.lossy = session is not None and session.lossy and not sampling.greedy
    log_p = torch.zeros((), dtype=torch.float64, device=device)  # sum of log p(emitted), T > 0
    eos = eos_ids(target.model) if stop_at_eos else set()
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    # 1. Buffers: the whole sequence lives in one preallocated row; the cache starts empty.
    prompt_len = seq_ids.shape[-1]
    seq = torch.empty(1, prompt_len + max_new_tokens, dtype=torch.long, device=device)
    seq[0, :prompt_len] = seq_ids.to(device)
    length, cached = prompt_len, 0
    # every layer keeps every key, sliding ones too, so the cache crops and compacts to an
    # accepted path (specdraft/attention.py); the masks apply each layer's window
    cache = DynamicCache()
    if session is not None:  # a drafter that drafts on the target's cache (LayerSkip) keeps it
        session.bind_cache(cache)
    no_draft = DraftTree.empty(device=device)
    capture = list(session.capture_layers) if session is not None else []
    start = time.perf_counter()
    while True:
        remaining = prompt_len + max_new_tokens - length
        # 2. Draft. One token is always the target's own, so a draft deeper than
        # remaining - 1 could never be emitted.
        t0 = time.perf_counter()
        tree = no_draft
        proposed = session is not None and remaining > 1
        if proposed:
            tree = session.propose(DraftContext(seq[:, :length], max_depth=remaining - 1))
            if __debug__:  # a drafter bug stops here, not as a wrong verification
                tree.check()
            sync()
        t1 = time.perf_counter()

        # 3. Verify: one target forward over pending tokens + tree, logits for root and nodes.
        n = len(tree)
        pending = length - cached
        inputs = seq[:, cached:length]
        if n:
            inputs = torch.cat([inputs, tree.tokens.to(device)], dim=1)  # (1, pending + n)
        # A session that drafted on the shared cache verifies its own draft (LayerSkip: the late
        # layers only); any other tree gets the full forward.
        out = session.verify(tree, n + 1) if session is not None else None
        if out is None:
            mask, positions = tree_attention(
                tree, cached, pending, target.dtype, device, target.attention
            )
            out = target.forward(
                inputs,
                attention_mask=mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                capture_layers=capture,
                logits_to_keep=n + 1,
            )
        logits = out.logits[0]  # (n + 1, vocab): the root (last pending token), then each node
        if sampling.greedy:
            path, next_token = verify_greedy(tree, logits.argmax(-1).tolist())
        else:
            p = process_logits(logits, sampling)  # (n + 1, vocab)
            own = session.verify_sampled(tree, p, generator) if session is not None else None
            path, next_token = own if own is not None else verify_sampling(tree, p, generator)

        # 4. Keep both caches on the accepted path; the new token stays pending.
        compact(cache, length, path)
        cached = length + len(path)
        t2 = time.perf_counter()
        if session is not None:  # hidden states: for drafters fed by the target's (EAGLE)
            session.accept(tree, path, out.hidden_states if capture else None)
        t3 = time.perf_counter()

        # 5. Emit accepted + bonus/correction, cut at the first EOS and at max_new_tokens.
        drafted = tree.tokens[0].tolist() if path else []
        new = [drafted[i] for i in path] + [next_token]
        new = new[:remaining]
        stop = len(new) == remaining
        for i, t in enumerate(new):
            if t in eos:
                new, stop = new[: i + 1], True
                break
        seq[0, length : length + len(new)] = torch.tensor(new, device=device)
        if not sampling.greedy:
            # emitted token j was chosen at row 0 (the root) or at its accepted parent node's row
            rows = ([0] + [1 + c for c in path])[: len(new)]
            log_p += p[rows, new].double().log().sum()  # stays on the device: no sync per step
            stats.log_p_tokens += len(new)
        length += len(new)
        stats.record_step(n, tree.depth, len(path), len(new))
        stats.draft_seconds += (t1 - t0) + (t3 - t2)
        stats.verify_seconds += t2 - t1
        if stop:
            break
    stats.total_seconds = time.perf_counter() - start
    stats.log_p_sum = float(log_p)
    if session is not None:
        stats.drafter_kv_bytes = session.extra_memory_bytes()
        stats.copies = isinstance(session, CopyingSession)
        stats.copied_passes = session.copied_passes
    return GenerateOutput(tokens=seq[:, prompt_len:length].clone(), stats=stats)


def _check_inputs(target, input_ids, max_new_tokens, temperature, top_p, top_k):
    """The prompt as a (1, L) tensor, or a clear error for input the loop cannot honour."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be (seq,) or (batch, seq); got shape {tuple(ids.shape)}")
    if ids.shape[0] != 1:
        raise NotImplementedError(
            f"generate decodes one sequence at a time; got a batch of {ids.shape[0]}. "
            "Call it once per prompt."
        )
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token (e.g. the BOS token)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit is not None and ids.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"the prompt ({ids.shape[1]} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
            f"the target's {limit} positions; shorten the prompt or ask for fewer new tokens"
        )
    if (ids < 0).any() or (ids >= target.vocab_size).any():
        raise ValueError(f"input_ids must be token ids in [0, {target.vocab_size})")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 is off), got {top_k}")
    return ids


def _start_session(target, drafter, sampling, generator, decode, settings, batch_size):
    """The drafting session for this call (None for plain decoding), fresh stats and the
    resolved decoding settings (None for plain decoding): those of the settings' batch_schedule
    entry for `batch_size` rows, which may turn the drafter off (stats.drafter_off)."""
    stats = Stats()
    settings = {k: v for k, v in settings.items() if v is not None}
    if drafter is None:
        given = {**(dataclasses.asdict(decode) if decode is not None else {}), **settings}
        for key, value in given.items():
            owner = owner_of(key)
            if owner is not None and value != getattr(owner(), key):
                raise ValueError(
                    f"{key}={value!r} needs a {owner.owner} drafter, and plain decoding "
                    f"(drafter=None) drafts nothing: pass a {owner.owner} drafter, or drop {key}"
                )
        if settings or decode is not None:
            raise ValueError(f"decoding settings {sorted(settings)} given without a drafter")
        return None, stats, None
    if isinstance(drafter, str):
        if drafter != "prompt_lookup":
            raise ValueError(
                f"unknown drafter {drafter!r}: pass None, 'prompt_lookup', a drafter from "
                "load_drafter(path, target), or an HF causal LM sharing the target's vocabulary"
            )
        drafter = PromptLookupDrafter()
    elif isinstance(drafter, PreTrainedModel):
        drafter = hf_model_kind()(drafter)
    elif not isinstance(drafter, Drafter):
        raise TypeError(
            f"drafter must be None, 'prompt_lookup', a Drafter or an HF causal LM; got "
            f"{type(drafter).__name__}"
        )
    check_fingerprint(
        drafter.target_fingerprint,
        target.fingerprint,
        f"this {drafter.kind} drafter",
    )
    # the kind's own settings class; another kind's setting is an error naming its owner
    decode = drafter.decode_settings(decode, **settings)
    scheduled = decode.for_batch(batch_size)  # an entry wins over the call's settings: say so
    for key in sorted(k for k in settings if k != "batch_schedule"):
        if scheduled is None or getattr(scheduled, key) != getattr(decode, key):
            warn_once(
                f"{key}={settings[key]!r} is overridden at batch size {batch_size} by the "
                "decoding settings' batch_schedule; pass batch_schedule=[] to decode without it"
            )
    if scheduled is None:  # the schedule's entry for this batch size: plain decoding
        stats.drafter_off = True
        return None, stats, None
    decode = scheduled
    drafter.check_decode(decode)  # a setting out of this drafter's range
    for message in drafter.ignored_settings(decode):
        warn_once(message)
    session = drafter.new_session(target, sampling=sampling, decode=decode, generator=generator)
    if decode.lookup_ngram > 0 and not isinstance(drafter, PromptLookupDrafter):
        session = CopyingSession(session, decode.lookup_ngram, decode.lookup_gamma or decode.gamma)
    stats.drafter_params = drafter.num_extra_parameters(target)
    return session, stats, decode
