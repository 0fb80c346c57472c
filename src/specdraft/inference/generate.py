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

A batch of prompts (of any lengths) decodes in the same loop body (`_decode`), and one prompt is
a batch of one: every step drafts for each row, verifies every row's pending tokens and tree in
one target forward, and accepts per row; rows accept different numbers of tokens and stop on
their own (EOS, max_new_tokens), and a finished row leaves the batch. The target's cache is one
cache whose rows hold their own tokens in their own columns (specdraft/batch.py, `BatchCache`),
or for one prompt a plain cache cropped to each accepted path (inference/tree.py,
`SequenceCache`); the drafter's is its session's (`Drafter.new_batch_session` for a batch, one
`new_session` in a `RowSessions` for a prompt alone). Each row's output is what decoding it
alone gives (greedy: token for token; sampled: the target's distribution).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdraft.batch import BatchCache
from specdraft.core import (
    DecodeConfig,
    DraftContext,
    DraftTree,
    SamplingSettings,
    check_fingerprint,
    eos_ids,
    owner_of,
)
from specdraft.drafters.base import Drafter, hf_model_kind, warn_once
from specdraft.drafters.prompt_lookup import CopyingRows, PromptLookupDrafter
from specdraft.drafters.sessions import BatchSession, OneRow, RowSessions
from specdraft.drafting import process_logits
from specdraft.inference.metrics import Stats
from specdraft.inference.tree import SequenceCache
from specdraft.inference.verify import verify_greedy, verify_sampling
from specdraft.targets.target import Target


@dataclass
class GenerateOutput:
    # (batch, new) new token ids, EOS included when one ended a row's output; a row shorter than
    # the longest is padded on the right with `pad_id` up to its length in `lengths`
    tokens: torch.Tensor
    stats: Stats  # every row's (merged: tau per row pass, tokens_per_s of the whole batch)
    lengths: list[int] = dataclasses.field(default_factory=list)  # new tokens of each row
    row_stats: list[Stats] = dataclasses.field(default_factory=list)  # each row's own
    pad_id: int = 0

    def rows(self) -> list[list[int]]:
        """Each row's new token ids, without padding."""
        return [row[:n] for row, n in zip(self.tokens.tolist(), self.lengths, strict=True)]


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
    """Decode up to `max_new_tokens` after each prompt of `input_ids`, stopping after an EOS.

    input_ids: one prompt ((seq,) or (1, seq) ids), or a batch: a (batch, seq) tensor or a list
    of prompts of any lengths, decoded together (each row as it would decode alone).

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
    which the simulation of serving compares drafts with (simulation/continuations.py).
    """
    prompts = _check_inputs(target, input_ids, max_new_tokens, temperature, top_p, top_k)
    sampling = SamplingSettings(temperature=float(temperature), top_k=int(top_k), top_p=top_p)
    generator = torch.Generator(device=target.device).manual_seed(seed)
    session, stats, decode = _start_session(
        target, drafter, sampling, generator, decode, settings, len(prompts)
    )
    return _decode(
        target, prompts, session, stats, sampling, generator, max_new_tokens, stop_at_eos
    )


def _emitted(
    tree: DraftTree, path: list[int], next_token: int, remaining: int, eos: set[int]
) -> tuple[list[int], bool]:
    """The tokens a step emits (the accepted path's, then the target's own), cut at the first
    EOS and at the `remaining` tokens allowed, and whether the row is done."""
    drafted = tree.tokens[0].tolist() if path else []
    new = ([drafted[i] for i in path] + [next_token])[:remaining]
    stop = len(new) == remaining
    for i, t in enumerate(new):
        if t in eos:
            return new[: i + 1], True
    return new, stop


def _pad_id(target: Target) -> int:
    """What pads a shorter row's output (and a padding query's input): the target's pad token,
    else its first EOS, else 0, as transformers' generate pads."""
    pad = getattr(target.config, "pad_token_id", None)
    if pad is None:
        eos = eos_ids(target.model)
        pad = min(eos) if eos else 0
    return int(pad)


def _decode(
    target: Target,
    prompts: list[torch.Tensor],
    session: BatchSession | None,
    stats: Stats,
    sampling: SamplingSettings,
    generator: torch.Generator,
    max_new_tokens: int,
    stop_at_eos: bool,
) -> GenerateOutput:
    """The loop (module docstring), for every active row at once."""
    device, rows = target.device, len(prompts)
    eos = eos_ids(target.model) if stop_at_eos else set()
    pad = _pad_id(target)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    prompt_len = [len(p) for p in prompts]
    seq = torch.full((rows, max(prompt_len) + max_new_tokens), pad, dtype=torch.long, device=device)
    for r, prompt in enumerate(prompts):
        seq[r, : prompt_len[r]] = prompt.to(device)
    length, cached = list(prompt_len), [0] * rows
    active = list(range(rows))  # the batch's row of each active row
    # every layer keeps every key, sliding ones too, so the cache crops and compacts to an
    # accepted path (specdraft/attention.py); the masks apply each layer's window
    cache = SequenceCache(device) if rows == 1 else BatchCache(rows, device)
    if session is not None:  # a drafter that drafts on the target's cache (LayerSkip) keeps it
        session.bind_cache(cache.cache)
    row_stats = [Stats() for _ in range(rows)]
    log_p = torch.zeros(rows, dtype=torch.float64, device=device)  # sum of log p(emitted), T > 0
    capture = list(session.capture_layers) if session is not None else []
    no_draft = DraftTree.empty(device=device)
    peak_memory = 0
    start = time.perf_counter()
    while active:
        # 1. Draft. One token is always the target's own, so a draft deeper than
        # remaining - 1 could never be emitted.
        remaining = [prompt_len[r] + max_new_tokens - length[r] for r in active]
        t0 = time.perf_counter()
        trees = [no_draft] * len(active)
        if session is not None:
            trees = _drafted(session, [seq[r : r + 1, : length[r]] for r in active], remaining)
            sync()
        t1 = time.perf_counter()

        # 2. Verify: one forward over every row's pending tokens and tree, logits for each
        # row's root (its last pending token) and nodes. A session that drafted on the shared
        # cache verifies its own draft (LayerSkip: the late layers only).
        pending = [seq[r, cached[r] : length[r]] for r in active]
        ids, mask, positions, P, N = cache.verification_inputs(
            pending, trees, target.dtype, target.attention, pad
        )
        out = session.verify(trees, N + 1) if session is not None else None
        if out is None:
            out = target.forward(
                ids,
                attention_mask=mask,
                position_ids=positions,
                cache=cache.cache,
                use_cache=True,
                capture_layers=capture,
                logits_to_keep=N + 1,
            )
        paths, nexts, probs = _verified(out.logits, trees, sampling, session, generator)

        # 3. Keep both caches on the accepted paths; each row's new token stays pending.
        cache.keep(
            [
                list(range(P - len(pend), P)) + [P + c for c in path]
                for pend, path in zip(pending, paths, strict=True)
            ]
        )
        for i, r in enumerate(active):
            cached[r] = length[r] + len(paths[i])
        t2 = time.perf_counter()
        if session is not None:  # hidden states: for drafters fed by the target's (EAGLE)
            no_states = [None] * len(active)
            hidden = _row_states(out.hidden_states, pending, trees, P) if capture else no_states
            session.accept(trees, paths, hidden)
        t3 = time.perf_counter()

        # 4. Emit accepted + bonus/correction per row, cut at the first EOS and at
        # max_new_tokens; a finished row leaves the batch.
        done = []
        for i, r in enumerate(active):
            tree, path = trees[i], paths[i]
            new, stop = _emitted(tree, path, nexts[i], remaining[i], eos)
            seq[r, length[r] : length[r] + len(new)] = torch.tensor(new, device=device)
            if not sampling.greedy:
                # emitted token j was chosen at row 0 (the root) or at its accepted parent's row
                at = ([0] + [1 + c for c in path])[: len(new)]
                log_p[r] += probs[i][at, new].double().log().sum()  # no sync per step
                row_stats[r].log_p_tokens += len(new)
            length[r] += len(new)
            row_stats[r].record_step(len(tree), tree.depth, len(path), len(new))
            if stop:
                done.append(i)
        stats.draft_seconds += (t1 - t0) + (t3 - t2)
        stats.verify_seconds += t2 - t1
        if done:
            if session is not None:
                peak_memory = max(peak_memory, session.extra_memory_bytes())
                for i in done:
                    row_stats[active[i]].copied_passes = session.row_copied_passes(i)
            keep = [i for i in range(len(active)) if i not in done]
            active = [active[i] for i in keep]
            if active:
                cache.select_rows(keep)
                if session is not None:
                    session.drop(keep)
    stats.total_seconds = time.perf_counter() - start
    stats.drafter_kv_bytes = peak_memory
    for r in range(rows):
        row_stats[r].log_p_sum = float(log_p[r])
    rows_out = [seq[r, prompt_len[r] : length[r]] for r in range(rows)]
    return _output(rows_out, stats, row_stats, pad)


def _drafted(session: BatchSession, contexts: list[torch.Tensor], remaining: list[int]):
    """Each row's draft: a tree the session proposes for its context ((1, length) ids), no
    deeper than its remaining tokens - 1; a row with one token left drafts nothing."""
    trees = session.propose(
        [
            DraftContext(ids, max_depth=left - 1) if left > 1 else None
            for ids, left in zip(contexts, remaining, strict=True)
        ]
    )
    if __debug__:  # a drafter bug stops here, not as a wrong verification
        for tree in trees:
            tree.check()
    return trees


def _verified(logits, trees, sampling, session, generator):
    """Each row's accepted path through its tree and the target's own next token, and at
    T > 0 each row's p (the target's distribution at its root and nodes)."""
    top = logits.argmax(-1).tolist() if sampling.greedy else None
    paths, nexts, probs = [], [], []
    for i, tree in enumerate(trees):
        n = len(tree)
        if sampling.greedy:
            path, next_token = verify_greedy(tree, top[i][: n + 1])
        else:
            p = process_logits(logits[i, : n + 1], sampling)
            own = session.verify_sampled(i, tree, p, generator) if session else None
            path, next_token = own if own is not None else verify_sampling(tree, p, generator)
            probs.append(p)
        paths.append(path)
        nexts.append(next_token)
    return paths, nexts, probs


def _row_states(hidden_states, pending, trees, P):
    """Each row's captured hidden states over its pending tokens and tree: {layer: (1, n, H)}."""
    return [
        {layer: h[i : i + 1, P - len(pend) : P + len(tree)] for layer, h in hidden_states.items()}
        for i, (pend, tree) in enumerate(zip(pending, trees, strict=True))
    ]


def _output(rows_out: list[torch.Tensor], stats: Stats, row_stats: list[Stats], pad: int):
    """The call's GenerateOutput: each row's new tokens, padded on the right, and its stats
    merged with the call's own (times, extra memory, whether a drafter drafted)."""
    for row in row_stats:
        for name in ("lossy", "drafter_off", "copies", "drafter_params"):  # the call's
            setattr(row, name, getattr(stats, name))
    merged = functools.reduce(Stats.merge, row_stats)  # one row: its own Stats
    for name in ("total_seconds", "draft_seconds", "verify_seconds", "drafter_kv_bytes"):
        setattr(merged, name, getattr(stats, name))
    merged.batch_size = len(rows_out)
    lengths = [len(row) for row in rows_out]
    shape, device = (len(rows_out), max(lengths)), rows_out[0].device
    tokens = torch.full(shape, pad, dtype=torch.long, device=device)
    for r, row in enumerate(rows_out):
        tokens[r, : lengths[r]] = row
    return GenerateOutput(tokens, merged, lengths, row_stats, pad)


def drafting_session(
    target: Target, drafter, decode: DecodeConfig | None
) -> tuple[BatchSession, Stats]:
    """The session `generate` drafts one sequence with at temperature 0 (a batch of one, with
    copying in front where `decode` asks for it) and its fresh stats, for code that walks the
    loop's steps itself (simulation/serving_parity.py)."""
    sampling = SamplingSettings()
    session, stats, _ = _start_session(target, drafter, sampling, None, decode, {})
    return session, stats


def _check_inputs(target, input_ids, max_new_tokens, temperature, top_p, top_k):
    """The prompts as 1-D tensors, or a clear error for input the loop cannot honour."""
    prompts = _prompts(input_ids)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    limit = getattr(target.config, "max_position_embeddings", None)
    for r, ids in enumerate(prompts):
        which = f"prompt {r}" if len(prompts) > 1 else "the prompt"
        if len(ids) == 0:
            raise ValueError(f"{which} is empty: give at least one token (e.g. the BOS token)")
        if limit is not None and len(ids) + max_new_tokens > limit:
            raise ValueError(
                f"{which} ({len(ids)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
                f"the target's {limit} positions; shorten it or ask for fewer new tokens"
            )
        if (ids < 0).any() or (ids >= target.vocab_size).any():
            raise ValueError(f"{which}: input_ids must be token ids in [0, {target.vocab_size})")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 is off), got {top_k}")
    return prompts


