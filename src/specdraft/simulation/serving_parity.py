"""Training predicts serving: the simulation of serving beside the loop itself, on the same
prompts (docs/architecture.md, "Training predicts serving"; scripts/parity.py prints it).

`simulate` runs the drafter's training path (`served.served_drafts`, teacher-forced on the
target's own continuation) and walks it as the loop steps (`metrics.simulate_serving`); `serve`
decodes the same prompts with the loop. At temperature 0 the two agree exactly for a drafter
whose training and serving paths compute the same thing; where they do not, `first_difference`
compares what the drafter saw in each path at the same positions and names the first tensor
that differs.

Where a kind's training path has no served drafts for the settings (EAGLE-2's dynamic tree, the
two-model tree, dynamic gamma), or drafts otherwise than serving by design (int8 drafting
weights), `replay_serving` walks the loop's steps with the serving session
itself, teacher-forced on the continuation: each step the session drafts after the context, the
draft is verified against the continuation (at temperature 0 the target's choice after each
accepted token is the continuation's next token) and the session is handed the hidden states
of the verified positions from one forward over the whole continuation. No target pass per
step, and the same statistics as the loop, whatever the session drafts.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch

from specdraft.core import DecodeConfig, DraftContext, DraftTree
from specdraft.data.formats import Example
from specdraft.drafters.lean import int8_supported
from specdraft.drafters.served import ServedDrafts, sampled_reach, served_drafts
from specdraft.formats.reading import fine_tuned_target, load_decoding, load_drafter
from specdraft.inference.generate import drafting_session, generate
from specdraft.inference.metrics import Stats, expected_passes, served_rows, simulate_serving
from specdraft.inference.verify import verify_greedy
from specdraft.simulation.continuations import served_examples


def example_batch(example: Example, device) -> dict[str, torch.Tensor]:
    """One example as a batch of one (no padding)."""
    ids = torch.tensor([example.input_ids], device=device)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.tensor([example.loss_mask], device=device),
    }


def _teacher_forced(target, drafter, example: Example):
    """`example_batch` and the target's forward over it, with the drafter's captured layers."""
    batch = example_batch(example, target.device)
    out = target.forward(
        batch["input_ids"], attention_mask=batch["attention_mask"],
        capture_layers=list(drafter.capture_layers),
    )  # fmt: skip
    return batch, out


@torch.no_grad()
def simulate(
    target, drafter, examples: Sequence[Example], decode: DecodeConfig
) -> list[Stats] | None:
    """Per example (the target's greedy continuation of a prompt, simulation/continuations.py):
    the loop's statistics as the drafter's training path predicts them; None where its kind or
    `decode` has no simulation (served.served_drafts)."""
    decode = drafter.decode_settings(decode)
    out = []
    for example in examples:
        batch, target_out = _teacher_forced(target, drafter, example)
        drafts = training_path_drafts(drafter, batch, target_out, decode)
        if drafts is None:
            replayed = replay_serving(target, drafter, batch, target_out, decode)
            if replayed is None:
                return None
            out += replayed
            continue
        out += simulate_serving(drafts, batch, decode, drafter.drafts_after_prefill)
    return out


def merged(stats: Sequence[Stats]) -> Stats:
    """Per-example statistics summed over the examples (tau over all their passes)."""
    return functools.reduce(Stats.merge, stats, Stats())


def simulated_tau_on(
    target, drafter, prompts: Sequence[torch.Tensor], max_new_tokens: int, decode: DecodeConfig
) -> float | None:
    """The tau `simulate` predicts for greedy decoding of these prompts with `decode`: on the
    target's own greedy continuations of them (cached, simulation/continuations.py). Beside the
    tau measured on the same prompts, their gap is the difference between the drafter's
    training and serving paths alone. None where the kind has no simulation for `decode`."""
    examples = served_examples(target, prompts, max_new_tokens)
    stats = simulate(target, drafter, examples, decode)
    return None if stats is None else merged(stats).tau


@torch.no_grad()
def sampled_tau_on(
    target,
    drafter,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    decode: DecodeConfig,
    seed: int = 0,
) -> float | None:
    """The tau the loop is expected to serve sampling these prompts at temperature 1 with the
    drafter alone (no copying): on the target's own continuations of them sampled at T = 1
    (cached, simulation/continuations.py), the loop's walk in expectation
    (`metrics.expected_passes`) over the chance each draft is accepted given the tokens
    emitted (`served.sampled_reach`: the drafter's q and the target's p at those tokens,
    teacher-forced, the chain or tree and stop rule served). The continuation is one sample of
    what the loop emits, so the figure varies with `seed` as the served tau does with its
    sampling seed. None where the kind has no such walk for `decode` (EAGLE-2's dynamic tree,
    the two-model tree, a dynamic gamma)."""
    decode = drafter.decode_settings(decode)
    examples = served_examples(target, prompts, max_new_tokens, temperature=1.0, seed=seed)
    tokens = passes = 0.0
    for example in examples:
        batch, target_out = _teacher_forced(target, drafter, example)
        reach = sampled_reach(drafter, batch, target_out, decode)
        if reach is None:
            return None
        for emitted, expected in expected_passes(reach, batch, drafter.drafts_after_prefill):
            tokens, passes = tokens + emitted, passes + expected
    return tokens / passes if passes else None


@torch.no_grad()
def served_sampled_tau(
    target,
    drafter,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    decode: DecodeConfig,
    seed: int,
) -> float:
    """The tau the loop serves sampling the prompts at temperature 1 with `decode`, with one
    sampling seed: what `sampled_tau_on` estimates, with decode's copying off."""
    runs = [
        generate(target, prompt, drafter, max_new_tokens=max_new_tokens, temperature=1.0,
                 seed=seed, decode=decode).stats
        for prompt in prompts
    ]  # fmt: skip
    return merged(runs).tau


def folder_simulated_tau(
    folder,
    target,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    batch_size: int = 1,
    loaded: dict | None = None,
    temperature: float = 0.0,
) -> float | None:
    """`simulated_tau_on` (at temperature 1: `sampled_tau_on`) for a trained folder with its
    saved decoding settings as a batch of `batch_size` decodes with them (its batch_schedule's
    entry), on the target it decodes with (its own fine-tuned one for Medusa-2 and LayerSkip:
    `fine_tuned_target`, which keeps those it loads in `loaded`). None where the entry turns
    drafting off, or the kind has no simulation for the settings."""
    if temperature not in (0.0, 1.0):
        raise ValueError(f"a simulated tau is computed at temperature 0 or 1, not {temperature}")
    decode = load_decoding(folder).for_batch(batch_size)
    if decode is None:
        return None
    decoder = fine_tuned_target(str(folder), target, loaded) or target
    drafter = load_drafter(folder, decoder).eval()
    if temperature:
        return sampled_tau_on(decoder, drafter, prompts, max_new_tokens, decode)
    return simulated_tau_on(decoder, drafter, prompts, max_new_tokens, decode)


def training_path_drafts(
    drafter, batch: dict[str, torch.Tensor], target_out, decode: DecodeConfig
) -> ServedDrafts | None:
    """What greedy serving drafts after every position, by the drafter's training path
    (`served.served_drafts`); None where it has none for `decode`, or where serving computes
    otherwise by design: int8 drafting weights (drafters/lean.py), which the training path's
    full-precision modules do not round as serving does, so only `replay_serving` is exact."""
    device = batch["input_ids"].device
    if decode.draft_weights == "int8" and int8_supported(device):
        return None
    return served_drafts(drafter, batch, target_out, decode)


@torch.no_grad()
def replay_serving(
    target, drafter, batch: dict[str, torch.Tensor], target_out, decode: DecodeConfig
) -> list[Stats] | None:
    """The loop's statistics at temperature 0 per row of a batch of the target's greedy
    continuations (as metrics.served_rows reads them), walked with the drafter's serving
    session (module docstring); `target_out`: the target's forward over the batch, with the
    hidden states of the layers the drafter captures. None for a session that drafts on the
    target's own KV cache (LayerSkip), which needs the target's passes."""
    ids, rows = batch["input_ids"], []
    for b, start, end, stop in served_rows(batch):
        session, stats = drafting_session(target, drafter, decode)
        if session.drafts_on_target_cache:
            return None
        row, truth = ids[b], ids[b].tolist()
        length, cached = start, 0
        while length < stop:
            left = end - length
            tree = DraftTree.empty(device=ids.device)
            if left > 1:
                context = DraftContext(row[None, :length], max_depth=left - 1)
                tree = session.propose([context])[0]
            # the target's greedy choice after the root and after each node, where the node is
            # on the continuation: its next token (off it, verification never looks)
            chosen = [truth[length]] + [truth[length + d] for d in tree.depths]
            path, _ = verify_greedy(tree, chosen)
            hidden = None
            if session.capture_layers:
                hidden = _verified_states(target_out, b, cached, length, tree, path, session)
            session.accept([tree], [path], [hidden])
            cached = length + len(path)
            emitted = min(len(path) + 1, stop - length)
            stats.record_step(len(tree), tree.depth, len(path), emitted)
            length += emitted
        stats.copied_passes = session.row_copied_passes(0)
        rows.append(stats)
    return rows


def _verified_states(target_out, b, cached, length, tree, path, session) -> dict:
    """What a verification forward over the pending tokens [cached, length) and `tree` hands
    the session: each captured layer's states at those positions, the accepted nodes' at theirs
    on the continuation; a rejected node's are NaN (no session may read them)."""
    positions = list(range(cached, length)) + [length + d - 1 for d in tree.depths]
    rejected = [length - cached + i for i in range(len(tree)) if i not in set(path)]
    hidden = {}
    for layer in session.capture_layers:
        h = target_out.hidden_states[layer][b, positions].clone()
        h[rejected] = float("nan")
        hidden[layer] = h[None]
    return hidden


@torch.no_grad()
def serve(target, drafter, examples: Sequence[Example], decode: DecodeConfig) -> list[Stats]:
    """Per example: the loop's statistics decoding its prompt greedily for as many new tokens
    as its continuation holds."""
    out = []
    for example in examples:
        start = example.loss_mask.index(1)
        new = len(example.input_ids) - start
        run = generate(
            target, example.input_ids[:start], drafter, max_new_tokens=new, decode=decode
        )
        out.append(run.stats)
    return out


class _Recording:
    """A drafting session, recorded: every verification's hidden states the session is handed
    (the pending rows and the accepted path's, at their positions in the sequence) and every
    draft with the context length it was drafted after. Everything else goes to the session."""

    def __init__(self, session, record: dict) -> None:
        self._session, self._record = session, record
        record["capture_layers"] = list(session.capture_layers)
        self._verified = 0  # positions verified so far: the next forward's first row is there

    def __getattr__(self, name):
        return getattr(self._session, name)

    def propose(self, context):
        tree = self._session.propose(context)
        self._record["drafts"].append((context.tokens.shape[1], tree.tokens[0].tolist(), tree))
        return tree

    def accept(self, tree, path, hidden_states=None):
        if hidden_states:  # rows: the pending tokens, then the tree's nodes
            pending = next(iter(hidden_states.values())).shape[1] - len(tree)
            keep = list(range(pending)) + [pending + i for i in path]
            for layer, h in hidden_states.items():
                at = self._record["hidden"].setdefault(layer, {})
                at.update({self._verified + offset: h[0, row] for offset, row in enumerate(keep)})
            self._verified += len(keep)
        return self._session.accept(tree, path, hidden_states)


def first_difference(
    target, drafter, example: Example, decode: DecodeConfig, atol: float = 1e-4
) -> str | None:
    """Where the drafter's training and serving paths part on one example (the target's greedy
    continuation of a prompt): decode its prompt with the loop, recording what the session was
    handed, and compare it at the same positions with what the training path reads, in the
    order the drafter uses them. Names the first that differs and by how much: the target
    layers captured, then each layer's hidden states, then the drafts themselves (the
    drafter's output: its inputs agreed, so the difference is inside its computation when
    served, e.g. positions, masks, norms or scales). Where the settings are simulated by
    replaying the serving session (`training_path_drafts` has none: int8 drafting weights,
    trees, dynamic gamma), the drafts are compared with the replay's. None: in parity."""
    decode = drafter.decode_settings(decode)
    record: dict = {"drafts": [], "hidden": {}}
    start = example.loss_mask.index(1)
    new = len(example.input_ids) - start
    with _recorded(drafter, record):
        generate(target, example.input_ids[:start], drafter, max_new_tokens=new, decode=decode)
    trained = list(drafter.capture_layers)
    if sorted(record["capture_layers"]) != sorted(trained):
        return (
            f"captured hidden states: serving captures target layers {record['capture_layers']}, "
            f"training reads {trained}"
        )
    batch = example_batch(example, target.device)
    target_out = target.forward(batch["input_ids"], capture_layers=trained)
    rounding = 0.0  # the largest difference within the tolerance
    for layer in trained:
        for position, served in sorted(record["hidden"].get(layer, {}).items()):
            h = target_out.hidden_states[layer][0, position].to(served.dtype)
            diff = float((h - served).abs().max())
            if diff > atol * max(1.0, float(h.abs().max())):
                return (
                    f"captured hidden states, target layer {layer}, position {position}: served "
                    f"and training values differ by up to {diff:.3g}"
                )
            rounding = max(rounding, diff)
    drafts = training_path_drafts(drafter, batch, target_out, decode)
    if drafts is None:
        return _replayed_difference(target, drafter, batch, target_out, decode, record, rounding)
    ids = example.input_ids
    for length, tokens, tree in record["drafts"]:
        if not tokens or not tree.is_chain:
            continue
        # the served chain's accepted prefix against the one the training path predicts for a
        # draft asked for at most as many tokens as the loop asked for then
        truth = ids[length : length + len(tokens)]
        served = next((j for j, t in enumerate(truth) if tokens[j] != t), len(truth))
        cap = min(decode.gamma, len(ids) - length - 1)
        predicted = int(drafts.accepted[0, length - 1, cap - 1])
        if served != predicted:
            return (
                f"the drafter's drafts after position {length - 1}: served drafts {tokens} accept "
                f"{served}, the training path's {predicted}; the captured inputs agree, so the "
                "drafter computes differently when served (its positions, masks, norms or scales)"
            )
    return None


def _replayed_difference(
    target, drafter, batch, target_out, decode, served, rounding
) -> str | None:
    """The first draft the serving session drafts otherwise when served than when replayed on
    the continuation (`replay_serving`), after the same context; None where every draft
    agrees. `served`: the loop's record; `rounding`: how far apart the hidden states it was
    handed in the two were at most (both within the tolerance)."""
    replayed: dict = {"drafts": [], "hidden": {}}
    with _recorded(drafter, replayed):
        replay_serving(target, drafter, batch, target_out, decode)
    theirs = {length: tokens for length, tokens, _ in replayed["drafts"]}
    for length, tokens, _ in served["drafts"]:
        if length in theirs and theirs[length] != tokens:
            cause = "the session computes differently when served"
            if rounding > 0:
                cause = (
                    f"the hidden states it was handed differ by up to {rounding:.2g} (the "
                    "loop's verification forwards against one forward over the continuation "
                    "round differently)"
                    + (", which its int8 drafting weights turn into another draft"
                       if decode.draft_weights == "int8" else "")
                )  # fmt: skip
            return (
                f"the serving session's drafts after position {length - 1}: served {tokens}, "
                f"replayed on the continuation {theirs[length]}; {cause}"
            )
    return None


@contextlib.contextmanager
def _recorded(drafter, record: dict):
    """The drafter's sessions, made inside, record into `record` (`_Recording`)."""
    make = drafter.new_session

    def recorded(*args, **kwargs):
        return _Recording(make(*args, **kwargs), record)

    drafter.new_session = recorded  # an instance attribute, removed below
    try:
        yield
    finally:
        del drafter.new_session
