"""The end of a training script: the simulated tau before and after training, then the saved
drafter served in our loop against plain decoding (tuned first where the config asks), written to
output_dir/eval_loop.json and said in one line. The inference layer measures; this module knows
the training config and result it measures for.
"""

from __future__ import annotations

import dataclasses
import json

import torch
from accelerate import PartialState

from specdraft.data.benchmarks import Request
from specdraft.formats.checkpoint import set_decode
from specdraft.formats.reading import load_decoding, load_drafter
from specdraft.measuring.measure import (
    choose_threads,
    load_prompts,
    measure_vs_plain,
    read_requests,
    request_ids,
)
from specdraft.measuring.tuning import default_space, search_decode
from specdraft.precision import native_bf16, to_dtype
from specdraft.simulation.continuations import (
    CORPUS,
    SERVED_GREEDY,
    SERVED_SAMPLED,
    served_examples,
)
from specdraft.targets.hidden_cache import CachedTarget
from specdraft.targets.target import load_target


def loop_prompts(eval_loop, data_path: str, target, eval_examples) -> list[Request]:
    """The requests a training script measures its drafter on after training (every turn of
    each), read before training starts so that a bad prompt file fails at once (their first
    turns are tokenized here). `eval_loop` is the config's `LoopEvalConfig`. Empty when the
    measurement is off."""
    if not eval_loop.enabled:
        return []
    source = _prompt_source(eval_loop, data_path)
    requests = read_requests(source, eval_loop.num_prompts, eval_examples)
    for r in requests:
        request_ids(target.tokenizer, r, [])
    return requests


def _prompt_source(eval_loop, data_path: str) -> str:
    """eval_loop.prompts; auto: the demo's for the demo corpus, else the held-out split's."""
    auto = "demo" if data_path == "demo" else "eval"
    return auto if eval_loop.prompts == "auto" else eval_loop.prompts


def heldout_examples(cfg, target, eval_examples) -> tuple[list, str]:
    """(the examples held-out evaluation runs on, which text they are: continuations.SERVED_GREEDY,
    SERVED_SAMPLED or CORPUS), for `cfg.eval_on`. Served: the target's own continuations of the
    eval_loop prompts (cached; the first process decodes them, the others wait and read the
    cache), so the simulated tau is for the prompts and lengths the loop is measured on."""
    whole = getattr(target, "complete", False) and not isinstance(target, CachedTarget)
    auto_corpus = cfg.eval_on == "auto" and not (whole and cfg.eval_loop.enabled)
    if cfg.eval_on == "corpus" or cfg.eval_every == 0 or auto_corpus:
        return list(eval_examples), CORPUS
    if not whole:
        raise ValueError(
            "eval_on=served decodes with the target, and this run holds only part of it (a "
            "hidden_cache or target_sharding): set eval_on=corpus or auto"
        )
    loop = cfg.eval_loop
    source = _prompt_source(loop, cfg.data.path)
    prompts = load_prompts(source, loop.num_prompts, target, eval_examples)
    with PartialState().main_process_first():  # one process decodes; the others read its cache
        examples = served_examples(
            target, prompts, loop.max_new_tokens, loop.temperature, seed=cfg.seed
        )
    return examples, SERVED_GREEDY if loop.temperature == 0 else SERVED_SAMPLED


def loop_dtype(asked: str, target) -> torch.dtype:
    """The target's precision in the end-of-run measurement: as saved (auto), bf16 where the
    device computes it natively and fp32 elsewhere (native: what a user serves), or as named."""
    if asked == "auto":
        return target.saved_dtype
    if asked == "native":
        return torch.bfloat16 if native_bf16(target.device) else torch.float32
    return to_dtype(asked)


