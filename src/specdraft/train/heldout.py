"""The held-out evaluation's figures over this process's share of the held-out examples, summed
over every process: its loss and acceptance sums (`sums`), the loop's statistics at
temperature 0 simulated on the target's own continuations (`simulate_serving`), and the tau
expected at a sampling temperature on continuations sampled there (`expected_tau`).
train/trainer.py calls them every eval_every steps; docs/architecture.md, "Training predicts
serving".

`chunks` are eval_chunks' (train/lr_schedule.py): every process runs as many forwards, and the
padding of a short share counts nothing (its weight is 0).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence

import torch

from specdraft.drafters.base import Drafter
from specdraft.drafters.served import sampled_reach
from specdraft.inference.metrics import Stats, expected_passes
from specdraft.inference.metrics import simulate_serving as walk_served_drafts
from specdraft.simulation.serving_parity import replay_serving, training_path_drafts
from specdraft.train.lr_schedule import collate
from specdraft.train.train_config import TrainConfig

Chunks = Sequence[tuple[list[int], int]]  # (example indices, weight) per forward


@torch.no_grad()
def sums(
    model: Drafter, chunks: Chunks, examples: Sequence, forward: Callable, cfg: TrainConfig, acc
) -> dict:
    """The held-out loss sum and its token count, the acceptance sums (alpha, greedy
    agreement, count per depth) and a drafter's own `eval_statistics` sums (Medusa: per-rank
    head accuracies for its tree), each summed over every process. `forward(batch)` is the
    target's forward for evaluation."""
    loss_sum = torch.zeros((), device=acc.device)
    tokens = torch.zeros((), device=acc.device)
    alpha = greedy = count = 0.0
    extra: dict[str, torch.Tensor] = {}
    model.eval()
    for batch, target_out, weight in _batches(chunks, examples, forward, acc):
        with acc.autocast():
            loss, _ = model(batch, target_out)
            a, g, c = model.acceptance(batch, target_out, cfg.decode)
            for key, v in model.eval_statistics(batch, target_out).items():
                extra[key] = extra.get(key, 0) + v.float() * weight
        loss_sum += loss.float() * weight
        tokens += model.loss_tokens(batch) * weight
        alpha = alpha + a.float() * weight
        greedy = greedy + g.float() * weight
        count = count + c.float() * weight
    model.train()
    out = {"loss": loss_sum, "tokens": tokens, "alpha": alpha, "greedy": greedy, "count": count}
    out = {k: acc.reduce(v, "sum") for k, v in out.items()}
    out["extra"] = {k: acc.reduce(v, "sum") for k, v in extra.items()}
    return out


@torch.no_grad()
def simulate_serving(
    model: Drafter,
    heldout: dict,
    chunks: Chunks,
    examples: Sequence,
    forward: Callable,
    target,
    cfg: TrainConfig,
    acc,
) -> tuple[Stats | None, str | None]:
    """The loop's statistics at temperature 0 over the held-out continuations, and how they
    were simulated: through the drafter's training path ("served": `served.served_drafts`,
    metrics.simulate_serving) with the decoding settings the run saves, or where it has none
    for those settings or serving rounds otherwise (int8 drafting), by the serving session
    itself walked on the continuations ("session": simulation/serving_parity.py, `replay_serving`);
    (None, None) where neither can (LayerSkip drafts on the target's cache). The drafter is
    read as its checkpoint would load (`_as_loaded`)."""
    total, how = Stats(), "served"
    with _as_loaded(model, heldout) as loaded:
        for batch, target_out, weight in _batches(chunks, examples, forward, acc):
            with acc.autocast():
                drafts = training_path_drafts(loaded, batch, target_out, cfg.decode)
            if drafts is not None:
                rows = walk_served_drafts(drafts, batch, cfg.decode, model.drafts_after_prefill)
            else:
                how = "session"
                with acc.autocast():
                    rows = replay_serving(target, loaded, batch, target_out, cfg.decode)
                if rows is None:
                    return None, None
            for stats in rows:
                total = total.merge(stats) if weight else total
    total = summed_over_processes(total, acc)
    return (total, how) if total.target_passes else (None, None)


@torch.no_grad()
def expected_tau(
    model: Drafter,
    heldout: dict,
    chunks: Chunks,
    examples: Sequence,
    forward: Callable,
    cfg: TrainConfig,
    acc,
) -> float | None:
    """The tau the loop is expected to serve at eval_loop.temperature over the held-out
    continuations sampled there (`served.sampled_reach` walked by metrics.expected_passes,
    as simulation/serving_parity.py's sampled_tau_on), with the decoding settings the run saves and
    without copying; None where the kind has no such walk for them. The drafter is read as its
    checkpoint would load (`_as_loaded`)."""
    tokens = torch.zeros((), device=acc.device, dtype=torch.float64)
    passes = torch.zeros((), device=acc.device, dtype=torch.float64)
    temperature = cfg.eval_loop.temperature
    with _as_loaded(model, heldout) as loaded:
        for batch, target_out, weight in _batches(chunks, examples, forward, acc):
            with acc.autocast():
                reach = sampled_reach(loaded, batch, target_out, cfg.decode, temperature)
            if reach is None:
                return None
            for emitted, expected in expected_passes(reach, batch, model.drafts_after_prefill):
                tokens += emitted * weight
                passes += expected * weight
    tokens, passes = acc.reduce(tokens, "sum"), acc.reduce(passes, "sum")
    return float(tokens / passes) if passes > 0 else None


def _batches(chunks: Chunks, examples: Sequence, forward: Callable, acc) -> Iterator[tuple]:
    """(batch, the target's forward of it, weight) per chunk."""
    for chunk, weight in chunks:
        batch = collate([examples[i] for i in chunk], acc.device)
        yield batch, forward(batch), weight


@contextlib.contextmanager
def _as_loaded(model: Drafter, heldout: dict) -> Iterator[Drafter]:
    """The drafter in eval mode as its checkpoint would load: with the held-out statistics this
    evaluation just measured (`heldout`: Medusa's tree is built from them), on a shallow copy
    so that nothing is written on the module; back in train mode after."""
    model.eval()
    loaded = copy.copy(model)  # after eval(): its flag is copied, its modules are shared
    loaded.checkpoint = model.checkpoint.with_heldout(heldout)
    try:
        yield loaded
    finally:
        model.train()


def summed_over_processes(total: Stats, acc) -> Stats:
    """The counts of `total` (tokens, passes, reached and accepted per depth) summed over every
    process; itself in a run of one."""
    if acc.num_processes == 1:
        return total
    depth = torch.tensor([len(total.reached_at)], device=acc.device)
    depth = int(acc.gather(depth).max())
    pad = [0] * (depth - len(total.reached_at))
    sums = torch.tensor(
        [total.new_tokens, total.target_passes, *(total.reached_at + pad),
         *(total.accepted_at + pad)], device=acc.device, dtype=torch.float64,
    )  # fmt: skip
    sums = acc.reduce(sums, "sum").long().tolist()
    out = Stats(new_tokens=sums[0], target_passes=sums[1])
    out.reached_at, out.accepted_at = sums[2 : 2 + depth], sums[2 + depth :]
    return out
