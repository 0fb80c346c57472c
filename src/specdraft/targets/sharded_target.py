"""A target partitioned over the processes by DeepSpeed ZeRO-3: each process holds a shard of every
weight and gathers a module's weights for its forward only (docs/architecture.md, "Sharded
targets").
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specdraft.precision import to_dtype
from specdraft.targets.target import (
    Target,
    TargetError,
    checkpoint_dtype,
    target_path,
    unreachable,
    weights_hash,
)


class ShardedTarget(Target):
    """A target partitioned over the processes by DeepSpeed ZeRO-3 (`load_sharded_target`): each
    process holds 1/N of every weight (but the smallest, the norms, which stay whole) and
    all-gathers a module's weights only for the length of its forward, so a target too big for one device runs on N of them while each process trains
    on its own batch. The gathers are collectives: every process must run the same forwards (the
    trainer keeps them in step, evaluation included). Outside a forward its weights are not
    whole, so a drafter takes the embedding and LM head from an embeddings-only copy
    (`load_target(embeddings_only=True)`)."""

    def __init__(self, engine, tokenizer, name: str | None = None) -> None:
        super().__init__(engine.module, tokenizer, name=name)
        self.engine = engine
        self.complete = False  # each process holds a part of every weight outside a forward
        embedding = self.model.get_input_embeddings()
        with self.whole(embedding):  # every process builds the target: the gather is collective
            digest = weights_hash(self.model)
        if digest is not None:
            self.fingerprint["weights"] = digest

    @property
    def device(self) -> torch.device:
        return torch.device(self.engine.device)

    def to(self, device: torch.device | str) -> ShardedTarget:
        """ZeRO-3 placed each process's part on its own device already."""
        return self

    def whole(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """`module`'s weights gathered whole for the context (read-only; a collective: every
        process must enter it, as when all build the same drafter)."""
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)

    def parameters_held(self) -> tuple[int, int]:
        """(elements of the target's weights this process holds, elements in all)."""
        held = total = 0
        for p in self.model.parameters():
            full = getattr(p, "ds_numel", p.numel())
            total += full
            held += p.ds_tensor.numel() if hasattr(p, "ds_tensor") else full
        return held, total

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise TargetError(self._whole_weights("embed"))

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TargetError(self._whole_weights("lm_head"))

    def _whole_weights(self, what: str) -> str:
        return (
            f"{what} needs whole weights, and this target ({self.name}) is sharded by ZeRO-3: "
            "take the embedding and LM head from load_target(..., embeddings_only=True)"
        )


def load_sharded_target(
    name: str,
    *,
    dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    persistence_threshold: int = 10_000,
    zero_options: dict | None = None,
) -> ShardedTarget:
    """The target partitioned over this job's processes by DeepSpeed ZeRO-3 inference (no
    optimizer): transformers builds it under deepspeed.zero.Init, so no process ever holds the
    whole model (a 70B target's 140 GB in bf16 would not fit one GPU, nor eight copies of it host
    memory); weights of at most `persistence_threshold` elements (the norms) stay whole on every
    process, as gathering them would cost more than they weigh.

    Every process of the job must call it (the partitioning is a collective). Started with
    `accelerate launch` or `torchrun`; the process group is created here if nobody has yet (gloo
    without a GPU, as DeepSpeed's CPU accelerator runs on). Run directly, without a launcher, it
    makes a group of one and sets LOCAL_RANK=0 for the rest of the process, since ZeRO-3 reads
    it in every forward; accelerate then runs that process as a distributed job of one."""
    try:
        import deepspeed
    except ImportError as err:
        raise TargetError(
            "target_sharding=zero3 needs DeepSpeed: pip install deepspeed (or target_sharding=none)"
        ) from err
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations import deepspeed as hf_deepspeed

    path = target_path(name)
    model_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    saved = checkpoint_dtype(model_config) or torch.float32
    dtype = saved if dtype is None or dtype == "auto" else to_dtype(dtype)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not torch.distributed.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ or "WORLD_SIZE" in os.environ:  # a launcher's: its rendezvous
            deepspeed.init_distributed(dist_backend=backend)
        else:  # run directly: a group of one (DeepSpeed would otherwise look for MPI), whose
            # LOCAL_RANK ZeRO-3 reads in every forward (accelerate then runs one process as a
            # distributed job of one, as under torchrun)
            os.environ["LOCAL_RANK"] = "0"
            torch.distributed.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
            )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": persistence_threshold,
            # a frozen target's module runs once per forward (no backward through it): release
            # its gathered weights right after, rather than keeping those due again within
            # DeepSpeed's default reuse distance (1e9 elements: a whole small model stays
            # gathered)
            "stage3_max_reuse_distance": 0,
            **(zero_options or {}),
        },
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
    }
    # transformers builds and loads the model partitioned while this config is registered (a
    # weak reference: the object must live through from_pretrained); whatever was registered
    # before (accelerate's own, when the drafter trains under DeepSpeed too) is put back.
    saved_ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    registered = HfDeepSpeedConfig(config)
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, trust_remote_code=trust_remote_code
            )
        except OSError as err:
            raise unreachable(name, err) from err
        engine, *_ = deepspeed.initialize(model=model, config=config)
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved_ref
        del registered
    target = ShardedTarget(engine, tokenizer, name=name)
    target.saved_dtype = saved
    return target


def free_port() -> int:
    """A TCP port nothing listens on now (the OS's pick): for a process group of one, or a
    server started to be measured (measuring/llamacpp.py)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
