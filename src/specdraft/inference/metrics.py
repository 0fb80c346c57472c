"""Decoding statistics, collected as the loop runs. Definitions follow docs/architecture.md
("Metrics").

- tau: new tokens per target forward pass, bonus/correction token included (plain decoding: 1).
  The first pass also prefills the prompt; it emits tokens like any other.
- acceptance per position alpha_i: of the steps whose verification reached depth i (a draft
  existed at depth i and depths 1..i-1 were accepted), the fraction that accepted a depth-i token.
- draft / verify seconds: wall time inside `propose` vs the target forward plus acceptance.
- extra memory: drafter parameters beyond the target's, plus the drafter's KV bytes at the end.
- copied passes: target passes whose draft a model drafter copied from the context instead of
  running its model (lookup_ngram, any kind), so a hybrid's figures say how much came from which.
- mean log p (temperature > 0): the mean over emitted tokens of log p(token), p the target's
  processed distribution (temperature, top-k, top-p) at that token's position. Under lossless
  sampling each term has expectation E_p[log p] = -H(p); a lossy acceptance rule (Medusa's
  typical acceptance) drifts from that, and this figure beside tau shows by how much. Not
  recorded when greedy (p is a point mass there).
- lossy: the output did not follow the target's distribution (typical acceptance at T > 0).
- drafter off: a drafter was given and its settings' batch_schedule turned it off at the batch
  size decoded, so the loop decoded plainly (DecodeConfig.for_batch).
- looping share: the fraction of greedy continuations whose tail repeats with a short period
  (`specdraft.core.loops`; continuations need LOOP_TOKENS tokens for it to tell), the
  degeneration a small or over-fitted model falls into. It says what fine-tuning a target
  (LayerSkip, Medusa-2) did to its generations, which the held-out loss does not, and how much
  copying from the context can flatter a drafter on that target.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdraft.core import DecodeConfig, DraftContext
from specdraft.drafters.prompt_lookup import PromptLookupSession
from specdraft.drafters.served import ServedDrafts


@dataclass
class Stats:
    new_tokens: int = 0
    target_passes: int = 0
    drafted: int = 0  # draft tree nodes proposed
    accepted: int = 0  # draft tokens accepted
    reached_at: list[int] = field(default_factory=list)  # index i: depth i + 1
    accepted_at: list[int] = field(default_factory=list)
    emitted_per_pass: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    drafter_params: int = 0
    drafter_kv_bytes: int = 0
    copied_passes: int = 0
    copies: bool = False  # the drafter may copy from the context (copied_passes is meaningful)
    log_p_sum: float = 0.0  # sum of log p(token) over the tokens it was recorded for
    log_p_tokens: int = 0  # tokens whose log p was recorded (0 when greedy)
    lossy: bool = False  # accepted by a rule that does not keep the target's distribution
    # sequences decoded together (generate's batch): target_passes then counts row passes, so
    # tau stays per sequence, while total_seconds is the batch's and tokens_per_s its throughput
    batch_size: int = 1
    # a drafter was given, and its settings' batch_schedule turned it off at this batch size:
    # the output is plain decoding's
    drafter_off: bool = False

    def record_step(self, tree_size: int, tree_depth: int, path_len: int, emitted: int) -> None:
        self.target_passes += 1
        self.new_tokens += emitted
        self.emitted_per_pass.append(emitted)
        self.drafted += tree_size
        self.accepted += path_len
        reached = min(path_len + 1, tree_depth)
        if reached > len(self.reached_at):
            grow = reached - len(self.reached_at)
            self.reached_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(reached):
            self.reached_at[i] += 1
            self.accepted_at[i] += i < path_len

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / r for a, r in zip(self.accepted_at, self.reached_at, strict=True)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def draft_time_frac(self) -> float:
        busy = self.draft_seconds + self.verify_seconds
        return self.draft_seconds / busy if busy > 0 else 0.0

    @property
    def mean_log_p(self) -> float | None:
        """The target's mean log-likelihood of the emitted tokens; None where not recorded."""
        return self.log_p_sum / self.log_p_tokens if self.log_p_tokens else None

    def merge(self, other: Stats) -> Stats:
        """Sum of two runs (e.g. over prompts): counts and seconds add (the passes emitted
        follow one another), flags are either's, memory figures and the batch size the larger."""
        out = Stats()
        for name in ("new_tokens", "target_passes", "drafted", "accepted", "copied_passes",
                     "log_p_tokens", "log_p_sum", "draft_seconds", "verify_seconds",
                     "total_seconds", "emitted_per_pass"):  # fmt: skip
            setattr(out, name, getattr(self, name) + getattr(other, name))
        for name in ("copies", "lossy", "drafter_off"):
            setattr(out, name, getattr(self, name) or getattr(other, name))
        for name in ("drafter_params", "drafter_kv_bytes", "batch_size"):
            setattr(out, name, max(getattr(self, name), getattr(other, name)))
        out.reached_at = _add_padded(self.reached_at, other.reached_at)
        out.accepted_at = _add_padded(self.accepted_at, other.accepted_at)
        return out

    def to_dict(self) -> dict:
        names = ("tau", "acceptance_per_position", "new_tokens", "target_passes", "drafted",
                 "accepted", "draft_seconds", "verify_seconds", "total_seconds", "tokens_per_s",
                 "draft_time_frac", "drafter_params", "drafter_kv_bytes", "copied_passes",
                 "copies", "mean_log_p", "lossy", "batch_size", "drafter_off")  # fmt: skip
        return {name: getattr(self, name) for name in names}


