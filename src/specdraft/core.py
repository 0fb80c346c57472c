"""The drafting types every part of specdraft shares. Imports nothing of ours but the config
engine's field helpers (specdraft/config.py, the same bottom layer).

This is the bottom of the layering (docs/architecture.md, "Layers"): the draft tree and what a
session sees, the decoding and sampling settings, tree masks, KV-cache compaction, the EOS ids
and the target fingerprint check; specdraft/drafting.py turns logits into drafted tokens on
these. Targets, drafter kinds, the loop and the trainer all build on both, so each exists once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch

from specdraft.batch_schedule import checked_schedule
from specdraft.config import check_choices, choice

# --- settings -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingSettings:
    """How the target's logits become the distribution p that output follows (process_logits)."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class DecodeConfig:
    """How a drafter drafts in the loop: the keys every kind takes, saved in its checkpoint as
    its defaults (`decode` section of a training config) and overridable at evaluation
    (`--drafter FOLDER:key=value`). Never stored on a module after loading; sessions get one.

    A kind with settings of its own (LayerSkip's exit layer, Medusa's typical acceptance, the
    two-model draft's dynamic gamma) declares them in its file as a subclass naming its owner,
    `class LayerSkipDecode(DecodeConfig, owner="LayerSkip")`, and sets it as the drafter's
    `decode_class`; `of` turns any settings into that class, refusing another kind's setting
    by the owner's name."""

    # The kind whose own settings a subclass adds ("" here: every kind takes these).
    owner: ClassVar[str] = ""

    # Draft depth: a chain drafts up to this many tokens, a tree grows this many levels. Also the
    # depth of the simulated tau reported during training.
    gamma: int = 5
    # 1: a chain. k > 1: a tree; EAGLE and two-model drafts grow EAGLE-2's dynamic tree, each
    # level expanding the k best nodes of the newest level into their k best children; Medusa,
    # P-EAGLE and DFlash combine each position's k best candidates (drafters/position_tree.py).
    tree_top_k: int = 1
    # Trees: draft tokens verified per step (the tree is reranked down to this many). On a CPU a
    # 16-token verification costs ~2 plain steps, so keep it small there; GPUs afford 60+.
    tree_budget: int = 12
    # Chains: stop after a position where the drafter's most likely token has less probability
    # than this (0: always draft gamma tokens). That token is still verified, but no drafting
    # pass is spent beyond it.
    stop_below: float = 0.0
    # The drafter's weights while drafting. full: as trained. int8: int8 copies with one scale
    # per output row (CPU only; a CPU drafting step streams every weight once per token). Drafts
    # change slightly; output does not.
    draft_weights: str = choice("full", "int8")
    # A batch (generate with batch > 1): "batch" drafts every row in one drafter pass per depth
    # where the kind's session drafts rows together, "rows" one pass per row, each as a single
    # sequence drafts; a batch_schedule entry may choose per batch size.
    batch_drafting: str = choice("batch", "rows")
    # Where the context's last lookup_ngram or more tokens occurred before, draft what followed
    # them (prompt lookup, up to lookup_gamma tokens, else gamma; no drafter pass) instead of
    # running the drafter; 0: always the drafter. Repetitive text is drafted for free and
    # exactly.
    lookup_ngram: int = 0
    # With lookup_ngram: a copy drafts up to this many tokens (0: gamma, as the drafter). A copy
    # costs no drafting pass, and on a CPU a pass verifying 8 tokens costs about what one
    # verifying 3 does (BENCHMARKS.md, "Copies longer than the drafter's chains"), so a drafter
    # tuned to short chains (LayerSkip's γ 2-3) still wants long copies.
    lookup_gamma: int = 0
    # Settings by batch size (docs/tuning.md, "By batch size"): entries by increasing
    # batch_size, each the settings that change from that batch size up to the next entry's,
    # `{batch_size: 4, gamma: 3}`, or `{batch_size: 16, off: true}`: no drafting there (plain
    # decoding). Below the first entry, and with none, these settings apply. scripts/tune.py
    # --batch-sizes measures one; for_batch reads it.
    batch_schedule: list[dict[str, Any]] = field(default_factory=list)

    def __init_subclass__(cls, owner: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not owner:
            raise TypeError(f"{cls.__name__}: a kind's decoding settings name their owner")
        cls.owner = owner
        _KIND_DECODES.append(cls)

    def __post_init__(self) -> None:
        integers = (
            ("gamma", 1),
            ("tree_top_k", 1),
            ("tree_budget", 1),
            ("lookup_ngram", 0),
            ("lookup_gamma", 0),
        )
        for key, low in integers:
            check_integer(self, key, low)
        stop = self.stop_below
        if isinstance(stop, bool) or not isinstance(stop, (int, float)) or not 0 <= stop < 1:
            raise ValueError(f"stop_below must be a number in [0, 1); got {stop!r}")
        check_choices(self)
        # frozen: the checked schedule (typed values, sizes as ints) replaces the one given
        object.__setattr__(self, "batch_schedule", checked_schedule(self))

    @property
    def chain(self) -> bool:
        return self.tree_top_k == 1

    @property
    def lossless(self) -> bool:
        """Whether verification at temperature > 0 keeps the target's distribution exactly: True
        unless a kind's own acceptance rule says otherwise (Medusa's typical acceptance)."""
        return True

    def for_batch(self, batch_size: int) -> Self | None:
        """The settings a batch of `batch_size` rows decodes with: these, changed by the last
        batch_schedule entry whose batch_size is at most `batch_size` (none: these as they
        are), without the schedule. None where that entry is off: plain decoding."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1; got {batch_size!r}")
        entry = next(
            (e for e in reversed(self.batch_schedule) if e["batch_size"] <= batch_size), {}
        )
        if entry.get("off"):
            return None
        changes = {k: v for k, v in entry.items() if k != "batch_size"}
        return dataclasses.replace(self, batch_schedule=[], **changes)

    @classmethod
    def setting_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def own_setting_names(cls) -> list[str]:
        """The settings this kind's subclass adds to those every kind takes."""
        return [k for k in cls.setting_names() if k not in DecodeConfig.setting_names()]

    @classmethod
    def of(cls, settings: DecodeConfig | Mapping[str, Any] | None, who: str = "") -> Self:
        """`settings` (any kind's, or a saved dict) as this class: the keys it shares, and this
        class's defaults for the rest. A setting another kind owns is a ValueError naming the
        setting, its owner and `who` refuses it ("this Medusa drafter"; default: this class's
        owner), unless `settings` is another kind's DecodeConfig and the setting is at its
        owner's default there (a drafter handed another kind's settings takes the ones they
        share)."""
        if settings is None:
            return cls()
        typed = isinstance(settings, DecodeConfig)
        if typed:
            values = {k: getattr(settings, k) for k in type(settings).setting_names()}
        else:
            values = dict(settings)
        ours = set(cls.setting_names())
        for key in sorted(set(values) - ours):
            owner = owner_of(key)
            if not typed or owner is None or values[key] != getattr(owner(), key):
                raise ValueError(cls.foreign_setting(key, values[key], who))
            del values[key]
        return cls(**values)

    @classmethod
    def foreign_setting(cls, key: str, value: Any, who: str = "") -> str:
        """The message for `key`, which this class does not take: whose it is, and the fix."""
        owner = owner_of(key)
        if owner is None:
            return f"unknown decoding setting {key}; choose from {', '.join(cls.setting_names())}"
        mine = who or (f"this {cls.owner} drafter" if cls.owner else "this drafter")
        return (
            f"{key}={value!r} is a {owner.owner} drafter's decoding setting, which {mine} does "
            f"not take: drop {key}, or use a {owner.owner} drafter"
        )

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes` (keys of this class; None values are ignored), checked."""
        changes = {k: v for k, v in changes.items() if v is not None}
        for key in sorted(set(changes) - set(self.setting_names())):
            raise ValueError(self.foreign_setting(key, changes[key]))
        return dataclasses.replace(self, **changes)


# Every kind's DecodeConfig subclass, in the order they were defined (owner_of).
_KIND_DECODES: list[type[DecodeConfig]] = []


def owner_of(key: str) -> type[DecodeConfig] | None:
    """The kind's DecodeConfig subclass that declares `key`, a setting of that kind's only;
    None for a key every kind takes or none does."""
    if key in DecodeConfig.setting_names():
        return None
    return next((cls for cls in _KIND_DECODES if key in cls.setting_names()), None)


def check_integer(settings: object, key: str, low: int) -> None:
    """Raise ValueError unless settings.`key` is an integer >= low (a bool is not)."""
    value = getattr(settings, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key} must be an integer >= {low}; got {value!r}")


# --- the draft tree ---------------------------------------------------------------------------


@dataclass
class DraftTree:
    """Draft tokens hanging below the root (the context's last token, not part of the tree).

    Nodes are in topological order (a parent comes before its children) and children of one parent
    are tried in their node order during sampling. A chain is a tree with one child per node.
    """

    tokens: torch.Tensor  # (batch, n) draft token ids
    parents: list[int]  # (n,) index of each node's parent node, -1 for children of the root
    depths: list[int]  # (n,) 1 for children of the root, 2 for their children, ...
    # (batch, n, vocab): the draft distribution node i was sampled from, needed for lossless
    # sampling; None when every node was chosen deterministically (a point mass on its token).
    q: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def is_chain(self) -> bool:
        """True when node i's parent is node i - 1: plain causal attention verifies it."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @classmethod
    def empty(cls, batch: int = 1, device: torch.device | str | None = None) -> DraftTree:
        return cls(torch.empty(batch, 0, dtype=torch.long, device=device), [], [])

    @classmethod
    def chain(cls, tokens: torch.Tensor, q: torch.Tensor | None = None) -> DraftTree:
        """A chain from (batch, n) tokens; q, if given, is (batch, n, vocab)."""
        n = tokens.shape[-1]
        return cls(tokens, list(range(-1, n - 1)), list(range(1, n + 1)), q)

    def check(self) -> None:
        """Raise if the structure is inconsistent (a drafter bug, caught before verification)."""
        n = len(self.parents)
        if self.tokens.shape[-1] != n or len(self.depths) != n:
            raise ValueError(
                f"DraftTree has {self.tokens.shape[-1]} tokens, {n} parents, {len(self.depths)} depths"
            )
        for i, (p, d) in enumerate(zip(self.parents, self.depths, strict=True)):
            if not -1 <= p < i or d != (1 if p < 0 else self.depths[p] + 1):
                raise ValueError(f"DraftTree node {i}: parent {p} / depth {d} are not topological")
        if self.q is not None and self.q.shape[:2] != self.tokens.shape:
            raise ValueError(
                f"DraftTree q has shape {tuple(self.q.shape)}, tokens {self.tokens.shape}"
            )


@dataclass
class DraftContext:
    """What a session sees before proposing."""

    tokens: torch.Tensor  # (batch, seq): prompt plus every token emitted so far
    max_depth: int  # draft at most this deep: more could never be emitted (max_new_tokens)


@dataclass
class TargetOutput:
    """One forward of the target (targets/target.py) or of a stand-in (the hidden-state cache)."""

    logits: torch.Tensor  # (batch, seq, vocab); only the last `logits_to_keep` positions if set
    hidden_states: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # layer -> (batch, seq, hidden)
    cache: object | None = None  # the HF Cache after this forward, when use_cache


def ancestors(parents: list[int]) -> torch.Tensor:
    """(n, n) bool: [i, j] is True when node j is node i or one of its ancestors."""
    n = len(parents)
    anc = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:  # parents come first, so row p is already complete
            anc[i] |= anc[p]
    return anc


def float_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool "may attend" matrix as the float mask attention adds: 0 where allowed, the dtype's
    minimum elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """Node -> its children in node order; the root is -1."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    return children


def path_to(node: int, parents: list[int]) -> list[int]:
    """Node indices from the root's child down to `node` (empty for the root, -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


# --- KV caches ----------------------------------------------------------------------------------


def compact(cache, keep: int, slots: list[int]) -> None:
    """Keep a HF cache's entries [0, keep) and then the entries at keep + s for s in `slots`
    (ascending), moved into place right after `keep`: after a forward over a draft tree, the
    accepted path's entries. A prefix (a chain's accepted path) is a plain crop."""
    length = cache.get_seq_length()
    m = len(slots)
    if slots != list(range(m)):
        index = torch.tensor([keep + s for s in slots], device=cache.layers[0].keys.device)
        for layer in cache.layers:
            for kv in (layer.keys, layer.values):  # (batch, kv_heads, seq, head_dim)
                # the right side is a fresh gathered tensor, so overlapping slots are safe
                kv[:, :, keep : keep + m] = kv.index_select(2, index)
    drop = length - keep - m
    if drop > 0:
        cache.crop(-drop)


def kv_bytes(cache) -> int:
    """Bytes held by a cache's keys and values now."""
    if cache is None:
        return 0
    total = 0
    for layer in getattr(cache, "layers", ()):
        for kv in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(kv, torch.Tensor):
                total += kv.numel() * kv.element_size()
    return total


# --- the target's identity ----------------------------------------------------------------------


def eos_ids(model, tokenizer=None) -> set[int]:
    """A HF model's EOS ids: its generation config's (else its config's), as transformers'
    generate stops at; with `tokenizer`, its EOS too when the model names none."""
    config = getattr(model, "generation_config", None) or model.config
    eos = getattr(config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


# Fingerprint keys compared only where both sides record them: a target whose embedding could
# not be read whole records no weights hash (targets/target.py's make_fingerprint).
_OPTIONAL_KEYS = ("weights",)


def fingerprint_differences(expected: Mapping, actual: Mapping) -> list[str]:
    """Human-readable differences between two target fingerprints (empty when they match)."""
    keys = sorted(set(expected) | set(actual))
    keys = [k for k in keys if k not in _OPTIONAL_KEYS or (k in expected and k in actual)]
    said = {
        "weights": "the embedding's weights differ: another checkpoint of the same shape (a base "
        "model and its instruct twin, a fine-tune); strict=False loads it anyway"
    }
    return [
        said.get(k, f"{k}: expected {expected.get(k)!r}, got {actual.get(k)!r}")
        for k in keys
        if expected.get(k) != actual.get(k)
    ]


def check_fingerprint(
    expected: Mapping | None,
    actual: Mapping,
    what: str,
    *,
    keys: tuple[str, ...] | None = None,
    error: type[Exception] = ValueError,
    fix: str = "load the target it was made for, or train one for this target",
) -> None:
    """Raise `error` naming every difference when `what` (e.g. "the eagle drafter in runs/x")
    was made for a target other than the one whose fingerprint is `actual`, and `fix`. expected
    None: not recorded, nothing to check; keys: compare only these."""
    if expected is None:
        return
    if keys is not None:
        expected = {k: v for k, v in expected.items() if k in keys}
        actual = {k: v for k, v in actual.items() if k in keys}
    diffs = fingerprint_differences(expected, actual)
    if diffs:
        raise error(f"{what} was made for another target ({'; '.join(diffs)}); {fix}")


# --- what a greedy continuation looks like ------------------------------------------------


LOOP_TAIL, LOOP_PERIOD = 48, 24  # `loops`' defaults
LOOP_TOKENS = LOOP_TAIL + LOOP_PERIOD  # the fewest tokens in which they can find a loop


def loops(tokens: Sequence[int], tail: int = LOOP_TAIL, max_period: int = LOOP_PERIOD) -> bool:
    """True when the last `tail` tokens repeat with a period of at most `max_period`."""
    if len(tokens) < tail + max_period:
        return False
    end = list(tokens[-tail:])
    full = list(tokens[-tail - max_period :])
    return any(
        all(end[i] == full[max_period + i - p] for i in range(tail))
        for p in range(1, max_period + 1)
    )


def looping_share(outputs: Sequence[Sequence[int]]) -> float:
    """The fraction of `outputs` (token lists) that end in a loop (`loops`); 0 for none."""
    return sum(map(loops, outputs)) / len(outputs) if outputs else 0.0