def _prompts(input_ids) -> list[torch.Tensor]:
    """input_ids as a list of 1-D long tensors: one prompt ((seq,) or (1, seq)), a (batch, seq)
    tensor, or a list of prompts (lists or 1-D tensors) of any lengths."""
    if isinstance(input_ids, (list, tuple)) and any(
        isinstance(p, (list, tuple, torch.Tensor)) for p in input_ids
    ):
        if not all(isinstance(p, (list, tuple, torch.Tensor)) for p in input_ids):
            raise ValueError(
                "input_ids mixes token ids and prompts: give one prompt (a list of ids) or a "
                "list of prompts (each a list of ids)"
            )
        prompts = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in input_ids]
        if not prompts:
            raise ValueError("input_ids is an empty list of prompts: give at least one")
        return prompts
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be (seq,) or (batch, seq); got shape {tuple(ids.shape)}")
    if ids.shape[0] == 0:
        raise ValueError("input_ids holds no prompt: give at least one")
    return list(ids)


def _start_session(target, drafter, sampling, generator, decode, settings, batch_size=1):
    """The drafting session for this call (None for plain decoding; else a BatchSession, one
    prompt being a batch of one), fresh stats and the resolved decoding settings (None for plain
    decoding): those of the settings' batch_schedule entry for `batch_size` rows, which may
    turn the drafter off (stats.drafter_off)."""
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
        drafter.checkpoint.target_fingerprint,
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
    copying = decode.lookup_ngram > 0 and not isinstance(drafter, PromptLookupDrafter)
    stats.drafter_params = drafter.num_extra_parameters(target)
    stats.copies = copying
    if batch_size > 1:
        rows = decode.batch_drafting == "rows"
        start = drafter.row_sessions if rows else drafter.new_batch_session
        session = start(target, batch_size, sampling=sampling, decode=decode, generator=generator)
    else:
        session = drafter.new_session(target, sampling=sampling, decode=decode, generator=generator)
        # a batch of one: the kind's session of one row, or its sequence's session in a RowSessions
        session = session.rows if isinstance(session, OneRow) else RowSessions([session])
    if copying:
        gamma = decode.lookup_gamma or decode.gamma
        session = CopyingRows(session, batch_size, decode.lookup_ngram, gamma)
    stats.lossy = session.lossy and not sampling.greedy
    return session, stats, decode