def report_after_training(target, result, prompts, cfg) -> dict | None:
    """The end of a training script (`result` from `train`, `cfg` its config): print the simulated
    tau before and after training, then serve the saved `final/` drafter in our loop against
    plain decoding on every turn of the requests `prompts` (from `loop_prompts`), write
    output_dir/eval_loop.json with the simulated tau beside the measured one, and print one
    line. The drafter decodes with the settings saved with it (cfg.decode). Returns the
    figures, or None where nothing was measured."""
    if result.stopped_by_signal or not result.main_process:
        return None
    final = result.output_dir / "final"
    # the simulated tau of the decoding it is measured with (TrainConfig.served_tau_key)
    key = cfg.served_tau_key()
    kind = "greedy" if key == "tau_greedy" else "sampled"
    last = result.evals[-1] if result.evals else {}
    simulated = last.get(key)
    if result.evals:
        print(
            f"[specdraft] simulated {kind} tau (depth {len(last['alpha'])}): before "
            f"{result.evals[0][key]:.3f}, after {simulated:.3f}; drafter in {final}"
        )
    if not prompts:
        return None
    dtype = loop_dtype(cfg.eval_loop.dtype, target)
    # the whole target, loaded here where training held a part of it (a ZeRO-3 shard, or the
    # embeddings-only copy beside a hidden-state cache) or held it in another precision (e.g.
    # trained against a bf16 copy, decoded as saved: fp32)
    if not target.complete or dtype != target.dtype:
        tuned = target.fingerprint.get("adapter")  # Medusa-2: the base with the run's adapter
        adapter = final / "adapter" if tuned else None
        target = load_target(cfg.target, dtype=dtype, device=target.device, adapter=adapter)
    threads = torch.get_num_threads()
    if target.device.type == "cpu":
        choose_threads(cfg.eval_loop.threads, target, log=lambda m: print(f"[specdraft] {m}"))
    try:
        drafter = load_drafter(final, target)
        decode, tuning = load_decoding(final), None
        space = {key: default_space(drafter, target)[key] for key in cfg.eval_loop.tune}
        if cfg.eval_loop.tune_budgets:
            space["tree_budget"] = cfg.eval_loop.tune_budgets
        if space:
            # the best settings depend on the hardware as much as on the drafter
            firsts = [
                request_ids(target.tokenizer, r, []).to(target.device)
                for r in prompts[: cfg.eval_loop.tune_prompts]
            ]
            decode, tuning = search_decode(
                target, drafter, firsts, space,
                max_new_tokens=cfg.eval_loop.max_new_tokens, start=decode,
                passes=cfg.eval_loop.tune_passes,
                temperature=cfg.eval_loop.temperature, seed=cfg.seed,
            )  # fmt: skip
            tuned = [f for f in (final, final.parent / "best") if f.is_dir()]
            for number, key in dict.fromkeys((r["pass"], r["round"]) for r in tuning):
                rows = [r for r in tuning if (r["pass"], r["round"]) == (number, key)]
                # nothing kept (every candidate changed the output): the incumbent, row 0, stays
                kept = next((r[key] for r in rows if r["kept"]), rows[0][key])
                print(
                    f"[specdraft] {key} by measured tokens/s"
                    + (f" (pass {number})" if number > 1 else "")
                    + ": "
                    + ", ".join(f"{r[key]}: {r['tokens_per_s']:.1f}" for r in rows)
                    + f" -> {kept}"
                )
            print(
                f"[specdraft] (on the first {cfg.eval_loop.tune_prompts} of the prompts measured "
                "below) " + " and ".join(map(str, tuned)) + " now decode with these settings"
            )
            for folder in tuned:  # (their train_config.yaml keeps the settings trained with)
                set_decode(folder, decode)
        m = measure_vs_plain(
            target, drafter, prompts, seed=cfg.seed, decode=decode, alone=True,
            max_new_tokens=cfg.eval_loop.max_new_tokens, temperature=cfg.eval_loop.temperature,
        )  # fmt: skip
        m["torch_threads"] = torch.get_num_threads()
        m["decode"] = dataclasses.asdict(decode)
        if tuning is not None:
            m["tuning"] = tuning
    finally:
        torch.set_num_threads(threads)
    m["simulated_tau"] = simulated
    # which text the simulation ran on, and whether it walked the loop's steps
    m["simulated_on"] = last.get("eval_on", CORPUS) if last else None
    m["simulation"] = last.get(f"{kind}_simulation")
    path = result.output_dir / "eval_loop.json"
    path.write_text(json.dumps(m, indent=2) + "\n")
    sim = "none" if simulated is None else f"{simulated:.3f} on {m['simulated_on']} text"
    notes = ""
    if m.get("copied_share") is not None:  # a hybrid: say how much of it was the model
        notes = f", {m['copied_share']:.0%} of passes verified a draft copied from the context"
    if m["lossy"]:  # a speedup bought with output that no longer follows the target
        notes += (
            f"; LOSSY (typical acceptance): mean log p {m['mean_log_p']:.3f} vs plain "
            f"sampling's {m['ar_mean_log_p']:.3f}"
        )
    turns = f" ({len(prompts)} requests, every turn)" if m["num_prompts"] > len(prompts) else ""
    print(
        f"[specdraft] in the loop on {m['num_prompts']} prompts{turns} x "
        f"{m['max_new_tokens']} new tokens: measured tau {m['tau']:.3f} (simulated {sim}), "
        f"speedup {m['speedup_vs_ar']:.2f}x plain decoding ({m['tokens_per_s']:.1f} vs "
        f"{m['ar_tokens_per_s']:.1f} tokens/s, same process, {m['torch_threads']} CPU "
        f"thread(s)){notes}; {path}"
    )
    if "alone" in m:  # the drafter's own share: the same settings with copying off
        solo = m["alone"]
        print(
            f"[specdraft] the drafter alone (lookup_ngram=0, measured beside it): tau "
            f"{solo['tau']:.3f}, speedup {solo['speedup_vs_ar']:.2f}x ({solo['tokens_per_s']:.1f} "
            "tokens/s)"
        )
    for key, what in (("by_category", "per category"), ("by_turn", "per turn")):
        if key in m:  # the drafter as measured, then alone: speedup (tau) per group
            for figures, who in (
                (m, "with copying" if "alone" in m else ""),
                (m.get("alone"), "alone"),
            ):
                if figures and key in figures:
                    cells = ", ".join(
                        f"{'turn ' if key == 'by_turn' else ''}{g} {f['speedup_vs_ar']:.2f}x "
                        f"(τ {f['tau']:.2f})"
                        for g, f in figures[key].items()
                    )
                    print(f"[specdraft] {what}{' ' + who if who else ''}: {cells}")
    # The parity check that costs nothing more: on the same prompts, greedy, with the settings
    # trained for, the walk of the loop's steps predicts the measured tau exactly
    # (the simulation walks the first turns' continuations: against turn 1's measured tau)
    exact = m["simulation"] == "served" and m["simulated_on"] == SERVED_GREEDY
    if exact and tuning is None and m["decode"] == dataclasses.asdict(cfg.decode):
        gap = simulated / m.get("by_turn", {}).get("1", m)["tau"] - 1
        print(
            "[specdraft] training predicts serving: simulated and measured tau agree"
            if abs(gap) < 1e-9
            else f"[specdraft] simulated tau is {gap:+.2%} off the measured one on the same "
            f"prompts: `python scripts/parity.py {final}` names where training and serving part "
            "(precision differs where training ran in bf16)"
        )
    return m