def _add_padded(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)), strict=True)]


def served_rows(batch: dict[str, torch.Tensor]) -> Iterator[tuple[int, int, int, int]]:
    """(row, start, end, stop) for each row of a batch of the target's own continuations with a
    served output: its prompt's length, its real length (its attention mask's sum: the prompt
    and every continuation token, including those past an EOS, which a draft may still match)
    and where the served output ends (loss_mask scores it up to and including its EOS)."""
    loss_mask = batch["loss_mask"]
    lengths = batch["attention_mask"].sum(1).tolist()
    for b in range(loss_mask.shape[0]):
        scored = loss_mask[b].nonzero()
        if len(scored):
            start = int(scored[0])
            yield b, start, int(lengths[b]), start + int(loss_mask[b].sum())


def simulated_tau(alphas: Sequence[float]) -> float:
    """Expected tokens per target pass for per-depth acceptance rates alpha_1..alpha_gamma.

    tau = 1 + sum_k prod_{i<=k} alpha_i; with every alpha_i = alpha this is Leviathan et al.'s
    (1 - alpha^(gamma+1)) / (1 - alpha).
    """
    tau, reach = 1.0, 1.0
    for alpha in alphas:
        reach *= alpha
        tau += reach
    return tau


def simulate_serving(
    drafts: ServedDrafts,
    batch: dict[str, torch.Tensor],
    decode: DecodeConfig,
    after_prefill: bool,
) -> list[Stats]:
    """The loop's statistics at temperature 0, per row of a batch of the target's own greedy
    continuations (each row: its prompt, then the target's continuation, scored by loss_mask up
    to and including the EOS that ends the served output, and unscored after it), from what
    the drafter drafts after each position (`served.served_drafts`).

    Speculative decoding of a prompt at temperature 0 is a function of the target's greedy
    continuation and the drafter: each step drafts after the context, accepts the drafts that
    equal the continuation, and emits them and the target's next token. This walks those steps
    as generate does (a draft no deeper than the tokens left allow, none before the prompt is
    verified for a drafter that needs its hidden states, output cut at the EOS), and records
    them with the loop's own `Stats.record_step`: tau and the acceptance per position equal the
    served ones. With copying (decode.lookup_ngram) a step copies where the loop's copying
    session would (drafters/prompt_lookup.py decides, on the same context).
    """
    rows = []
    accepted, depth, size = (t.tolist() for t in (drafts.accepted, drafts.depth, drafts.size))
    ids = batch["input_ids"]
    lookup = None
    if decode.lookup_ngram > 0:  # as generate builds its CopyingRows
        ngram = decode.lookup_ngram
        lookup = PromptLookupSession(max(3, ngram), ngram, decode.lookup_gamma or decode.gamma)
    for b, start, end, stop in served_rows(batch):
        stats, length = Stats(), start
        while length < stop:
            cap = min(drafts.gamma, end - length - 1)
            copy = None
            if lookup is not None and end - length > 1:
                context = DraftContext(ids[b : b + 1, :length], max_depth=end - length - 1)
                copy = lookup.propose(context).tokens[0]
            if copy is not None and len(copy):  # copied from the context: no drafter pass
                truth = ids[b, length : length + len(copy)]
                k = int((copy == truth).long().cumprod(0).sum())
                d = n = len(copy)
                stats.copied_passes += 1
            elif cap > 0 and not (after_prefill and length == start):
                c = length - 1  # the context's last token
                k, d, n = accepted[b][c][cap - 1], depth[b][c][cap - 1], size[b][c][cap - 1]
            else:  # nothing drafted: the step emits the target's token alone
                k = d = n = 0
            emitted = min(k + 1, stop - length)
            stats.record_step(n, d, k, emitted)
            length += emitted
        stats.copies = lookup is not None
        rows.append(stats)
    return rows


def expected_passes(
    reach: torch.Tensor, batch: dict[str, torch.Tensor], after_prefill: bool
) -> list[tuple[int, float]]:
    """Per row of a batch of the target's own continuations sampled at temperature 1: (tokens
    emitted, expected target passes) of the loop sampling them at temperature 1 without
    copying, from `served.sampled_reach` (reach (batch, seq, gamma)): `simulate_serving`'s
    walk taken in expectation.

    Given the emitted tokens, a step after a context ending at c accepts at least d drafts
    with probability reach[b, c, d - 1] (at most as deep as the tokens left allow), and emits
    the accepted ones and the target's next token. The expected passes from each length on
    follow backwards from the end: E[L] = 1 + sum_k P(k accepted) E[L + k + 1]. Where reach
    is 0 or 1 (greedy agreement) this is `simulate_serving`'s count of passes exactly."""
    rows = []
    gamma = reach.shape[-1]
    reach = reach.double().tolist()
    for b, start, end, stop in served_rows(batch):
        passes = [0.0] * (stop + 1)  # expected passes from each length on
        for length in range(stop - 1, start - 1, -1):
            cap = min(gamma, end - length - 1)
            drafted = cap > 0 and not (after_prefill and length == start)
            at_least = reach[b][length - 1][:cap] if drafted else []
            expected, above = 1.0, 1.0  # P(at least k accepted), k = 0 first
            for k in range(len(at_least) + 1):
                # estimated reaches can rise by rounding; a deeper node never beats its parent
                below = min(at_least[k], above) if k < len(at_least) else 0.0
                expected += (above - below) * passes[min(length + k + 1, stop)]
                above = below
            passes[length] = expected
        rows.append((stop - start, passes[start]))
    return rows
