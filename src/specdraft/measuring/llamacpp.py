"""Decoding in llama.cpp's own server (specdraft/llamacpp_build.py builds it): greedy completions of
token ids, with and without a drafter, and llama.cpp's own counters read back.

`LlamaServer` starts `llama-server` on a GGUF target (and drafter), on a free local port, and
stops it on exit; a model llama.cpp cannot load is an error that quotes llama.cpp's own lines.
`complete` sends token ids to `/completion` at temperature 0 (llama.cpp's greedy sampler) with
no prompt cache, and reads back what it generated, its decode time (`timings.predicted_ms`, the
prompt's processing apart), the draft tokens it proposed and accepted (`timings.draft_n`,
`draft_n_accepted`) and, from `/metrics`, how many verification passes it ran
(`spec_decode_num_drafts_total`).

Below the server: the checks on an export's files before llama.cpp runs (`gguf_problems`);
greedy agreement with plain decoding, a near-tie told from a disagreement by the two tokens'
logit gap against llama.cpp's own arithmetic noise (`agreement`, `arithmetic_noise`); and what
a target pass over a block of tokens costs (`block_costs`), the ceiling of any drafter there.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specdraft.formats.gguf_export import gguf_problems
from specdraft.llamacpp_build import LlamaCpp, LlamaCppError
from specdraft.targets.sharded_target import free_port

START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 1800

# how the n-gram drafters take their draft length; every draft-* type takes --spec-draft-n-max
NGRAM_LENGTH_FLAG = {
    "ngram-simple": "--spec-ngram-simple-size-m",
    "ngram-map-k": "--spec-ngram-map-k-size-m",
    "ngram-mod": "--spec-ngram-mod-n-max",
}


@dataclass(frozen=True)
class Drafting:
    """How llama.cpp drafts: its --spec-type, the drafter's GGUF where the type needs one and the
    draft length (None: llama.cpp's default)."""

    spec_type: str
    draft: Path | None = None
    length: int | None = None

    def args(self) -> list[str]:
        args = ["--spec-type", self.spec_type]
        if self.draft is not None:
            args += ["--spec-draft-model", str(self.draft)]
        if self.length is not None:
            # several types (ngram-simple,draft-eagle3): the length is the drafter's
            types = self.spec_type.split(",")
            kind = next((t for t in types if t.startswith("draft-")), types[-1])
            flag = (
                "--spec-draft-n-max" if kind.startswith("draft-") else NGRAM_LENGTH_FLAG.get(kind)
            )
            if flag is None:
                raise LlamaCppError(f"llama.cpp's {kind} takes no draft length")
            if kind == "ngram-mod":
                args += ["--spec-ngram-mod-n-min", str(min(self.length, 48))]
            args += [flag, str(self.length)]
        return args


@dataclass
class Completion:
    """One greedy completion in llama.cpp, with its counters."""

    tokens: list[int]
    text: str
    decode_seconds: float  # llama.cpp's own generation time, the prompt's processing apart
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # of them accepted
    verifications: int = 0  # target passes that verified a draft
    stop: str = ""

    @property
    def passes(self) -> int:
        """Target passes after the prompt's: one per verification, one per token decoded
        without a draft (the first token comes from the prompt's pass)."""
        plain = len(self.tokens) - 1 - self.accepted - self.verifications
        return self.verifications + max(plain, 0)


@dataclass
class LlamaServer:
    """`llama-server` on `model` (and `drafting`), started on entering and stopped on exit."""

    engine: LlamaCpp
    model: Path
    drafting: Drafting | None = None
    threads: int = 2
    context: int = 4096
    log: Path | None = None  # where llama.cpp's own output goes (default: a temporary file)
    trace: bool = False  # llama.cpp's trace-level log, which holds its drafting statistics
    flags: tuple[str, ...] = ()  # more llama-server flags
    _process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _own_log: bool = field(default=False, init=False, repr=False)
    _url: str = field(default="", init=False, repr=False)

    def command(self, port: int) -> list[str]:
        threads = str(self.threads)
        command = [
            str(self.engine.server), "--model", str(self.model), "--host", "127.0.0.1",
            "--port", str(port), "--threads", threads, "--threads-batch", threads,
            "--ctx-size", str(self.context), "--parallel", "1", "--metrics", "--no-webui",
        ]  # fmt: skip
        command += list(self.flags)
        if self.trace:
            command += ["--log-verbosity", "4"]
        if self.drafting is not None:
            command += self.drafting.args()
            command += ["--spec-draft-threads", threads, "--spec-draft-threads-batch", threads]
        return command

    def __enter__(self) -> LlamaServer:
        if self.log is None:
            fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
            os.close(fd)
            self.log, self._own_log = Path(name), True
        try:
            return self._start()
        except BaseException:
            self._stop()
            raise

    def _start(self) -> LlamaServer:
        port = free_port()
        self._url = f"http://127.0.0.1:{port}"
        with open(self.log, "w") as out:
            self._process = subprocess.Popen(
                self.command(port), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            if self._process.poll() is not None:
                raise LlamaCppError(
                    f"llama-server stopped (exit {self._process.returncode}) before it served "
                    f"{self.model.name}{self._with()}; llama.cpp said:\n{self.said()}"
                )
            try:
                with urllib.request.urlopen(self._url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise LlamaCppError(f"llama-server did not start in {START_TIMEOUT_S} s:\n{self.said()}")

    def __exit__(self, kind, *exc) -> None:
        self._stop()
        if kind is None and self._own_log and self.log is not None:
            self.log.unlink(missing_ok=True)  # kept where something went wrong

    def _stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def _with(self) -> str:
        d = self.drafting
        if d is None:
            return ""
        length = f" n={d.length}" if d.length is not None else ""
        return f" with {d.spec_type}{length}" + (f" ({d.draft.name})" if d.draft else "")

    def said(self, lines: int = 25) -> str:
        """The last meaningful lines of llama.cpp's own output."""
        if self.log is None or not self.log.is_file():
            return "(no output)"
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def post(self, path: str, body: dict) -> dict:
        """`body` sent to the server's `path`; its JSON answer, or LlamaCppError saying why not."""
        request = urllib.request.Request(
            self._url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise LlamaCppError(
                f"llama-server refused a request to {path}: {e.read().decode(errors='replace')}"
            ) from e
        except (urllib.error.URLError, ConnectionError) as e:
            raise LlamaCppError(f"llama-server stopped answering ({e}):\n{self.said()}") from e

    def verifications(self) -> int:
        """llama.cpp's count of verification passes so far (its /metrics)."""
        with urllib.request.urlopen(self._url + "/metrics", timeout=30) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("llamacpp:spec_decode_num_drafts_total"):
                    return int(float(line.split()[-1]))
        return 0

    def complete(self, ids: list[int], max_new_tokens: int) -> Completion:
        """The greedy continuation of `ids` (at most `max_new_tokens`, stopping at the model's
        end-of-generation tokens), with llama.cpp's counters for it."""
        before = self.verifications()
        answer = self.post("/completion", greedy(ids, max_new_tokens))
        timings = answer.get("timings", {})
        return Completion(
            tokens=[int(t) for t in answer.get("tokens", [])],
            text=answer.get("content", ""),
            decode_seconds=float(timings.get("predicted_ms", 0.0)) / 1000,
            drafted=int(timings.get("draft_n", 0)),
            accepted=int(timings.get("draft_n_accepted", 0)),
            verifications=self.verifications() - before,
            stop=str(answer.get("stop_type", "")),
        )

    def logprobs_along(self, ids: list[int], steps: int, top: int = 20) -> list[dict[int, float]]:
        """Plain greedy decoding of `steps` tokens after `ids`, one token a pass as it decodes:
        at each position the log-probabilities of the `top` likeliest tokens (llama.cpp's
        distribution before sampling)."""
        body = {**greedy(ids, steps), "n_probs": top, "post_sampling_probs": False}
        answer = self.post("/completion", body)
        return [
            {int(p["id"]): float(p["logprob"]) for p in position.get("top_logprobs", [])}
            for position in answer.get("completion_probabilities") or []
        ]

    def next_token_logprobs(self, ids: list[int], top: int = 20) -> dict[int, float]:
        """The `top` likeliest next tokens after `ids` with their log-probabilities, from one
        pass over all of `ids` (the batched arithmetic of a prompt, not of a decoding step)."""
        along = self.logprobs_along(ids, 1, top)
        return along[0] if along else {}


def greedy(ids: list[int], max_new_tokens: int) -> dict:
    return {
        "prompt": [int(i) for i in ids],
        "n_predict": max_new_tokens,
        "temperature": 0.0,
        "cache_prompt": False,
        "return_tokens": True,
        "seed": 0,
    }


# --- an export's files, checked before llama.cpp runs ---------------------------------------------


@dataclass(frozen=True)
class GgufExport:
    """A `scripts/export.py --format gguf` folder: what llama.cpp is given to serve it."""

    folder: Path
    kind: str
    spec_type: str
    draft: Path
    target: Path
    target_name: str
    gamma: int
    draft_type: str = ""
    fingerprint: dict | None = None  # the target's it was trained for


def read_gguf_export(folder: Path, target_gguf: str | None = None) -> GgufExport:
    """The export in `folder` (its specdraft_gguf.json), with `target_gguf` instead of the target
    file beside it where given; LlamaCppError naming what is missing."""
    manifest_file = folder / "specdraft_gguf.json"
    if not manifest_file.is_file():
        raise LlamaCppError(
            f"{folder} holds no specdraft_gguf.json: pass a folder `scripts/export.py --format "
            "gguf` wrote"
        )
    try:
        manifest = json.loads(manifest_file.read_text())
        draft = folder / manifest["draft"]
        kind, spec_type = manifest["kind"], manifest["spec_type"]
    except (ValueError, KeyError, TypeError) as e:
        raise LlamaCppError(f"{manifest_file} is damaged ({e}): export the drafter again") from e
    if target_gguf is not None:
        target = Path(target_gguf).expanduser()
    elif manifest.get("target"):
        target = folder / manifest["target"]
    else:
        raise LlamaCppError(
            f"{folder} was exported without its target (--gguf-target none): pass --target-gguf "
            f"with the GGUF of {manifest.get('target_name', 'the target it was trained for')}"
        )
    for what, path in (("drafter", draft), ("target", target)):
        if not path.is_file():
            raise LlamaCppError(f"the {what}'s GGUF {path} is missing: export again")
    return GgufExport(
        folder, kind, spec_type, draft, target, str(manifest.get("target_name", "")),
        int(manifest.get("gamma") or 3), str(manifest.get("draft_type", "")),
        manifest.get("target_fingerprint"),
    )  # fmt: skip


# --- greedy agreement with llama.cpp's plain decoding ---------------------------------------------


@dataclass
class Agreement:
    """One prompt decoded by llama.cpp plainly and with a drafter."""

    prompt: int
    tokens: int
    equal: bool
    first_difference: int | None = None  # the first position the outputs differ at
    gap: float | None = None  # |logit difference| of the two tokens there, in plain decoding
    near_tie: bool = False

    @property
    def disagrees(self) -> bool:
        return not self.equal and not self.near_tie


def agreement(
    plain: LlamaServer,
    prompts: list[list[int]],
    plain_out: list[Completion],
    drafted_out: list[Completion],
    tie_gap: float,
) -> list[Agreement]:
    """Each prompt's outputs compared; where they part, the two tokens' log-probability gap
    (their logits' difference) in plain decoding's own distribution at that position, computed
    one token a pass as plain decoding computes it: at most `tie_gap`, llama.cpp's batched
    arithmetic in verification split a near-tie, counted apart from a disagreement."""
    results = []
    for i, (ids, a, b) in enumerate(zip(prompts, plain_out, drafted_out, strict=True)):
        if a.tokens == b.tokens:
            results.append(Agreement(i, len(a.tokens), True))
            continue
        at = next(
            (k for k, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y),
            min(len(a.tokens), len(b.tokens)),
        )
        gap = None
        if at < min(len(a.tokens), len(b.tokens)):
            along = plain.logprobs_along(ids, at + 1)
            top = along[at] if len(along) > at else {}
            x, y = a.tokens[at], b.tokens[at]
            if x in top and y in top:
                gap = round(top[x] - top[y], 4)
            # the drafted token outside plain decoding's top 20: far from a tie (gap None)
        results.append(
            Agreement(i, len(a.tokens), False, at, gap, gap is not None and abs(gap) <= tie_gap)
        )
    return results


def arithmetic_noise(
    plain: LlamaServer, prompts: list[list[int]], outs: list[Completion], positions: int = 8
) -> float:
    """How far llama.cpp's own arithmetic moves a top-1/top-2 logit gap between a one-token
    decoding pass and a pass over many tokens at once, on the same context: the largest change
    over `positions` positions of each of (up to) four prompts' plain outputs. A gap smaller than
    this can be split by verification's batched pass with no fault in the drafter."""
    largest = 0.0
    for ids, out in list(zip(prompts, outs, strict=True))[:4]:
        n = len(out.tokens)
        if n < 2:
            continue
        along = plain.logprobs_along(ids, n)
        # position 0's one-token figure is the prompt's own pass: skipped
        for p in sorted({1 + round(k * (n - 2) / max(positions - 1, 1)) for k in range(positions)}):
            one = along[p] if p < len(along) else {}
            if len(one) < 2:
                continue
            x, y = sorted(one, key=one.get, reverse=True)[:2]
            many = plain.next_token_logprobs(ids + out.tokens[:p])
            if x in many and y in many:
                largest = max(largest, abs((one[x] - one[y]) - (many[x] - many[y])))
    return round(largest, 4)


def counters(outs: list[Completion]) -> dict:
    """llama.cpp's own counters over `outs`, and what follows from them."""
    tokens = sum(len(c.tokens) for c in outs)
    seconds = sum(c.decode_seconds for c in outs)
    drafted = sum(c.drafted for c in outs)
    accepted = sum(c.accepted for c in outs)
    verifications = sum(c.verifications for c in outs)
    passes = sum(c.passes for c in outs)
    return {
        "tokens": tokens,
        "decode_seconds": round(seconds, 3),
        # as llama.cpp's predicted_per_second: the first token comes from the prompt's pass
        "tokens_per_second": round((tokens - len(outs)) / seconds, 2) if seconds else None,
        "drafted": drafted,
        "accepted": accepted,
        "verifications": verifications,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        # llama.cpp's "mean len": tokens a verification pass yields
        "mean_accepted_length": round(1 + accepted / verifications, 3) if verifications else None,
        "tau": round((tokens - len(outs)) / passes, 3) if passes else None,
    }


def verify_gguf_export(
    engine: LlamaCpp,
    export: GgufExport,
    prompts: list[list[int]],
    max_new_tokens: int,
    lengths: list[int],
    tie_gap: float | None = None,
    threads: int = 2,
    log=print,
) -> dict:
    """llama.cpp decoding `prompts` greedily with the export's drafter, at each draft length in
    `lengths`, against its plain decoding of them: outputs compared (near-ties apart: a logit gap
    within `tie_gap`, by default llama.cpp's own arithmetic noise measured on these prompts,
    `arithmetic_noise`) and its counters read back. `ok` when no prompt disagrees and drafts
    were proposed."""
    problems = gguf_problems(
        export.target, export.draft, export.spec_type, export.fingerprint, engine.source
    )
    if problems:
        raise LlamaCppError("; ".join(problems))
    report: dict = {"folder": str(export.folder), "target": str(export.target), "runs": []}
    drafted_outs = {}
    for n in lengths:
        drafting = Drafting(export.spec_type, export.draft, n)
        with LlamaServer(engine, export.target, drafting, threads=threads) as server:
            drafted_outs[n] = [server.complete(ids, max_new_tokens) for ids in prompts]
    with LlamaServer(engine, export.target, None, threads=threads) as plain:
        plain_out = [plain.complete(ids, max_new_tokens) for ids in prompts]
        report["arithmetic_noise"] = arithmetic_noise(plain, prompts, plain_out)
        report["tie_gap"] = tie_gap = report["arithmetic_noise"] if tie_gap is None else tie_gap
        for n, outs in drafted_outs.items():
            agreed = agreement(plain, prompts, plain_out, outs, tie_gap)
            run = {
                "spec_type": export.spec_type,
                "length": n,
                **counters(outs),
                "equal": sum(a.equal for a in agreed),
                "near_ties": [a.__dict__ for a in agreed if a.near_tie],
                "disagreements": [a.__dict__ for a in agreed if a.disagrees],
            }
            report["runs"].append(run)
    report["plain"] = counters(plain_out)
    report["problems"] = [
        f"n={r['length']}: prompt {d['prompt']} differs from plain decoding at token "
        f"{d['first_difference']} (logit gap {d['gap']})"
        for r in report["runs"]
        for d in r["disagreements"]
    ] + [f"n={r['length']}: llama.cpp drafted nothing" for r in report["runs"] if not r["drafted"]]
    report["ok"] = not report["problems"]
    return report


def block_costs(
    server: LlamaServer, sizes: list[int], text: list[int], context: int = 256, repeats: int = 9
) -> dict:
    """What one target pass over a block of k new tokens costs, as a multiple of a one-token
    pass, for each k in `sizes` (1 is added): llama.cpp's own prompt time for k tokens after a
    cached prefix of `context` tokens, the median of `repeats`. A lower bound on what verifying a
    draft of k - 1 tokens costs on this machine's kernels: a prompt's pass computes logits for
    its last token only, verification for all k. The tokens are taken from `text`.
    The server must keep a whole prompt's cache (a sliding-window model: `--swa-full`)."""
    text = [int(t) for t in text] or [0]
    prefix = (text * (context // len(text) + 1))[:context]
    body = {"n_predict": 1, "cache_prompt": True, "temperature": 0.0}
    server.post("/completion", {**body, "prompt": prefix})
    seconds, start, first = {}, 0, None
    for k in sorted({1, *sizes}):
        times = []
        for _ in range(repeats):
            # a block whose first token differs from the last one's: the cache holds the prefix
            start += 7
            while text[start % len(text)] == first and len(set(text)) > 1:
                start += 1
            extra = [text[(start + j) % len(text)] for j in range(k)]
            first = extra[0]
            timings = server.post("/completion", {**body, "prompt": prefix + extra})["timings"]
            if int(timings.get("prompt_n", -1)) != k:
                raise LlamaCppError(
                    f"llama-server processed {timings.get('prompt_n')} prompt tokens where {k} "
                    "were new: its prompt cache did not hold the prefix"
                )
            times.append(float(timings["prompt_ms"]))
        seconds[k] = sorted(times)[len(times) // 2] / 1000
    return {str(k): round(t / seconds[1], 3) for k, t in seconds.items()} | {
        "one_token_ms": round(seconds[1] * 1000, 2)
    }


def drafting_ms(server: LlamaServer) -> float:
    """The time llama.cpp spent drafting so far (its speculative statistics: each
    implementation's `dur(b,g,a)`, begin, generate and accept, last reported; written by a
    server started with `trace`), in milliseconds. The drafter's pass over each verified batch
    (its `process`) is not timed by llama.cpp, so not counted here."""
    last: dict[str, float] = {}
    for line in (server.log.read_text(errors="replace") if server.log else "").splitlines():
        if "statistics" in line and "dur(b,g,a) =" in line:
            impl = line.split("statistics", 1)[1].split(":", 1)[0].strip()
            begin, draft, accept = line.split("dur(b,g,a) =", 1)[1].replace("ms", "").split(",")
            last[impl] = float(begin) + float(draft) + float(accept)
    return sum(last.values())
